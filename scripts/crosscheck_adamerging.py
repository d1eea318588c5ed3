"""Our AdaMerging (mergecal.adamerging) against FusionBench 0.2.33's, task-wise and layer-wise, on a fabricated pool.

The pool: a tiny model (``--model clip-micro``: the image tower of open_clip ``mergecal-vit-micro``, 32 tensors;
``--model mlp``: a 4-tensor MLP), K fine-tuned models theta_0 + tau_k (tau_k Gaussian, 5% of each tensor's RMS), a
fixed zero-shot-like head per task (unit rows; logits = 100 * head @ normalised embedding, CLIP's logit scale), and
5 fixed batches of 16 unlabelled inputs per task, fed in the same order to both sides (cycled). Both sides start at
0.3, clamp to [0, 1], Adam at lr 1e-3 (``--lr``: a larger one drives coefficients into the clamp).

FusionBench is not a dependency. ``--fusion-bench`` takes its wheel (``pip download --no-deps fusion-bench==0.2.33``)
or the wheel's unpacked folder. Their own files run, unchanged: models/wrappers/layer_wise_fusion.py and
task_wise_fusion.py (LayerWiseMergedModel, TaskWiseMergedModel, their init and merge), models/utils.py, utils/dict.py,
utils/type.py, compat/method/base_algorithm.py, method/adamerging/entropy_loss.py and utils.py, and the
algorithms method/adamerging/layer_wise_adamerging.py and task_wise_adamerging.py, whose
``construct_*_merged_model`` and ``test_time_adaptation`` (their loop: per task next batch, logits, entropy_loss,
backward with retain_graph; then Adam step, zero_grad, merge_weights) are called as ``run`` calls them (``run``
itself is not: it returns the merged model only, we also read ``merge_weight``). Stand-ins replace what is entangled
with lightning and hydra: the Fabric (``setup`` returns module and optimizer unchanged, ``backward(loss, **kw)`` is
``loss.backward(**kw)``: what Fabric does on one CPU at 32-bit precision, ``log_dict`` does nothing), the profiler
mixin (``profile`` a null context), ``rank_zero_only`` (the identity), a model pool (``load_model`` gives copies of
the fabricated models) and the CLIP subclasses' data and logits (``get_shuffled_test_loader_iter``: the fixed
batches as (inputs, labels) pairs; ``compute_logits``: the same function ours gets). Config as
config/method/adamerging/clip.yaml but ``clamp_weights: true`` (the paper's code) and ``max_steps`` the steps run.

Printed per granularity, after 1, 10 and N steps: the largest absolute difference of the coefficients (the clamped
ones each merge uses) and the largest relative difference of the merged weights (per tensor max|ours - theirs| /
max|theirs|, the largest over tensors), against FusionBench as published and against FusionBench with its
``entropy_loss`` (log(p + 1e-8)) swapped for ours (exact log_softmax), which isolates everything else.

Tolerance (exit 1 beyond): entropy swapped, 1e-6 on both figures: the same float32 operations in the same order, so
anything beyond round-off is a difference of method. As published, 1e-5 on both: 1e-8 inside the log moves each
class's term of the gradient by O((1e-8 / p)^2) relative, below float32 round-off unless p < 1e-6, and Adam's
per-step move is at most lr = 1e-3, so after N = 100 steps 1e-5 is 1e-4 of the largest possible move.
Without ``--fusion-bench`` our side runs alone (one line says so).

    python scripts/crosscheck_adamerging.py [--fusion-bench WHEEL_OR_DIR] [--steps N] [--model clip-micro|mlp]
                                            [--tasks K] [--threads 1] [--lr 1e-3]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import copy
import importlib.util
import io
import itertools
import shutil
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mergecal.adamerging import AdaMergingConfig, adamerging, entropy  # noqa: E402

TOL_SWAPPED, TOL_PUBLISHED = 1e-6, 1e-5
BATCHES, BATCH, LOGIT_SCALE, CLASSES = 5, 16, 100.0, 10


def make_pool(model_name: str, tasks: int):
    """The architecture (holding theta_0), K fine-tuned copies, per-task heads and fixed batches."""
    g = torch.Generator().manual_seed(0)
    if model_name == "clip-micro":
        from mergecal.backbones.open_clip_vit import create_clip

        model, shape = create_clip("mergecal-vit-micro", seed=0).visual, (BATCH, 3, 32, 32)
    else:
        torch.manual_seed(0)
        model, shape = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16)), (BATCH, 12)
    model.eval()
    emb = model(torch.zeros(shape)).shape[-1]
    finetuned = []
    for _ in range(tasks):
        ft = copy.deepcopy(model)
        with torch.no_grad():
            for p in ft.parameters():
                rms = p.detach().pow(2).mean().sqrt().clamp_min(1e-3)
                p.add_(0.05 * rms * torch.randn(p.shape, generator=g))
        finetuned.append(ft)
    heads = [nn.functional.normalize(torch.randn(CLASSES, emb, generator=g), dim=-1) for _ in range(tasks)]
    batches = [[torch.randn(shape, generator=g) + 0.3 * k for _ in range(BATCHES)] for k in range(tasks)]
    return model, finetuned, heads, batches


def make_logits(heads):
    def logits(output, task):  # FusionBench's CLIP compute_logits after the tower: normalise, cosine, scale
        emb = output / output.norm(p=2, dim=-1, keepdim=True)
        return (torch.matmul(heads[task], emb.t()) * LOGIT_SCALE).t()
    return logits


def ours(model, finetuned, heads, batches, granularity, steps, lr):
    pre = {k: v.detach() for k, v in model.state_dict().items()}
    taus = [{k: v.detach() - pre[k] for k, v in ft.state_dict().items()} for ft in finetuned]  # their subtraction
    config = AdaMergingConfig(granularity=granularity, steps=steps, init=0.3, lr=lr, clamp=True)
    result = adamerging(model, pre, taus, batches, config, logits=make_logits(heads))
    return result.coefficients, result.state, result.history[-1]["loss"]


def _fusion_bench_root(path: Path) -> Path:
    if path.is_file() and path.suffix == ".whl":
        tmp = Path(tempfile.mkdtemp(prefix="fusion-bench-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        with zipfile.ZipFile(path) as whl:
            whl.extractall(tmp, [n for n in whl.namelist() if n.startswith("fusion_bench/")])
        return tmp
    if path.is_dir() and (path / "fusion_bench").is_dir():
        return path
    raise SystemExit(f"--fusion-bench {path}: expected a fusion_bench wheel (.whl) or its unpacked folder")


class _Fabric:  # Lightning Fabric on one CPU at 32-bit precision, as far as AdaMerging's loop uses it
    def setup(self, module, optimizer):
        return module, optimizer

    def backward(self, loss, **kwargs):
        loss.backward(**kwargs)

    def log_dict(self, *args, **kwargs):
        pass


def load_fusion_bench(path: str | Path) -> dict[str, type]:
    """FusionBench's layer-wise and task-wise algorithm classes, their own files under stand-in packages."""
    src = _fusion_bench_root(Path(path)) / "fusion_bench"
    if not (src / "method" / "adamerging" / "layer_wise_adamerging.py").is_file():
        raise SystemExit(f"--fusion-bench {path}: no method/adamerging/ (expected FusionBench 0.2.33's layout)")

    def package(name, folder=None):  # a package whose __init__ (lightning, hydra, ...) is not run
        module = types.ModuleType(name)
        module.__path__ = [str(folder)] if folder else []
        return module

    def from_file(name, file):
        spec = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    class FabricMixin:
        fabric, is_debug_mode = _Fabric(), False

        def log_hyperparams(self, *args, **kwargs):
            pass

    class ProfilerMixin:
        def profile(self, name):
            return contextlib.nullcontext()

        def print_profile_summary(self, *args, **kwargs):
            pass

    stubs = {name: package(name, src / name.removeprefix("fusion_bench").strip(".").replace(".", "/"))
             for name in ["fusion_bench", "fusion_bench.utils", "fusion_bench.models", "fusion_bench.models.wrappers",
                          "fusion_bench.method", "fusion_bench.method.adamerging"]}
    stubs.update({name: package(name) for name in ["fusion_bench.compat", "fusion_bench.mixins", "lightning",
                                                   "lightning.fabric", "lightning.fabric.utilities"]})
    stubs["fusion_bench.compat.method"] = types.ModuleType("fusion_bench.compat.method")
    stubs["fusion_bench.compat.modelpool"] = types.ModuleType("fusion_bench.compat.modelpool")
    stubs["fusion_bench.compat.modelpool"].ModelPool = object
    stubs["fusion_bench.mixins.lightning_fabric"] = types.ModuleType("fusion_bench.mixins.lightning_fabric")
    stubs["fusion_bench.mixins.lightning_fabric"].LightningFabricMixin = FabricMixin
    stubs["fusion_bench.mixins.simple_profiler"] = types.ModuleType("fusion_bench.mixins.simple_profiler")
    stubs["fusion_bench.mixins.simple_profiler"].SimpleProfilerMixin = ProfilerMixin
    stubs["fusion_bench.utils.data"] = types.ModuleType("fusion_bench.utils.data")
    stubs["fusion_bench.utils.data"].load_tensor_from_file = None  # only for given weights: not used
    stubs["lightning.fabric.utilities.rank_zero"] = types.ModuleType("lightning.fabric.utilities.rank_zero")
    stubs["lightning.fabric.utilities.rank_zero"].rank_zero_only = lambda fn: fn
    stubs["lightning"].Fabric = None  # task_wise_adamerging builds one only when CUDA is present: not here
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    loaded = []
    try:
        base = from_file("fusion_bench.compat.method.base_algorithm", src / "compat/method/base_algorithm.py")
        stubs["fusion_bench.compat.method"].ModelFusionAlgorithm = base.ModelFusionAlgorithm
        layer = importlib.import_module("fusion_bench.method.adamerging.layer_wise_adamerging")
        task = importlib.import_module("fusion_bench.method.adamerging.task_wise_adamerging")
        loaded = [n for n in sys.modules if n.startswith("fusion_bench.")]
    finally:
        for name in {*loaded, *saved}:  # their modules stay referenced by the classes, not by sys.modules
            if saved.get(name) is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved[name]
    task.TaskWiseAdaMergingAlgorithm._fabric = _Fabric()  # FusionBench leaves None on a CPU, then calls backward
    return {"layer": layer.LayerWiseAdaMergingAlgorithm, "task": task.TaskWiseAdaMergingAlgorithm,
            "modules": {"layer": layer, "task": task}}


