"""DVC stage: the tokenizer and the tiny Llama pretrained on the LLM suite's corpus."""

import time

from stages._common import device, run


def stage(params, root, args):
    from mergecal.pipeline.tracks.causal_lm.built import stages as llm

    start = time.perf_counter()  # printed to the stage log only: outputs carry no wall-clock figure
    meta = llm.pretrain(params, root, device=device(params))
    print(f"pretrained {meta['parameters']} parameters on {meta['n_blocks']} blocks: loss {meta['first_loss']:.2f} -> "
          f"{meta['final_loss']:.2f} in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
