"""Memory and time of a streamed merge + SVC of K = 3 LLM-shaped sharded checkpoints (issue #16, item 3), beside
a plain read of the same files.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/perf_local_llm_merge.py DIR write     # once: base + 3 experts
    OMP_NUM_THREADS=2 .venv/bin/python scripts/perf_local_llm_merge.py DIR plain     # each in a fresh process
    OMP_NUM_THREADS=2 .venv/bin/python scripts/perf_local_llm_merge.py DIR "task_arithmetic>svc"

``write`` puts into DIR a Llama of about 1.6 B parameters (hidden 2048, MLP 8192, 24 layers, 16 heads / 8 KV
heads, vocabulary 32000, untied embeddings; random weights in the real key layout, bfloat16, 2 GB shards) and
three experts (the base plus 1e-3 noise), written key by key so the script itself never holds a model.
``plain`` reads every tensor of the 3 experts into memory (what a whole-state-dict merge starts from); a recipe
runs what an LLM cell does: ``merge_causal_lms`` streams the merge (and SVC) key by key into a sharded
output directory. Prints seconds and the peak extra anonymous memory (the checkpoints' file-backed mmap pages
excluded: the kernel drops them at will).
"""

import json
import shutil
import sys
import time
from pathlib import Path

import torch

from mergecal.merge_causal_lm import merge_causal_lms
from mergecal.checkpoint import ShardedCheckpointWriter, load_state_dict
from mergecal.perf.memory import peak_anonymous_memory
from mergecal.recipe import Recipe

K = 3
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 8,
          "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
          "torch_dtype": "bfloat16", "hidden_act": "silu"}


def shapes() -> dict[str, tuple[int, ...]]:
    h, m, v = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    kv = h // CONFIG["num_attention_heads"] * CONFIG["num_key_value_heads"]
    out = {"model.embed_tokens.weight": (v, h)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                p + "mlp.down_proj.weight": (h, m),
                p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    return out | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def write(root: Path) -> None:
    table = shapes()
    print(f"{sum(torch.Size(s).numel() for s in table.values()) / 1e9:.2f} B parameters per model")
    for name, noise in [("base", None)] + [(f"expert{i}", i) for i in range(K)]:
        out = root / name
        writer = ShardedCheckpointWriter(out, max_shard_bytes=2 * 1024**3, overwrite=True)
        for j, (key, shape) in enumerate(table.items()):
            g = torch.Generator().manual_seed(j)  # the same base tensor in every model
            tensor = torch.ones(shape) if len(shape) == 1 else 0.02 * torch.randn(shape, generator=g)
            if noise is not None:
                tensor += 1e-3 * torch.randn(shape, generator=torch.Generator().manual_seed(1000 * (noise + 1) + j))
            writer.add(key, tensor.to(torch.bfloat16))
        writer.finish()
        (writer.staging / "config.json").write_text(json.dumps(CONFIG, indent=2))
        writer.close()
        print(f"wrote {out}", flush=True)


def main(root: Path, what: str) -> None:
    if what == "write":
        write(root)
        return
    experts = [root / f"expert{i}" for i in range(K)]
    start = time.perf_counter()
    with peak_anonymous_memory() as peak:
        if what == "plain":
            states = [{k: v.clone() for f in sorted(e.glob("*.safetensors")) for k, v in load_state_dict(f).items()}
                      for e in experts]
            assert len(states) == K
        else:
            out = root / "merged"
            merge_causal_lms(root / "base", experts, Recipe.parse(what), out, overwrite=True)
    print(f"{what}: {time.perf_counter() - start:.1f} s, peak anonymous memory +{peak.extra_mb:.0f} MiB "
          f"(baseline {peak.baseline_mb:.0f} MiB)")
    if what != "plain":
        shutil.rmtree(root / "merged")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
