"""DVC stage (one per text task): fine-tune MiniLM with the task's own head."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.text.built import stages as text

    start = time.perf_counter()  # printed to the stage log only: outputs carry no wall-clock figure
    meta = text.finetune(params, args.task, root, seed=args.seed, device=device(params))
    print(f"{args.task}: validation accuracy {meta['val_accuracy']:.3f} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
