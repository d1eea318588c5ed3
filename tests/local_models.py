"""A lab's own models written to disk for the tests (random weights in the real key layouts, tiny datasets in the
layouts a lab has): used by tests/test_local_clip.py and by the end-to-end `dvc repro` of tests/test_pipeline_e2e.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

CLIP_ARCH = "mergecal-vit-micro"
CLIP_TASKS = ("MNIST", "EuroSAT", "SVHN")
LLM_MICRO = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64)


def perturb_trainable(model, seed: int, scale: float = 0.05) -> None:
    """Trained-looking adapter weights: every trainable tensor of a peft model moved by seeded noise (lora_B starts
    at zero; IA³ vectors stay near 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(scale * torch.randn(param.shape, generator=g).to(param.dtype))


class CreatesAFile:
    """Unpickling this creates ``path``: a pickle that must never be loaded."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def write_unrelated_files(directory: Path) -> list[str]:
    """Files a configured path may hold beside what its loader reads (a copy of a password file, notes): none
    may be read or recorded. Their names."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "shadow").write_text("root:$6$not-a-real-hash:19000:0:99999:7:::\n")
    (directory / "notes.txt").write_text("lab notes: nothing the benchmark reads\n")
    return ["shadow", "notes.txt"]


def perturbed(state: dict, seed: int, prefix: str, scale: float = 0.02) -> dict:
    """The floating-point entries of ``state`` under ``prefix``, each plus ``scale`` times seeded noise."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state.items()
            if k.startswith(prefix) and v.is_floating_point()}


def write_image_datasets(root: Path) -> None:
    """MNIST and SVHN as ImageFolder (train/val/test/<class>/), EuroSAT as HF parquet shards with ClassLabel
    names; 10 classes, 2 images per class and split, images that depend on the class."""
    import datasets

    from mergecal.data.real_vision import task_metadata

    rng = np.random.default_rng(0)

    def image(label: int) -> np.ndarray:
        base = np.full((32, 32, 3), 20 * label, dtype=np.uint8)
        return (base + rng.integers(0, 40, size=base.shape)).astype(np.uint8)

    for task, folder in (("MNIST", "mnist"), ("SVHN", "svhn")):
        for split in ("train", "val", "test"):
            for label in range(10):
                out = root / folder / split / str(label)
                out.mkdir(parents=True, exist_ok=True)
                for i in range(2):
                    Image.fromarray(image(label)).save(out / f"{i}.png")
    names = task_metadata("EuroSAT")[0]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    data = root / "EuroSAT" / "data"
    data.mkdir(parents=True)
    for split in ("train", "validation", "test"):
        labels = [label for label in range(10) for _ in range(2)]
        ds = datasets.Dataset.from_dict({"image": [Image.fromarray(image(y)) for y in labels], "label": labels},
                                        features=features)
        ds.to_parquet(str(data / f"{split}-00000-of-00001.parquet"))


def write_clip_track(root: Path, name: str) -> dict:
    """A ``local_clip`` track under ``root``: a micro open_clip CLIP as one safetensors file, one fine-tuned image
    encoder per task (open_clip safetensors) and the datasets; absolute paths."""
    from mergecal.backbones.open_clip_vit import create_clip, save_clip
    from mergecal.checkpoint import save_state_dict

    write_image_datasets(root / "data")
    model = create_clip(CLIP_ARCH, seed=1)
    save_clip(model, root / "pretrained.safetensors")
    state = model.state_dict()
    finetuned = {}
    for i, task in enumerate(CLIP_TASKS):
        finetuned[task] = str(save_state_dict(perturbed(state, 2 + i, "visual."), root / f"{task}.safetensors"))
    return {"name": name, "model": {"arch": CLIP_ARCH, "pretrained": str(root / "pretrained.safetensors")},
            "finetuned": finetuned, "datasets": {t: str(root / "data") for t in CLIP_TASKS},
            "evaluation": {"batch_size": 16, "max_validation": 12}, "min_test": 20,  # the datasets' 20 test images
            "distac": {"steps": 3, "batch_size": 8}}  # the paper's 500 steps of 128 images: not at smoke size


def write_llm_family(root: Path, name: str) -> dict:
    """A ``local_llm`` family under ``root``: a micro Llama base and two experts (random perturbations of it, one
    sharded) scored on the suite's tasks maximum and sentiment; absolute paths."""
    from mergecal.backbones.hf_causal_lm import causal_lm_state_dict, save_causal_lm, save_causal_lm_weights
    from mergecal.train.lm import TinyLlamaShape, create_tiny_llama, train_tokenizer

    corpus = ["max(12, 7) = 12", "The movie was great. Sentiment: positive", "Is 5 larger than 3? Yes."] * 30
    tokenizer = train_tokenizer(corpus, LLM_MICRO["vocab_size"])
    base = save_causal_lm(create_tiny_llama(tokenizer, TinyLlamaShape(**LLM_MICRO), seed=1), tokenizer, root / "base")
    state = causal_lm_state_dict(base)
    experts = {}
    for seed, (task, shard) in enumerate((("maximum", None), ("sentiment", 4096)), start=2):
        noisy = {**state, **perturbed(state, seed, "", scale=0.05)}
        kwargs = {"max_shard_bytes": shard} if shard else {}
        experts[task] = str(save_causal_lm_weights(noisy, root / task, like=base, **kwargs))
    return {"name": name, "base": str(base), "experts": experts,
            "data": {"n_pretrain": 20, "n_train": 4, "n_validation": 4, "n_test": 4}, "min_test": 4,
            "evaluation": {"max_validation": 4, "batch_size": 8}}


def micro_hf_clip():
    """A micro Hugging Face CLIPModel with the real parameter names (seeded, random weights; open_clip's vocabulary
    size so its tokenizer's ids fit), in eval mode."""
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    return CLIPModel(CLIPConfig(text_config=dict(tower, num_hidden_layers=1, vocab_size=49408,
                                                 max_position_embeddings=32),
                                vision_config=dict(tower, num_hidden_layers=2, image_size=32, patch_size=8),
                                projection_dim=16)).eval()
