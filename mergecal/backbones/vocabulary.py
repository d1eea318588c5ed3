"""Aligning the vocabularies of a causal-LM base and its experts before a merge, as DARE's code does.

Some published experts add tokens to their base's vocabulary: WizardMath-7B-V1.0 adds a ``[PAD]`` token (id 32000)
to Llama-2-7B's 32,000, so its embedding and LM head have one row more than the base and Llama-2-7b-chat. The
papers that merge that pair (the SVC and MAGIC papers, after DARE: "Language Models are Super Mario", arXiv
2311.03099) use DARE's code, whose ``align_tokenizers_and_embeddings`` gives every model the union of the added
tokens: a model lacking one gets a row equal to the mean of its own rows, in the input and the output embeddings;
then the task vectors are taken over the aligned shapes.

Here (``align_vocabulary=True`` of ``merge_causal_lms``; ``align_vocabulary: true`` on a ``local_llm`` track) the
same, read key by key without copying a model: ``aligned_vocabulary`` checks that the models differ only by tokens
appended after the base's vocabulary, in one order (each model's added tokens a prefix of the longest list: DARE's
code appends a missing token after a model's own, which for two experts adding different tokens would give one
id two meanings; that case is refused), and ``PaddedVocabularySource`` serves each model's embedding and LM head
with the mean rows appended. The mean is taken in float64 over the rows and rounded to the key's dtype (DARE's code
takes it in the model's dtype: a bfloat16 row may differ in its last bit). The merged directory takes its config
and tokenizer from the model holding every added token.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import CheckpointError

#: the keys whose first dimension is the vocabulary (Llama, Mistral, Qwen layouts)
VOCABULARY_KEYS = ("model.embed_tokens.weight", "lm_head.weight")
MEAN_BLOCK_ROWS = 4096  # rows summed at a time for a key's mean row


@dataclass(frozen=True)
class Vocabulary:
    directory: Path
    size: int  # config.json's vocab_size
    added: tuple[str, ...]  # the tokens its tokenizer adds from the base's size on, by id


def added_tokens(model_dir: Path) -> dict[int, str]:
    """{id: token} a model's tokenizer files add, from the first of tokenizer.json (``added_tokens``),
    added_tokens.json (``{token: id}``, beside a sentencepiece tokenizer.model) and tokenizer_config.json
    (``added_tokens_decoder``) that the directory holds."""
    def read(name):
        try:
            return json.loads((model_dir / name).read_text())
        except ValueError as err:
            raise CheckpointError(f"{model_dir / name}: not valid JSON ({err})") from None

    try:
        if (model_dir / "tokenizer.json").is_file():
            return {int(t["id"]): str(t["content"]) for t in read("tokenizer.json").get("added_tokens") or []}
        if (model_dir / "added_tokens.json").is_file():
            return {int(i): str(t) for t, i in read("added_tokens.json").items()}
        if (model_dir / "tokenizer_config.json").is_file():
            decoder = read("tokenizer_config.json").get("added_tokens_decoder") or {}
            return {int(i): str(t["content"]) for i, t in decoder.items()}
    except (AttributeError, KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"{model_dir}: its added tokens are not readable ({err!r})") from None
    return {}


def _vocabulary(model_dir: Path, base_size: int | None) -> Vocabulary:
    try:
        size = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{model_dir / 'config.json'}: no readable vocab_size ({err})") from None
    start = size if base_size is None else base_size
    added = sorted((i, t) for i, t in added_tokens(model_dir).items() if i >= start)
    ids = [i for i, _ in added]
    if ids != list(range(start, start + len(ids))):
        raise CheckpointError(f"{model_dir}: the tokens added from id {start} on are not consecutive ({ids[:5]})")
    return Vocabulary(model_dir, size, tuple(token for _, token in added))


def aligned_vocabulary(pretrained_dir: str | os.PathLike, expert_dirs: Sequence[str | os.PathLike]
                       ) -> tuple[int, Path, dict[Path, int]]:
    """(the aligned vocabulary size, the directory whose tokenizer holds every added token, {model directory: its
    own vocabulary size}); one CheckpointError naming the model otherwise."""
    base = _vocabulary(Path(pretrained_dir), None)
    if base.added:
        raise CheckpointError(f"{base.directory}: the base model's tokenizer has tokens beyond its vocab_size "
                              f"{base.size} ({base.added[0]!r}); only experts may add tokens")
    models = [base] + [_vocabulary(Path(p), base.size) for p in expert_dirs]
    for model in models[1:]:
        if model.size < base.size:
            raise CheckpointError(f"{model.directory / 'config.json'}: vocab_size {model.size}, fewer rows than the "
                                  f"base's {base.size}")
        if model.size - base.size != len(model.added):
            raise CheckpointError(f"{model.directory}: vocab_size {model.size} is {model.size - base.size} rows "
                                  f"beyond the base's {base.size}, but its tokenizer adds {len(model.added)} tokens "
                                  "there")
    longest = max(models, key=lambda m: len(m.added))
    for model in models:
        if model.added != longest.added[:len(model.added)]:
            raise CheckpointError(f"{model.directory}: its tokenizer adds {list(model.added)} where "
                                  f"{longest.directory} adds {list(longest.added)}: one token id would mean two "
                                  "tokens after alignment")
    return longest.size, longest.directory, {m.directory: m.size for m in models}


class PaddedVocabularySource:
    """A ``TensorSource`` whose vocabulary keys (``VOCABULARY_KEYS`` with ``own_size`` rows) have rows appended up to
    ``size``, each the mean of the key's own rows; every other key as the wrapped source gives it."""

    def __init__(self, source, own_size: int, size: int):
        self._source, self._own, self._size = source, own_size, size
        self.name = source.name
        self._means: dict[str, torch.Tensor] = {}
        self._padded = {k for k in source.keys()
                        if k in VOCABULARY_KEYS and size > own_size and source.shape(k)[:1] == (own_size,)}

    def keys(self) -> list[str]:
        return self._source.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        shape = self._source.shape(key)
        return (self._size, *shape[1:]) if key in self._padded else shape

    def dtype(self, key: str) -> torch.dtype:
        return self._source.dtype(key)

    def _mean(self, key: str) -> torch.Tensor:
        if key not in self._means:
            total = None
            for start in range(0, self._own, MEAN_BLOCK_ROWS):
                rows = self._rows(key, start, min(start + MEAN_BLOCK_ROWS, self._own)).double().sum(dim=0)
                total = rows if total is None else total.add_(rows)
            self._means[key] = (total / self._own).to(self.dtype(key))
        return self._means[key]

    def _rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        if hasattr(self._source, "get_rows"):
            return self._source.get_rows(key, start, stop)
        return self._source.get(key)[start:stop]

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        if key not in self._padded or stop <= self._own:
            return self._rows(key, start, stop)
        own = self._rows(key, start, self._own) if start < self._own else None
        extra = self._mean(key).unsqueeze(0).expand(stop - max(start, self._own), -1)
        return extra.clone() if own is None else torch.cat([own, extra])

    def get(self, key: str) -> torch.Tensor:
        if key not in self._padded:
            return self._source.get(key)
        return self.get_rows(key, 0, self._size)


