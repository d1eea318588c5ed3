"""Merging PEFT LoRA adapters: `mergecal merge` against peft's add_weighted_adapter + merge_and_unload, at Llama-2-7B's
key shapes, time and peak memory side by side, outputs compared key by key.

    python scripts/perf_adapters.py [--layers 2] [--experts 3] [--rank 16] [--repeats 1] [--workdir DIR]
        [--output FILE.md] [--mergekit [MERGEKIT_YAML]] [--threads N]

The claim measured (mergecal.adapters): a LoRA expert's delta is materialised one target key at a time, so a merge
of K adapters holds one key's delta, not the model's; peft's route (the base loaded whole, the K adapters attached,
``add_weighted_adapter(combination_type="cat", weights 1.0)``, ``merge_and_unload``, ``save_pretrained``) holds the
whole model.

What is written (in a temporary directory, or ``--workdir``, where inputs of the same arguments are reused): a Hugging
Face ``LlamaForCausalLM`` base of Llama-2-7B's shapes (hidden 4096, MLP 11008, 32 heads, vocabulary 32000) with
``--layers`` decoder layers instead of 32, random bfloat16 weights written key by key as safetensors shards (the
writer holds one tensor); and K rank-``--rank`` LoRA adapters on q, k, v, o, gate, up and down_proj, written directly
in peft 0.21.2's saved format (``adapter_config.json`` + ``adapter_model.safetensors``, float32 weights as peft holds
them on a bfloat16 base; tests/test_perf_adapters.py checks the format against peft's ``save_pretrained``).

Each merge runs in a fresh process, the routes alternated over ``--repeats``; a process's peak resident memory is
its own ``ru_maxrss`` (``os.wait4``: anonymous and file-backed pages, including the interpreter and its imports,
whose size alone is printed for scale), and its peak anonymous memory (``RssAnon`` of the process tree polled every
0.1 s: what the run allocated, without torch's shared libraries, which dominate the RSS of a small run).

Each output is compared key by key (in row blocks) with the exact merge, base + sum_i scaling_i B_i A_i in float64,
and each route's largest max |out - exact| / max |exact| over keys held to its bound (``TOLERANCES``): mergecal
reads each LoRA expert as peft's ``merge_and_unload`` of that adapter alone leaves it, rounded to the base's
bfloat16, so K roundings plus the output's: (K + 1) half ulps (2^-8 each); peft holds the "cat" adapter that
``add_weighted_adapter`` creates in the base's dtype, so its factors are rounded before the merge: one ulp (2^-7).
The two outputs' largest difference and the share of elements that differ are printed too.

MergeKit (``--mergekit``) is a benchmark dependency, never a runtime one: install it in a venv of its own and pass
its ``mergekit-yaml``; without it the route is skipped in one line. It merges ``BASE+ADAPTER`` models (each adapter
merged into a full copy of the base in its LoRA cache first) by task arithmetic, ``lambda`` 1.

The smaller ``--hidden``, ``--intermediate``, ``--heads`` and ``--vocab`` are for tests (tiny shapes); a figure is read
at Llama-2-7B's. Time and disk grow linearly with ``--layers``; peft's anonymous memory grows with the model it holds,
mergecal's should not (run two ``--layers`` values to see it); the peak RSS of both also counts file-backed pages
of the mapped safetensors, which grow with the model but are reclaimed under memory pressure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the project's package from this checkout
    sys.path.insert(0, str(ROOT))

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LLAMA_2_7B = {"hidden": 4096, "intermediate": 11008, "heads": 32, "vocab": 32000, "layers": 32}
PEFT_PREFIX = "base_model.model."
#: the peft release whose saved format the adapters are written in (its ``adapter_config.json`` fields)
PEFT_FORMAT_VERSION = "0.21.2"
#: bfloat16 keeps 8 significant bits: a rounded value is within 2^-8 of its magnitude (half an ulp). Bounds against
#: the exact merge, relative to a key's largest magnitude, as functions of K, and why
HALF_ULP = 2.0**-8
TOLERANCES = {
    "mergecal": (lambda K: (K + 1) * HALF_ULP + 2.0**-20,
                 "each LoRA expert is the base + its delta rounded to bfloat16, as peft's merge_and_unload of that "
                 "adapter alone leaves it (LoraExpert), then the K task vectors are summed in float32 and rounded "
                 "once more: (K + 1) half ulps"),
    "peft": (lambda K: 2 * HALF_ULP,
             "add_weighted_adapter holds the cat adapter in the base's dtype, bfloat16, so its factors are rounded "
             "before the merge; with deltas a tenth of the base's size that stays under one more half ulp: one ulp"),
    "mergekit": (lambda K: (K + 1) * HALF_ULP + 2.0**-20,
                 "each adapter merged into a bfloat16 copy of the base first, then summed: (K + 1) half ulps"),
}
GIB = 1024**3


# ------------------------------------------------------------------------------------------------------ the inputs

def llama_config(*, hidden: int, intermediate: int, heads: int, vocab: int, layers: int) -> dict:
    if hidden % heads:
        raise SystemExit(f"--hidden {hidden} is not a multiple of --heads {heads}")
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "vocab_size": vocab, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "dtype": "bfloat16",
            "bos_token_id": 1, "eos_token_id": 2}


def base_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape in the Hugging Face Llama layout, in the order written."""
    from mergecal.perf.llm_checkpoints import config_shapes

    return config_shapes(config)