def theirs(fb, model, finetuned, heads, batches, granularity, steps, lr, swap_entropy):
    """FusionBench's construct + test_time_adaptation + merge_and_unload; (clamped coefficients, merged state)."""
    from omegaconf import DictConfig

    names = [f"task{k}" for k in range(len(finetuned))]
    streams = {n: itertools.cycle([(b, torch.zeros(len(b), dtype=torch.long)) for b in batches[k]])
               for k, n in enumerate(names)}
    logits = make_logits(heads)
    module_ns = fb["modules"][granularity]
    original = module_ns.entropy_loss
    module_ns.entropy_loss = (lambda z: entropy(z)) if swap_entropy else original

    class Pool:
        model_names = names

        def load_model(self, name):
            return copy.deepcopy(model if name == "_pretrained_" else finetuned[names.index(name)])

    class Algorithm(fb[granularity]):
        def get_shuffled_test_loader_iter(self, task):
            return streams[task]

        def compute_logits(self, module, batch, task):  # layer-wise passes images, task-wise (images, labels)
            images = batch[0] if isinstance(batch, (tuple, list)) else batch
            return logits(module(images), names.index(task))

    config = DictConfig({"name": f"clip_{granularity}_wise_adamerging", "weights": None, "optimizer": "adam",
                         "lr": lr, "init_values": 0.3, "clamp_weights": True, "tie_weights": True,
                         "strict": False, "devices": 1, "batch_size": BATCH, "num_workers": 0, "max_steps": steps,
                         "fast_dev_run": False, "save_merging_weights": False})
    algorithm = Algorithm(config)
    algorithm.modelpool = pool = Pool()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if granularity == "layer":
                module = algorithm.construct_layer_wise_merged_model(pool)
            else:
                module = algorithm.construct_task_wise_merged_model(pool)
            module = algorithm.test_time_adaptation(module)
            coefficients = module.merge_weight.detach().clamp(0, 1).clone()
            merged = module.merge_and_unload()
    finally:
        module_ns.entropy_loss = original
    return coefficients, {k: v.detach() for k, v in merged.state_dict().items()}


