"""DVC stage (papers/dvc.yaml, `make paper`): one fine-tuning seed's seq2seq experts, every regime of
seq2seq.paper_regimes (full fine-tunes, IA³ adapters), and each regime's references, under
models/<seq2seq.backbone>/seeds/<seed>/."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.errors import ParameterError
    from mergecal.pipeline.tracks.seq2seq.built import stages as seq2seq

    if args.seed is None:
        raise ParameterError("--seed: give a seed of params.yaml's seeds")
    for regime in params.seq2seq.paper_regimes:
        report = seq2seq.build_regime(params, root, regime, seed=args.seed, device=device(params))
        accuracy = sum(t["test_accuracy"] for t in report["tasks"].values()) / len(report["tasks"])
        print(f"seq2seq {regime}, seed {args.seed}: experts' own test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
