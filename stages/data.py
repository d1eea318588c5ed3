"""DVC stage: generate the procedural vision suite (data/vision)."""

from stages._common import run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.built import stages as vision

    manifest = vision.build_data(params, root)
    print(f"data/vision: {len(manifest['digests'])} splits")


if __name__ == "__main__":
    raise SystemExit(run(stage))