def differences(a, b) -> tuple[float, float]:
    (ca, sa), (cb, sb) = a, b
    coef = float((ca - cb).abs().max())
    rel = max(float((sa[k] - sb[k]).abs().max() / sb[k].abs().max().clamp_min(1e-30)) for k in sb)
    return coef, rel


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/crosscheck_adamerging.py",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--fusion-bench", type=Path, help="fusion_bench-0.2.33 wheel or its unpacked folder")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--model", choices=["clip-micro", "mlp"], default="clip-micro")
    parser.add_argument("--tasks", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's (a larger one drives the clamp)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    fb = load_fusion_bench(args.fusion_bench) if args.fusion_bench else None
    pool = make_pool(args.model, args.tasks)
    checkpoints = sorted({1, min(10, args.steps), args.steps})
    print(f"AdaMerging, ours vs FusionBench 0.2.33: {args.model}, K = {args.tasks}, {BATCHES} batches of {BATCH} per "
          f"task, init 0.3, clamp [0, 1], Adam lr {args.lr:g}")
    if fb is None:
        print("FusionBench side skipped (no --fusion-bench): our side only")
    failed = False
    for granularity in ["task", "layer"]:
        for steps in checkpoints:
            coef, state, loss = ours(*pool, granularity, steps, args.lr)
            line = f"{granularity}-wise, {steps:4d} step(s): our loss {loss:.6f}, coefficients in " \
                   f"[{float(coef.min()):.6f}, {float(coef.max()):.6f}]"
            if fb is not None:
                for swap, tol, label in [(False, TOL_PUBLISHED, "as published"), (True, TOL_SWAPPED, "entropy ours")]:
                    c, r = differences((coef, state), theirs(fb, *pool, granularity, steps, args.lr, swap))
                    bad = c > tol or r > tol
                    failed |= bad
                    line += f"; {label}: coef {c:.2e}, weights {r:.2e}" + (f" > {tol:g} FAIL" if bad else "")
            print(line)
    if fb is not None:
        print(f"tolerance: {TOL_PUBLISHED:g} as published, {TOL_SWAPPED:g} with our entropy: "
              + ("EXCEEDED" if failed else "all within"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
