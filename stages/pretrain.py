"""DVC stage: pretrain the default CLIP contrastively, cache the zero-shot heads, score zero-shot."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.clip.built import stages as vision

    start = time.perf_counter()  # printed to the stage log only: outputs carry no wall-clock figure
    report = vision.pretrain(params, root, device=device(params))
    accuracy = [r["test"]["accuracy"] for r in report["zeroshot"].values()]
    print(f"pretrained in {time.perf_counter() - start:.0f} s; "
          f"zero-shot test accuracy {sum(accuracy) / len(accuracy):.3f}")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
