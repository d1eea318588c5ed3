"""DVC stage (one per LLM task): fine-tune the base model into the task's expert."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.causal_lm.built import stages as llm

    start = time.perf_counter()  # printed to the stage log only: outputs carry no wall-clock figure
    meta = llm.finetune(params, args.task, root, seed=args.seed, device=device(params))
    print(f"{args.task}: loss {meta['first_loss']:.2f} -> {meta['final_loss']:.2f} in "
          f"{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
