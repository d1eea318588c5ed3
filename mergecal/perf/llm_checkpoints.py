"""Llama-shaped checkpoints for measuring merges at the sizes users merge: a base and K experts (the base plus
small noise) in the real key layout, bfloat16 safetensors shards with a config.json, written key by key so the
writer never holds a model. Random weights: a merge's time and memory do not depend on their values.

Sizes: ``smoke`` (a few MB, for tests and CI), ``1.6b`` (hidden 2048, 24 layers), ``7b`` (Llama-2-7B's shapes:
hidden 4096, MLP 11008, 32 layers, 32 heads, vocabulary 32000; about 13.5 GB per model in bfloat16).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..backbones.hf_directory import SAFETENSORS_METADATA
from ..checkpoint import ShardedCheckpointWriter, atomic_write_text

#: the SVC paper's Table 4 ("Singular Value Calibration...", arXiv:2602.05536): SVC on Llama-2-7B, what the
#: 7B measurements of scripts/gpu_session.py and scripts/perf_svd_llama.py are shown beside
SVC_PAPER_7B = {"seconds": 517.2, "peak_mib": 1898.7, "device": "A800 GPU"}

SIZES = {
    "smoke": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512},
    "1.6b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 16,
             "num_key_value_heads": 8, "vocab_size": 32000},
    "7b": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 32, "vocab_size": 32000},
}


def _size(size: str, layers: int | None) -> dict:
    """The size's configuration, with ``layers`` decoder layers instead of its own where given: every key shape
    of the full model stays, so a key-by-key merge's peak memory is the full model's (it holds one key at a time)."""
    c = dict(SIZES[size])
    if layers is not None:
        if layers < 1:
            raise ValueError(f"layers={layers}: expected at least 1 decoder layer")
        c["num_hidden_layers"] = layers
    return c


def config(size: str, layers: int | None = None) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_size(size, layers),
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "hidden_act": "silu"}


def shapes(size: str, layers: int | None = None) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape, in the Hugging Face Llama layout (``layers``: see ``_size``)."""
    return config_shapes(_size(size, layers))


def config_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter's shape of a Llama configuration (hidden, intermediate, vocab, heads, key/value heads and
    layers), in the Hugging Face layout and the order a writer goes through them."""
    h, m, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    kv = h // c["num_attention_heads"] * c["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (v, h)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                p + "mlp.down_proj.weight": (h, m),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return out | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def parameters(size: str, layers: int | None = None) -> int:
    return sum(torch.Size(s).numel() for s in shapes(size, layers).values())


def write_family(root: str | Path, size: str, experts: int = 3, *, max_shard_bytes: int = 2 * 1024**3,
                 device: str = "cpu", layers: int | None = None, reuse: bool = False) -> tuple[Path, list[Path]]:
    """``root/base`` and ``root/expert<i>``: the same base tensor in every model (seeded per key), each expert
    plus 1e-3 noise of its own; written atomically, never over a directory mergecal did not write. Returns
    (base, experts). ``device``: where the random
    numbers are drawn (a GPU draws 7B's much faster; the values differ from the CPU's, the shapes do not);
    ``layers``: another number of decoder layers than the size's own (``_size``). ``reuse``: keep a family this
    function wrote with the same arguments (``root/family.json``, written last) instead of writing it again (a 7B
    family is 4 x 13.5 GB)."""

    def randn(shape, seed: int) -> torch.Tensor:
        return torch.randn(shape, generator=torch.Generator(device).manual_seed(seed), device=device)

    root, table = Path(root), shapes(size, layers)
    names = ["base"] + [f"expert{i}" for i in range(experts)]
    stamp = json.dumps({"size": size, "layers": layers, "experts": experts, "max_shard_bytes": max_shard_bytes,
                        "device": torch.device(device).type, "torch": torch.__version__}, sort_keys=True)
    stamp_path = root / "family.json"
    if reuse and stamp_path.is_file() and stamp_path.read_text() == stamp and all((root / n).is_dir() for n in names):
        return root / "base", [root / n for n in names[1:]]
    stamp_path.unlink(missing_ok=True)  # a family being rewritten is no longer the stamped one
    paths = []
    for name, noise in [("base", None)] + [(f"expert{i}", i) for i in range(experts)]:
        writer = ShardedCheckpointWriter(root / name, max_shard_bytes=max_shard_bytes,
                                         metadata=SAFETENSORS_METADATA)
        for j, (key, shape) in enumerate(table.items()):
            tensor = torch.ones(shape, device=device) if len(shape) == 1 else 0.02 * randn(shape, j)
            if noise is not None:
                tensor += 1e-3 * randn(shape, 1000 * (noise + 1) + j)
            writer.add(key, tensor.to(torch.bfloat16))
        writer.finish()
        (writer.staging / "config.json").write_text(json.dumps(config(size, layers), indent=2))
        paths.append(writer.close())
    atomic_write_text(stamp_path, stamp)
    return paths[0], paths[1:]