#: config keys an expert that adds tokens changes: its rows, and the id of an added pad token
ALIGNED_CONFIG_KEYS = ("vocab_size", "pad_token_id")


def check_aligned_family(pretrained_dir: str | os.PathLike, expert_dirs: Sequence[str | os.PathLike]) -> None:
    """``hf_causal_lm.check_same_family`` for experts that may add tokens: the same config but for
    ``ALIGNED_CONFIG_KEYS``, and the same base vocabulary (every tokenizer file both hold: tokenizer.model, vocab.json
    and merges.txt byte for byte, tokenizer.json's ``model`` section), at least one file compared; then
    ``aligned_vocabulary``'s checks. One CheckpointError naming the expert's file otherwise."""
    from .hf_causal_lm import check_same_config

    base = Path(pretrained_dir)
    for expert in map(Path, expert_dirs):
        check_same_config(base, expert, ignore=ALIGNED_CONFIG_KEYS)
        compared = 0
        for name in ("tokenizer.model", "vocab.json", "merges.txt", "tokenizer.json"):
            mine, theirs = expert / name, base / name
            if not (mine.is_file() and theirs.is_file()):
                continue
            compared += 1
            same = (mine.read_bytes() == theirs.read_bytes() if name != "tokenizer.json"
                    else json.loads(mine.read_text()).get("model") == json.loads(theirs.read_text()).get("model"))
            if not same:
                raise CheckpointError(f"{mine}: the base vocabulary differs from the base model's ({theirs}); merged "
                                      "weights would index another vocabulary")
        if not compared:
            raise CheckpointError(f"{expert}: no tokenizer file in common with the base model {base} "
                                  "(tokenizer.model, vocab.json, merges.txt or tokenizer.json), so whether it indexes "
                                  "the same vocabulary cannot be checked")
    aligned_vocabulary(base, expert_dirs)
