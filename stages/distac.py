"""DVC stage: DisTaC-condition each regime's task vectors (used by chains starting with 'distac')."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.built import stages as vision

    for regime, info in vision.distac(params, root, seed=args.seed, device=device(params)).items():
        print(f"{regime}: conditioned {', '.join(info['conditioned']) or 'nothing'}")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
