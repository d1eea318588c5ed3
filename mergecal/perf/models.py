"""Model-level calibration costs on an open_clip ViT (random init: the architecture, no weights).

* FSC: seconds to measure the ratios (n samples per task, K fine-tuned models), and the forward latency of
  the calibrated model against the merged model (same process, same input; reported as a ratio);
* DisTaC: optimisation steps per second at a given batch size (teacher forward + student forward/backward).
Costs do not depend on the weights' values, so a random initialisation measures them faithfully.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import tempfile
import time

import torch
from torch import nn

TINY_NAME = "mergecal-bench-tiny-vit"
TINY_CONFIG = {"embed_dim": 32,
               "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 32, "patch_size": 8},
               "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1}}


def build_clip(name: str, seed: int = 0) -> nn.Module:
    import open_clip

    if name == TINY_NAME and TINY_NAME not in open_clip.list_models():
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{TINY_NAME}.json")
            with open(path, "w") as fh:
                json.dump(TINY_CONFIG, fh)
            open_clip.add_model_config(path)
    torch.manual_seed(seed)
    level = logging.getLogger().level
    logging.getLogger().setLevel(logging.ERROR)  # "No pretrained weights loaded": intended
    try:
        model = open_clip.create_model(name, pretrained=None)
    finally:
        logging.getLogger().setLevel(level)
    model.transformer = None  # the text tower is not used here; free its memory
    return model.eval()


@torch.no_grad()
def _perturbed(model: nn.Module, seed: int, scale: float = 1e-3) -> nn.Module:
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for name, p in out.named_parameters():
        if name.startswith("visual."):
            p.add_(scale * torch.randn(p.shape, generator=g))
    return out


def _timed(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_fsc(name: str, K: int, n_samples: int = 1) -> list[dict]:
    from ..calibrations.fsc import calibrate_fsc, measure_fsc

    pre = build_clip(name)
    fts = [_perturbed(pre, 10 + t) for t in range(K)]
    merged = _perturbed(pre, 99)
    size = pre.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    g = torch.Generator().manual_seed(0)
    data = [torch.randn(n_samples, 3, size, size, generator=g) for _ in range(K)]
    start = time.perf_counter()
    measurement = measure_fsc(merged, pre, fts, data, progress=False, n_samples_per_task=n_samples)
    measure_s = time.perf_counter() - start
    calibrated = measurement.apply(merged, pre)
    x = torch.randn(8, 3, size, size, generator=g)
    with torch.no_grad():
        plain_s = _timed(lambda: merged.encode_image(x))
        calibrated_s = _timed(lambda: calibrated.encode_image(x))
    del calibrate_fsc
    return [{"label": f"fsc: measure ratios ({name}, K={K}, n={n_samples}/task)", "seconds": measure_s},
            {"label": f"fsc: merged forward, batch 8 ({name})", "seconds": plain_s},
            {"label": f"fsc: calibrated forward, batch 8 ({len(calibrated.hooked)} hooked, "
                      f"{len(calibrated.folded)} folded)", "seconds": calibrated_s,
             "ratio_to_merged": calibrated_s / plain_s}]


def bench_distac(name: str, batch_size: int, steps: int = 3) -> list[dict]:
    from ..calibrations.distac import DistacParams, distill_task_vector

    pre = build_clip(name)
    ft = _perturbed(pre, 1)
    head = nn.Linear(pre.visual.output_dim, 10)
    head.requires_grad_(False)

    def build(sd):
        model = build_clip(name)
        model.load_state_dict(sd, strict=False)
        model.task_head = head
        model.forward = lambda images: model.task_head(model.encode_image(images))
        return model

    size = pre.visual.image_size
    size = size[0] if isinstance(size, (tuple, list)) else size
    images = torch.randn(batch_size * (steps + 1), 3, size, size, generator=torch.Generator().manual_seed(0))
    params = DistacParams.preset("norm_mismatch", kappa=0.5, steps=1, batch_size=batch_size)
    pre_sd, ft_sd = pre.state_dict(), ft.state_dict()
    distill_task_vector(build, pre_sd, ft_sd, images, params, progress=False,
                        trainable=lambda n: n.startswith("visual."))  # warm-up (and model building)
    params = params.model_copy(update={"steps": steps + 1})
    start = time.perf_counter()
    distill_task_vector(build, pre_sd, ft_sd, images, params, progress=False,
                        trainable=lambda n: n.startswith("visual."))
    total = time.perf_counter() - start
    one = _timed(lambda: distill_task_vector(build, pre_sd, ft_sd, images, params.model_copy(update={"steps": 1}),
                                             progress=False, trainable=lambda n: n.startswith("visual.")), repeat=1)
    per_step = (total - one) / steps  # subtract the fixed cost (model building) measured with one step
    return [{"label": f"distac: seconds per step, batch {batch_size} ({name})", "seconds": per_step,
             "steps_per_second": 1.0 / per_step if per_step > 0 else float("nan")}]


def main(name: str, K: int, distac_batch: int) -> tuple[list[dict], str]:
    rows = bench_fsc(name, K) + bench_distac(name, distac_batch)
    lines = [f"Model-level calibration costs: open_clip {name} (random init), {torch.get_num_threads()} torch threads, "
             f"torch {torch.__version__}", "", "| measurement | seconds | note |", "|---|---:|---|"]
    for r in rows:
        note = ""
        if "ratio_to_merged" in r:
            note = f"{r['ratio_to_merged']:.2f} x the merged model"
        if "steps_per_second" in r:
            note = f"{r['steps_per_second']:.2f} steps/s"
        lines.append(f"| {r['label']} | {r['seconds']:.3f} | {note} |")
        print(f"  {r['label']:60s} {r['seconds']:8.3f} s  {note}", flush=True)
    return rows, "\n".join(lines)
