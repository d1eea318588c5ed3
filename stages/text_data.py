"""DVC stage: the text task suite (data/text) from offline materials."""

from stages._common import run


def stage(params, root, args):
    from mergecal.pipeline.tracks.text.built import stages as text

    manifest = text.build_data(params, root)
    print(f"data/text: {len(manifest['tasks'])} tasks")


if __name__ == "__main__":
    raise SystemExit(run(stage))
