"""DVC stage: MAGIC's magnitude-sensitivity probe per regime."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.built import stages as vision

    for regime, keys in vision.probe(params, root, seed=args.seed, device=device(params)).items():
        print(f"{regime}: most sensitive {', '.join(keys[:3])}")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
