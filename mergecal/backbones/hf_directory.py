"""A merge of Hugging Face model directories written as a Hugging Face model directory: the base's config (and
generation and image-processor configs), the tokenizer files of the base or of a named input, and a short model
card, beside the merged weights, so that ``from_pretrained(out)`` loads it (as MergeKit's outputs do). Nothing is
downloaded and nothing measured at run time (a date, a host) is written: the same merge gives the same files.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import CheckpointError

CONFIG_FILES = ("config.json", "generation_config.json", "preprocessor_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")
SAFETENSORS_METADATA = {"format": "pt"}  # transformers refuses safetensors files without it
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}


def is_hf_model_dir(path: str | os.PathLike) -> bool:
    """A directory holding a Hugging Face ``config.json``."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def tokenizer_files(directory: str | os.PathLike) -> list[Path]:
    return [Path(directory) / name for name in TOKENIZER_FILES if (Path(directory) / name).is_file()]


def check_hf_sources(base: str | os.PathLike, tokenizer_from: str | os.PathLike | None) -> None:
    """Before any merging: a named tokenizer source must hold tokenizer files (one line naming it otherwise)."""
    if tokenizer_from is not None and not tokenizer_files(tokenizer_from):
        raise CheckpointError(f"--tokenizer-from {tokenizer_from}: no tokenizer files there "
                              f"(expected one of {', '.join(TOKENIZER_FILES[:4])}, ...)")


def model_card(base: str | os.PathLike, finetuned: Sequence[str | os.PathLike], recipe_id: str, version: str,
               dtype: torch.dtype | None, tokenizer_from: str | os.PathLike | None) -> str:
    """A short README.md: what was merged, how, and by which mergecal."""
    lines = ["---", "library_name: transformers", "tags:", "- merge", "- mergecal",
             f"base_model: {json.dumps(str(base))}", "---", "", f"# Merged with mergecal {version}", "",
             f"Recipe: `{recipe_id}`", "", f"Base (pretrained) model: `{base}`", "", "Fine-tuned models merged:", ""]
    lines += [f"- `{path}`" for path in finetuned]
    lines += ["", f"Tokenizer files from: `{tokenizer_from or base}`",
              f"Weights dtype: {DTYPE_NAMES[dtype] if dtype is not None else 'as the base'}", "",
              "Reproduce: `mergecal merge --pretrained BASE --finetuned MODEL ... --recipe \"<recipe>\"` with the "
              "recipe above.", ""]
    return "\n".join(lines)


def write_hf_files(stage: Path, base: str | os.PathLike, *, tokenizer_from: str | os.PathLike | None,
                   dtype: torch.dtype | None, card: str) -> None:
    """Into the output's staging directory: the base's configs (``dtype`` recorded in config.json when given),
    the tokenizer files of ``tokenizer_from`` (None: the base's) and the model card."""
    base = Path(base)
    for name in CONFIG_FILES:
        if (base / name).is_file():
            shutil.copy2(base / name, stage / name)
    if dtype is not None:  # the weights' dtype, which from_pretrained(dtype="auto") reads
        config = json.loads((stage / "config.json").read_text())
        names = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
        config.update(dict.fromkeys(names, DTYPE_NAMES[dtype]))
        (stage / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in tokenizer_files(tokenizer_from if tokenizer_from is not None else base):
        shutil.copy2(path, stage / path.name)
    (stage / "README.md").write_text(card)
