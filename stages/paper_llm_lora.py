"""DVC stage (papers/dvc.yaml, `make paper`): one fine-tuning seed's LLM experts of every regime of
llm.paper_regimes (``lora``: a peft LoRA adapter of the tiny Llama per task) and each regime's references, under
models/<llm.backbone>/papers/seeds/<seed>/."""

from stages._common import device, run


def stage(params, root, args):
    from mergecal.errors import ParameterError
    from mergecal.pipeline.tracks.causal_lm.built import stages as llm

    if args.seed is None:
        raise ParameterError("--seed: give a seed of params.yaml's seeds")
    for regime, report in llm.build_paper_regimes(params, root, seed=args.seed, device=device(params)).items():
        accuracy = sum(t["test_accuracy"] for t in report["tasks"].values()) / len(report["tasks"])
        print(f"llm {regime}, seed {args.seed}: experts' own test score {accuracy:.3f}")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