def lora_targets(config: dict) -> dict[str, tuple[int, int]]:
    """``{module name: (out, in)}`` of every targeted linear layer."""
    shapes = base_shapes(config)
    return {key.removesuffix(".weight"): shapes[key] for key in shapes
            if key.removesuffix(".weight").rpartition(".")[2] in TARGETS}


def _randn(shape, seed: int, scale: float):
    import torch

    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def write_base(path: Path, config: dict, seed: int = 0) -> Path:
    """The base model directory: random bfloat16 weights (norms ones) written key by key, a config.json."""
    import torch

    from mergecal.backbones.hf_directory import SAFETENSORS_METADATA
    from mergecal.checkpoint import ShardedCheckpointWriter

    writer = ShardedCheckpointWriter(path, metadata=SAFETENSORS_METADATA, overwrite=True)
    for j, (key, shape) in enumerate(base_shapes(config).items()):
        tensor = torch.ones(shape) if len(shape) == 1 else _randn(shape, seed * 100_003 + j, 0.02)
        writer.add(key, tensor.to(torch.bfloat16))
        del tensor
    writer.finish()
    (writer.staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return writer.close()


def adapter_config(base: str, rank: int, alpha: int) -> dict:
    """``adapter_config.json`` as peft 0.21.2's ``save_pretrained`` writes a plain LoRA config for a causal LM
    (every field it writes; ``target_modules`` is a set there, written in its iteration order: here sorted)."""
    return {
        "alora_invocation_tokens": None, "alpha_pattern": {}, "arrow_config": None, "auto_mapping": None,
        "base_model_name_or_path": base, "bias": "none", "corda_config": None, "ensure_weight_tying": False,
        "eva_config": None, "exclude_modules": None, "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "kasa_config": None, "layer_replication": None, "layers_pattern": None,
        "layers_to_transform": None, "loftq_config": {}, "lora_alpha": alpha, "lora_bias": False,
        "lora_dropout": 0.0, "lora_ga_config": None, "megatron_config": None, "megatron_core": "megatron.core",
        "modules_to_save": None, "monteclora_config": None, "peft_type": "LORA",
        "peft_version": PEFT_FORMAT_VERSION, "qalora_group_size": 16, "r": rank, "rank_pattern": {},
        "revision": None, "target_modules": sorted(TARGETS), "target_parameters": None, "task_type": "CAUSAL_LM",
        "trainable_token_indices": None, "use_bdlora": None, "use_dora": False, "use_qalora": False,
        "use_rslora": False, "velora_config": None,
    }


def write_adapter(path: Path, base: Path, config: dict, rank: int, seed: int) -> Path:
    """A LoRA adapter directory of ``base`` in peft's saved format: float32 ``lora_A`` (r x in) and ``lora_B``
    (out x r) of every target, lora_alpha = 2r (peft's scaling 2); the delta's entries are about a tenth of the
    base's."""
    from safetensors.torch import save_file

    tensors = {}
    for j, (module, (n_out, n_in)) in enumerate(lora_targets(config).items()):
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = _randn((rank, n_in), seed * 1_000_003 + 2 * j, 0.02)
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = _randn((n_out, rank), seed * 1_000_003 + 2 * j + 1, 0.01)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    (staging / "adapter_config.json").write_text(json.dumps(adapter_config(str(base), rank, 2 * rank), indent=2,
                                                            sort_keys=True))
    if path.exists():
        shutil.rmtree(path)
    os.replace(staging, path)
    return path


def write_inputs(work: Path, config: dict, experts: int, rank: int) -> tuple[Path, list[Path], float | None]:
    """The base and K adapters under ``work`` (reused when ``work/inputs.json`` stamps the same arguments);
    returns (base, adapters, seconds spent writing them, None when reused)."""
    import torch

    stamp = json.dumps({"config": config, "experts": experts, "rank": rank, "peft_format": PEFT_FORMAT_VERSION,
                        "torch": torch.__version__}, sort_keys=True)
    stamp_path, base = work / "inputs.json", work / "base"
    adapters = [work / f"adapter{i}" for i in range(experts)]
    if stamp_path.is_file() and stamp_path.read_text() == stamp and all(p.is_dir() for p in [base, *adapters]):
        progress(f"inputs: reusing {work} (same arguments)")
        return base, adapters, None
    stamp_path.unlink(missing_ok=True)
    start = time.perf_counter()
    progress(f"inputs: writing the base ({parameter_count(config) / 1e9:.2f} B parameters, bfloat16) to {base}")
    write_base(base, config)
    for i, path in enumerate(adapters):
        progress(f"inputs: writing LoRA adapter {i + 1}/{experts} (rank {rank})")
        write_adapter(path, base, config, rank, seed=i + 1)
    stamp_path.write_text(stamp)
    return base, adapters, time.perf_counter() - start


def parameter_count(config: dict) -> int:
    import math

    return sum(math.prod(shape) for shape in base_shapes(config).values())


# ------------------------------------------------------------------------------------------------------ the routes

def mergecal_command(base: Path, adapters: list[Path], out: Path, work: Path) -> list[str]:
    return [sys.executable, "-m", "mergecal.cli", "merge", "--pretrained", str(base), "--finetuned",
            *map(str, adapters), "--method", "task_arithmetic", "--set", "scaling=1.0", "--out", str(out)]


def peft_command(base: Path, adapters: list[Path], out: Path, work: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--peft-child", str(base), str(out), *map(str, adapters)]


def mergekit_command(exe: list[str]):
    def command(base: Path, adapters: list[Path], out: Path, work: Path) -> list[str]:
        import yaml

        cache = work / "mergekit-lora-cache"  # each run starts cold: the adapters are merged into copies anew
        shutil.rmtree(cache, ignore_errors=True)
        config = {"merge_method": "task_arithmetic", "base_model": str(base), "dtype": "float32",
                  "out_dtype": "bfloat16", "parameters": {"lambda": 1.0},
                  "models": [{"model": f"{base}+{a}", "parameters": {"weight": 1.0}} for a in adapters]}
        path = work / "mergekit.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return [*exe, str(path), str(out), "--lora-merge-cache", str(cache)]
    return command


def find_mergekit(given: str | None) -> list[str] | None:
    """The command that runs ``mergekit-yaml``: the one given, one on PATH, or this interpreter's module."""
    import importlib.util

    if given:
        return [given] if Path(given).is_file() or shutil.which(given) else None
    if shutil.which("mergekit-yaml"):
        return [shutil.which("mergekit-yaml")]
    if importlib.util.find_spec("mergekit") is not None:
        return [sys.executable, "-m", "mergekit.scripts.run_yaml"]
    return None


def peft_child(base: str, out: str, adapters: list[str]) -> int:
    """peft's route, run in a fresh process: the base in bfloat16, the K adapters, their "cat" combination with
    weights 1.0 (the sum of the K deltas), merged into the base and saved (safetensors)."""
    import warnings

    import torch
    import transformers
    from peft import PeftModel

    warnings.simplefilter("ignore")
    transformers.logging.set_verbosity_error()
    start = time.perf_counter()

    def step(what: str) -> None:
        print(f"{time.perf_counter() - start:7.1f} s  {what}", flush=True)

    # low_cpu_mem_usage: transformers 5 always builds on the meta device and ignores it; given for older ones
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16, low_cpu_mem_usage=True,
                                                              local_files_only=True)
    step("base loaded")
    names = [f"expert{i}" for i in range(len(adapters))]
    model = PeftModel.from_pretrained(model, adapters[0], adapter_name=names[0])
    for name, path in zip(names[1:], adapters[1:]):
        model.load_adapter(path, adapter_name=name)
    step(f"{len(adapters)} adapters loaded")
    model.add_weighted_adapter(names, [1.0] * len(names), "merged", combination_type="cat")
    model.set_adapter("merged")
    for name in names:
        model.delete_adapter(name)
    step("add_weighted_adapter (cat)")
    merged = model.merge_and_unload()
    step("merge_and_unload")
    merged.save_pretrained(out)
    step("saved")
    return 0


def _forward(stream, label: str) -> None:
    """A child's output, prefixed; a progress bar's redrawn lines (``%|``) at most one per 5 s, and its last."""
    last, pending = 0.0, None
    for line in stream:
        line = line.rstrip()
        if not line:
            continue
        if "%|" in line and "100%|" not in line:
            pending = line
            if time.monotonic() - last < 5.0:
                continue
            last, pending = time.monotonic(), None
        print(f"    [{label}] {line}", flush=True)
    if pending:
        print(f"    [{label}] {pending}", flush=True)


def _anonymous_bytes(pid: int) -> int:
    """Anonymous resident memory of ``pid`` and its descendants (``RssAnon``; 0 once it is gone)."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("RssAnon:"):
                    total += int(line.split()[1]) * 1024
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return total


def run_child(command: list[str], label: str, env: dict, poll_seconds: float = 0.1) -> dict:
    """Run ``command`` in a fresh process: wall seconds, CPU seconds and peak RSS of that process (``os.wait4``:
    its own ``ru_maxrss``), and its peak anonymous memory (``RssAnon`` polled every ``poll_seconds``: the pages the
    run allocated, without the shared libraries' file-backed ones); its output forwarded with a prefix."""
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, bufsize=1)
    reader = threading.Thread(target=_forward, args=(child.stdout, label), daemon=True)
    reader.start()
    peak_anon, running = [0], threading.Event()
    running.set()

    def poll() -> None:
        while running.is_set():
            peak_anon[0] = max(peak_anon[0], _anonymous_bytes(child.pid))
            time.sleep(poll_seconds)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    running.clear()
    child.returncode = os.waitstatus_to_exitcode(status)
    poller.join()
    reader.join()
    child.stdout.close()
    return {"rc": child.returncode, "seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime,
            "peak_rss": usage.ru_maxrss * 1024, "peak_anon": peak_anon[0]}  # ru_maxrss: KiB on Linux


def child_env(threads: int | None) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    if threads:
        env |= {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "OPENBLAS_NUM_THREADS": str(threads)}
    return env


# ------------------------------------------------------------------------------------------------ the comparison

def _key_files(directory: Path) -> dict[str, Path]:
    """``{key: safetensors file}`` of a model directory (one file or a sharded index)."""
    from safetensors import safe_open

    index = sorted(directory.glob("*.safetensors.index.json"))
    if index:
        return {k: directory / f for k, f in json.loads(index[0].read_text())["weight_map"].items()}
    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            files |= {k: path for k in f.keys()}
    return files


class ExactMerge:
    """The exact merge, base + sum_i scaling_i B_i A_i in float64, read in row blocks (a target's B rows times A)."""

    def __init__(self, base: Path, adapters: list[Path]):
        self.base = _key_files(base)
        self.adapters = []
        for path in adapters:
            config = json.loads((path / "adapter_config.json").read_text())
            self.adapters.append((path / "adapter_model.safetensors", config["lora_alpha"] / config["r"]))

    def rows(self, key: str, start: int, stop: int):
        from safetensors import safe_open

        with safe_open(str(self.base[key]), "pt") as f:
            out = f.get_slice(key)[start:stop].double()
        module = key.removesuffix(".weight")
        if module.rpartition(".")[2] in TARGETS:
            for weights, scaling in self.adapters:
                with safe_open(str(weights), "pt") as f:
                    B = f.get_slice(f"{PEFT_PREFIX}{module}.lora_B.weight")[start:stop].double()
                    A = f.get_tensor(f"{PEFT_PREFIX}{module}.lora_A.weight").double()
                out += scaling * (B @ A)
        return out


def compare_outputs(outputs: dict[str, Path], base: Path, adapters: list[Path],
                    block_elements: int = 1 << 22) -> dict:
    """Each output key by key against the exact merge (float64, ``ExactMerge``) and against the first output, in
    row blocks (memory holds a block): per output the largest max |out - exact| / max |exact| over keys and its key;
    per later output against the first, the largest max |a - b| / max |b| and the share of elements that differ;
    and the keys missing from an output."""
    from safetensors import safe_open

    exact = ExactMerge(base, adapters)
    files = {name: _key_files(path) for name, path in outputs.items()}
    names, keys = list(outputs), sorted(exact.base)
    first = names[0]
    result = {name: {"exact": 0.0, "exact_key": None, "pair": 0.0, "pair_key": None, "differing": 0, "elements": 0,
                     "missing": sorted(set(exact.base) - set(files[name])),
                     "extra": sorted(set(files[name]) - set(exact.base))} for name in names}
    for key in keys:
        present = [n for n in names if key in files[n]]
        shape = safe_open(str(exact.base[key]), "pt").get_slice(key).get_shape()
        rows, step = shape[0], max(1, block_elements // max(1, _numel(shape[1:])))
        worst = {n: [0.0, 0.0] for n in present}  # max |out - exact|, max |out - first's|
        scale, first_scale = 0.0, 0.0
        for start in range(0, rows, step):
            ref = exact.rows(key, start, start + step)
            scale = max(scale, float(ref.abs().max()))
            block = {}
            for n in present:
                with safe_open(str(files[n][key]), "pt") as f:
                    block[n] = f.get_slice(key)[start:start + step].double()
                if tuple(block[n].shape) != tuple(ref.shape):
                    return {"error": f"{n}: key {key!r} has shape {tuple(block[n].shape)}, expected {shape}"}
                worst[n][0] = max(worst[n][0], float((block[n] - ref).abs().max()))
            if first in block:
                first_scale = max(first_scale, float(block[first].abs().max()))
                for n in present[1:]:
                    diff = (block[n] - block[first]).abs()
                    worst[n][1] = max(worst[n][1], float(diff.max()))
                    result[n]["differing"] += int((diff > 0).sum())
                    result[n]["elements"] += diff.numel()
        for n in present:
            rel = worst[n][0] / scale if scale > 0 else worst[n][0]
            if result[n]["exact_key"] is None or rel > result[n]["exact"]:
                result[n]["exact"], result[n]["exact_key"] = rel, key
            if n != first and first in present:
                rel = worst[n][1] / first_scale if first_scale > 0 else worst[n][1]
                if result[n]["pair_key"] is None or rel > result[n]["pair"]:
                    result[n]["pair"], result[n]["pair_key"] = rel, key
    return result


def _numel(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -------------------------------------------------------------------------------------------------------- the run

def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


def import_floor(env: dict) -> dict:
    """A fresh process that imports torch, transformers and peft and does nothing else: the floor under both
    routes' peak RSS."""
    return run_child([sys.executable, "-c", "import torch, transformers, peft"], "imports", env)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}×" if b > 0 else "—"


def table(rows: dict[str, dict], base_bytes: int) -> str:
    lines = ["| route | seconds (wall) | CPU seconds | peak RSS (GiB) | peak anonymous (GiB) | output (GiB) |",
             "|---|---|---|---|---|---|"]
    columns = ("seconds", "cpu_seconds", "peak_rss", "peak_anon", "output_bytes")
    for name, r in rows.items():
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['peak_rss'] / GIB:.2f} | "
                     f"{r['peak_anon'] / GIB:.2f} | {r['output_bytes'] / GIB:.2f} |")
    ref = rows.get("mergecal")
    for name, r in rows.items():
        if name != "mergecal" and ref:
            lines.append(f"| {name} / mergecal | " + " | ".join(ratio(r[c], ref[c]) for c in columns) + " |")
    lines.append(f"| the base model, for scale | | | | | {base_bytes / GIB:.2f} |")
    return "\n".join(lines)


