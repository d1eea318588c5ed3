"""What scoring a published CLIP pool costs: seconds per test image of mergecal's zero-shot evaluation (decode-free:
CLIP resize and crop of a PIL image, normalisation, the image encoder, the head), on this machine's CPU or a GPU,
and what that makes one model's full evaluation on the eight tasks' test sets (#42, item 5).

    python scripts/bench_clip_eval.py --arch ViT-B-32 --threads 2 --batch 64 --batches 4

The architecture is built with random weights (a cost does not depend on their values); the images are random
PIL images of ``--image-size`` pixels (the datasets' typical sizes differ: SUN397's are larger, MNIST's 28 px), so
the resize share is indicative. The first batch is a warm-up and not counted.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

# test images per task of the eight-task benchmark (the splits task_vectors and FusionBench score)
TEST_IMAGES = {"SUN397": 19850, "Cars": 8041, "RESISC45": 6300, "EuroSAT": 2700, "SVHN": 26032, "GTSRB": 12630,
               "MNIST": 10000, "DTD": 1880}


def measure(arch: str, batch: int, batches: int, image_size: int, device: str, classes: int = 397) -> dict:
    import open_clip
    from PIL import Image

    from mergecal.backbones.open_clip_vit import logits, preprocess
    from mergecal.data.real_vision import clip_resize

    torch.manual_seed(0)
    model = open_clip.create_model(arch, pretrained=None).eval().to(device)
    size = model.visual.image_size[0] if isinstance(model.visual.image_size, (tuple, list)) else model.visual.image_size
    head = torch.nn.functional.normalize(torch.randn(model.text_projection.shape[1], classes), dim=0).to(device)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
              for _ in range(batch)]
    times = {"resize": 0.0, "model": 0.0}
    with torch.no_grad():
        for i in range(batches + 1):
            start = time.perf_counter()
            pixels = preprocess(np.stack([clip_resize(im, size) for im in images])).to(device)
            resized = time.perf_counter()
            logits(model, head, pixels).argmax(1).cpu()
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            done = time.perf_counter()
            if i:  # the first batch warms up
                times["resize"] += resized - start
                times["model"] += done - resized
    n = batch * batches
    per_image = {k: v / n for k, v in times.items()}
    total = sum(per_image.values())
    return {"arch": arch, "device": device, "threads": torch.get_num_threads(), "batch": batch, "images": n,
            "image_size": image_size, "ms_per_image": round(1000 * total, 3),
            "ms_per_image_resize": round(1000 * per_image["resize"], 3),
            "ms_per_image_model": round(1000 * per_image["model"], 3),
            "eight_test_sets_images": sum(TEST_IMAGES.values()),
            "eight_test_sets_hours_per_model": round(total * sum(TEST_IMAGES.values()) / 3600, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="ViT-B-32")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=256)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    row = measure(args.arch, args.batch, args.batches, args.image_size, args.device)
    print(" | ".join(f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
