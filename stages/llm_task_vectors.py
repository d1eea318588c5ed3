"""DVC stage: the LLM experts' task vectors (norms per layer type) and lm-eval scores of base and experts
(normalized score's denominator)."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.causal_lm.built import stages as llm

    start = time.perf_counter()
    report = llm.references(params, root, seed=args.seed, device=device(params))
    base = report["base"]["test"]
    for task, info in report["tasks"].items():
        print(f"{task}: expert {info['test_accuracy']:.3f}, base {base[task]:.3f}; |tau| {info['norm']:.2f} "
              f"({info['relative_norm']:.4f} of |theta_0|)")
    print(f"scored in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