def summarise(runs: list[dict]) -> dict:
    """Repeats of one route: the median seconds, the largest peak RSS."""
    return {"seconds": statistics.median(r["seconds"] for r in runs),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in runs),
            "peak_rss": max(r["peak_rss"] for r in runs), "peak_anon": max(r["peak_anon"] for r in runs),
            "output_bytes": runs[-1]["output_bytes"],
            "repeats": len(runs)}


def measure(args, work: Path) -> tuple[str, bool]:
    """Write the inputs, run the routes, compare the outputs: (the report in Markdown, whether it passed)."""
    config = llama_config(hidden=args.hidden, intermediate=args.intermediate, heads=args.heads, vocab=args.vocab,
                          layers=args.layers)
    base, adapters, write_seconds = write_inputs(work, config, args.experts, args.rank)
    base_bytes = dir_bytes(base)
    env = child_env(args.threads)
    routes = {"mergecal": mergecal_command, "peft": peft_command}
    notes = []
    if args.mergekit is not None:
        exe = find_mergekit(args.mergekit or None)
        if exe is None:
            notes.append("mergekit: not installed (install it in a venv of its own and pass --mergekit "
                         "PATH/mergekit-yaml); skipped")
            progress(notes[-1])
        else:
            routes["mergekit"] = mergekit_command(exe)
    load_before = os.getloadavg()
    progress(f"load average before: {load_before[0]:.2f} (1 min), {load_before[1]:.2f} (5 min), {os.cpu_count()} CPUs")
    floor = None
    if not args.no_floor:
        floor = import_floor(env)
        progress(f"imports alone (torch, transformers, peft): peak RSS {floor['peak_rss'] / GIB:.2f} GiB, "
                 f"anonymous {floor['peak_anon'] / GIB:.2f} GiB, {floor['seconds']:.1f} s")
    runs: dict[str, list[dict]] = {name: [] for name in routes}
    outputs = {name: work / f"out-{name}" for name in routes}
    order = list(routes)
    ok = True
    for repeat in range(args.repeats):
        for name in order if repeat % 2 == 0 else order[::-1]:  # alternated: each route sees the same load
            shutil.rmtree(outputs[name], ignore_errors=True)
            progress(f"{name}: merging {args.experts} adapters (run {repeat + 1}/{args.repeats})")
            result = run_child(routes[name](base, adapters, outputs[name], work), name, env)
            if result["rc"] != 0:
                progress(f"{name}: FAILED (exit status {result['rc']})")
                ok = False
                continue
            result["output_bytes"] = dir_bytes(outputs[name])
            progress(f"{name}: {result['seconds']:.1f} s, peak RSS {result['peak_rss'] / GIB:.2f} GiB, "
                     f"anonymous {result['peak_anon'] / GIB:.2f} GiB")
            runs[name].append(result)
    load_after = os.getloadavg()
    progress(f"load average after: {load_after[0]:.2f} (1 min), {load_after[1]:.2f} (5 min)")
    rows = {name: summarise(r) for name, r in runs.items() if r}
    checks = []
    done = {name: outputs[name] for name in rows if outputs[name].is_dir()}
    if done:
        progress(f"comparing the outputs with the exact merge (float64), key by key: {', '.join(done)}")
        found = compare_outputs(done, base, adapters)
        if "error" in found:
            checks.append(f"- outputs: {found['error']}")
            ok = False
        for name, c in ({} if "error" in found else found).items():
            tolerance, why = TOLERANCES[name]
            tolerance = tolerance(args.experts)
            passed = c["exact"] <= tolerance and not c["missing"]
            line = (f"- {name} against the exact merge: largest max|out-exact|/max|exact| {c['exact']:.2e} "
                    f"({c['exact_key']}); tolerance {tolerance:.2e} ({why}): {'within' if passed else 'OUTSIDE'}")
            if c["missing"] or c["extra"]:
                line += (f"; {len(c['missing'])} keys missing, {len(c['extra'])} extra "
                         f"({', '.join((c['missing'] + c['extra'])[:3])})")
            checks.append(line)
            if c["pair_key"] is not None:
                checks.append(f"- {name} against {next(iter(done))}: largest max|a-b|/max|b| {c['pair']:.2e} "
                              f"({c['pair_key']}), {c['differing']:,} of {c['elements']:,} elements differ")
            ok &= passed
    if not args.keep:
        for path in outputs.values():
            shutil.rmtree(path, ignore_errors=True)
    params = parameter_count(config)
    full = args.layers == LLAMA_2_7B["layers"] and all(getattr(args, k) == v for k, v in LLAMA_2_7B.items()
                                                       if k != "layers")
    shape_line = (f"hidden {args.hidden}, MLP {args.intermediate}, {args.heads} heads, vocabulary {args.vocab}, "
                  f"{args.layers} decoder layer{'s' * (args.layers != 1)}")
    lines = [
        f"# LoRA adapter merges: mergecal against peft ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"Base: LlamaForCausalLM, {shape_line} ({params / 1e9:.2f} B parameters, {base_bytes / GIB:.2f} GiB in "
        f"bfloat16){'' if full else '; Llama-2-7B has 32 layers'}. K = {args.experts} LoRA adapters of rank "
        f"{args.rank} on {', '.join(TARGETS)}; task arithmetic, scaling 1.0 (peft: add_weighted_adapter "
        f"combination_type=\"cat\", weights 1.0, then merge_and_unload and save_pretrained). Each run a fresh "
        f"process; {args.repeats} run{'s' * (args.repeats != 1)} per route, median seconds, largest peaks "
        f"(peak RSS: the process's ru_maxrss, anonymous and file-backed pages, the shared libraries' included; "
        f"peak anonymous: RssAnon polled every 0.1 s, what the run allocated).",
        "",
        table(rows, base_bytes),
        "",
        *([] if floor is None else [
            f"- imports alone (torch, transformers, peft), a fresh process: peak RSS {floor['peak_rss'] / GIB:.2f} "
            f"GiB, anonymous {floor['peak_anon'] / GIB:.2f} GiB, {floor['seconds']:.1f} s: under both routes' "
            "figures"]),
        f"- load average before {load_before[0]:.2f} / {load_before[1]:.2f}, after {load_after[0]:.2f} / "
        f"{load_after[1]:.2f} (1 / 5 min) on {os.cpu_count()} CPUs: another job slows both routes; read the ratios",
        f"- torch threads: {args.threads or 'default'}; inputs "
        + ("reused from an earlier run" if write_seconds is None else f"written in {write_seconds:.1f} s"),
        *checks, *(f"- {n}" for n in notes),
    ]
    if not full:
        lines.append(f"- {args.layers} of 32 layers: seconds and output size grow linearly with the layers (every "
                     "layer the same 7 targets); peft holds the whole model, so its anonymous memory grows with the "
                     "layers too, while mergecal's should stay one key's (compare two --layers values); both RSS "
                     "columns also count file-backed pages of the mapped safetensors, which grow with the model and "
                     "which the kernel reclaims under pressure")
    return "\n".join(lines) + "\n", ok


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (Llama-2-7B: 32; default 2)")
    parser.add_argument("--experts", type=int, default=3, help="K adapters (default 3)")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--hidden", type=int, default=LLAMA_2_7B["hidden"], help=argparse.SUPPRESS)
    parser.add_argument("--intermediate", type=int, default=LLAMA_2_7B["intermediate"], help=argparse.SUPPRESS)
    parser.add_argument("--heads", type=int, default=LLAMA_2_7B["heads"], help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=LLAMA_2_7B["vocab"], help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help="runs per route, alternated (default 1)")
    parser.add_argument("--threads", type=int, default=None, help="OMP/MKL threads of each run (default: torch's)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where the inputs and outputs go (default: a temporary directory, removed after); "
                             "inputs of the same arguments are reused")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the process that measures the imports alone (a test's shortcut)")
    parser.add_argument("--keep", action="store_true", help="keep the merged outputs in --workdir")
    parser.add_argument("--mergekit", nargs="?", const="", default=None, metavar="MERGEKIT_YAML",
                        help="also run MergeKit (its mergekit-yaml; default: one on PATH or importable here)")
    parser.add_argument("--output", type=Path, default=None, help="write the report there too (atomically)")
    args = parser.parse_args(argv)
    for name in ("layers", "experts", "rank", "repeats", "hidden", "intermediate", "heads", "vocab"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}: expected at least 1, got {getattr(args, name)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--peft-child"]:  # the peft route, in its fresh process
        return peft_child(argv[1], argv[2], argv[3:])
    args = parse_args(argv)
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
        report, ok = measure(args, args.workdir.resolve())
    else:
        with tempfile.TemporaryDirectory(prefix="perf_adapters.") as tmp:
            report, ok = measure(args, Path(tmp))
    print("\n" + report, flush=True)
    if args.output is not None:
        from mergecal.checkpoint import atomic_write_text

        atomic_write_text(args.output, report)
        progress(f"written to {args.output}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
