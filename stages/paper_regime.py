"""DVC stage (papers/dvc.yaml, `make paper`): one regime of the papers' profile (``vision.paper_regimes``) for one
fine-tuning seed: the fine-tunes it adds to the default run's, its diagnostics, and DisTaC with each step's
trajectory, under models/<backbone>/seeds/<seed>/regimes/<regime>/."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.errors import ParameterError
    from mergecal.pipeline.tracks.clip.built import stages as vision

    regime = args.regime
    if regime not in params.vision.paper_regimes or args.seed is None:
        raise ParameterError(f"--regime {regime!r} --seed {args.seed}: give a seed of params.yaml's seeds and a regime "
                             f"of vision.paper_regimes ({', '.join(params.vision.paper_regimes) or 'none'})")
    where = device(params)
    vision.finetune_all(params, root, seed=args.seed, device=where, workers=params.threads, progress=False,
                        regime=regime)
    tasks = vision.task_vectors(params, root, seed=args.seed, device=where, regimes=[regime])[regime]
    info = vision.distac(params, root, seed=args.seed, device=where, progress=False, regimes=[regime],
                         trajectory=True)[regime]
    acc = sum(t["test_accuracy"] for t in tasks.values()) / len(tasks)
    print(f"{regime}: fine-tuned test accuracy {acc:.3f}; DisTaC conditioned {', '.join(info['conditioned'])}")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
