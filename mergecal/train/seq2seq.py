"""Pretraining a tiny T5 (encoder-decoder) from scratch with span corruption, and fine-tuning it into experts.

The SVC and MAGIC papers merge T5 / T0 models (T0-3B fine-tuned with IA³). Nothing can be downloaded, so a
seq2seq family makes its own base, as ``mergecal.train.lm`` does for the causal LM: a byte-level BPE tokenizer
trained on the corpus (digits one per token), with T5's special tokens (``<pad>`` = 0, the decoder's start token;
``</s>`` = 1, appended to every encoded text as T5's tokenizer does; sentinels ``<extra_id_0..N-1>`` at the top of
the vocabulary, ``<extra_id_0>`` the last id), and a small ``T5Config`` model, by default in T0's layout (T5 v1.1:
gated-gelu feed-forward, no rescaling of the decoder's output, no dropout in pretraining; ``lm_head`` stays tied to
the shared embedding: transformers >= 5 ties it whatever ``tie_word_embeddings`` says).

Pretraining is T5's span corruption (Raffel et al. 2020, arXiv:1910.10683, section 3.1.4 and 3.3): the corpus is
packed into blocks (documents separated by ``</s>``); in each block 15 % of the tokens, in spans of mean length 3,
are replaced by one sentinel per span in the input, and the target lists each sentinel followed by the tokens it
hides (``random_spans_noise_mask`` is T5's own algorithm). Masks are drawn afresh whenever a block is drawn,
from a generator seeded by ``seed``. Fine-tuning learns input -> target + ``</s>`` (loss on the target), either
every weight ("full") or peft's IA³ with its T5 defaults (k, v and the feed-forward wo; the vectors start at 1 and
are not decayed, as decay would pull them to 0, not to the identity).

AdamW, linear warmup then cosine decay (``lr_schedule``), gradient clipping, seeded initialisation, data order and
masks; the caller's RNG state is left unchanged. Each saved directory carries ``training.json`` without anything
measured at run time, so the same inputs write the same bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from tqdm.auto import tqdm

from ..backbones.construction import MODEL_CONSTRUCTION
from ..backbones.hf_causal_lm import load_tokenizer, save_causal_lm, weight_format, weights_digest
from ..config_types import (MAX_COUNT, MAX_INDEX, MAX_STEPS, ConfigValueError, Count, Flag, NonNegativeInt,
                            NonNegativeReal, PositiveReal, Probability, Steps)
from ..device import resolve_device
from ..errors import ParameterError, UnknownNameError
from .adapter_out import save_adapter
from .lm import METADATA_FILE, count_parameters, pack_corpus, read_metadata, text_digest, write_metadata
from .lm import _summary  # training.json's loss summary, the same as the tiny Llama's
from .lr_schedule import cosine_lr, set_lr

PAD, EOS = "<pad>", "</s>"
FEED_FORWARD = ("relu", "gated-gelu")  # original T5; T5 v1.1 and T0
METHODS = ("full", "ia3")
BASE_TOKENS = 258  # a byte-level BPE's 256 bytes, <pad> and </s>: the smallest vocabulary before merges

__all__ = ["BASE_TOKENS", "EOS", "FieldError", "METADATA_FILE", "METHODS", "PAD", "Seq2SeqTrainConfig",
           "TinyT5Shape", "create_tiny_t5", "encode_pairs", "finetune_t5", "load_t5", "pack_corpus",
           "pretrain_t5", "random_spans_noise_mask", "read_metadata", "sentinel", "sentinel_ids", "span_corrupt",
           "span_lengths", "train_seq2seq", "train_t5_tokenizer"]


class FieldError(ParameterError, ConfigValueError):
    """A bad value of one field: a one-line ParameterError naming it, whose ``key`` ``check_config`` reports too."""

    def __init__(self, key: str, message: str):
        ConfigValueError.__init__(self, key, message)


def _field_error(owner: str, name: str, expected: str, value) -> FieldError:
    return FieldError(name, f"{owner}.{name}: expected {expected}, got {value!r}")


def _check_fields(obj, ints: dict[str, tuple[int, int]], reals: dict[str, tuple[float, float, bool]]) -> None:
    """Integers in [lo, hi] (booleans refused), reals in (lo, hi) or [lo, hi) (``closed`` lo): one-line
    ParameterErrors naming the first wrong field."""
    owner = type(obj).__name__
    for name, (lo, hi) in ints.items():
        value = getattr(obj, name)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise _field_error(owner, name, f"an integer in [{lo}, {hi}]", value)
    for name, (lo, hi, closed) in reals.items():
        value = getattr(obj, name)
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value) and \
            (lo <= value if closed else lo < value) and value < hi
        if not ok:
            raise _field_error(owner, name, f"a number in {'[' if closed else '('}{lo}, {hi})", value)


@dataclass(frozen=True)
class TinyT5Shape:
    """The model's shape: about 0.2 M parameters with a 512-token vocabulary (T5-small is d_model 512, 6 + 6
    layers, 8 heads of 64; this is its miniature). ``extra_ids`` sentinels are part of ``vocab_size``."""

    vocab_size: Count = 512
    d_model: Count = 64
    d_kv: Count = 16
    d_ff: Count = 128
    num_layers: Count = 2  # encoder blocks
    num_decoder_layers: Count = 2
    num_heads: Count = 4
    relative_attention_num_buckets: Count = 32
    relative_attention_max_distance: Count = 128
    extra_ids: Count = 32  # sentinels; a block needs one per noise span (T5: 100)
    feed_forward_proj: Literal["relu", "gated-gelu"] = "gated-gelu"  # T0 / T5 v1.1; "relu": the original T5
    tie_word_embeddings: Flag = False  # T5 v1.1 unties the lm_head
    dropout_rate: Probability = 0.0  # T5 v1.1 pretrains without dropout

    def __post_init__(self):
        _check_fields(self, {f.name: (1, MAX_COUNT) for f in fields(self) if f.type == "Count"},
                      {"dropout_rate": (0.0, 1.0, True)})
        if self.feed_forward_proj not in FEED_FORWARD:
            raise _field_error("TinyT5Shape", "feed_forward_proj", " or ".join(FEED_FORWARD), self.feed_forward_proj)
        if not isinstance(self.tie_word_embeddings, bool):
            raise _field_error("TinyT5Shape", "tie_word_embeddings", "true or false", self.tie_word_embeddings)
        if self.vocab_size - self.extra_ids < BASE_TOKENS:  # the BPE's alphabet and specials come first
            raise _field_error("TinyT5Shape", "vocab_size", f">= {BASE_TOKENS} + extra_ids = "
                               f"{BASE_TOKENS + self.extra_ids} (256 bytes, <pad>, </s>, the sentinels)",
                               self.vocab_size)


@dataclass(frozen=True)
class Seq2SeqTrainConfig:
    """One optimisation run (pretraining or fine-tuning). ``max_length``: tokens of a pretraining block before
    corruption, and of a fine-tuning input (the start is cut, as lm-eval cuts contexts); ``target_length``: tokens
    of a fine-tuning target with its ``</s>``. ``weight_decay`` applies to matrices of a full run only."""

    steps: Steps = 300
    batch_size: Count = 32
    lr: PositiveReal = 3e-3  # IA³'s T-Few rate (Liu et al. 2022) too
    weight_decay: NonNegativeReal = 0.1
    warmup_fraction: Probability = 0.05
    max_length: Count = 64
    target_length: Count = 16
    grad_clip: PositiveReal = 1.0
    noise_density: Probability = 0.15  # T5's span corruption (arXiv:1910.10683, 3.3)
    mean_noise_span_length: PositiveReal = 3.0
    seed: NonNegativeInt = 0

    def __post_init__(self):
        _check_fields(self, {"steps": (1, MAX_STEPS), "batch_size": (1, MAX_COUNT), "max_length": (2, MAX_COUNT),
                             "target_length": (1, MAX_COUNT), "seed": (0, MAX_INDEX)},
                      {"lr": (0.0, np.inf, False), "weight_decay": (0.0, np.inf, True),
                       "warmup_fraction": (0.0, 1.0, True), "grad_clip": (0.0, np.inf, False),
                       "noise_density": (0.0, 1.0, False), "mean_noise_span_length": (0.0, np.inf, False)})
        if self.mean_noise_span_length < 1:
            raise _field_error("Seq2SeqTrainConfig", "mean_noise_span_length", "a number >= 1",
                               self.mean_noise_span_length)


# ------------------------------------------------------------------------------------------ tokenizer and model


def sentinel(i: int) -> str:
    return f"<extra_id_{i}>"


def train_t5_tokenizer(texts: Sequence[str], vocab_size: int = 512, extra_ids: int = 32):
    """A byte-level BPE trained on ``texts`` (every digit its own token) with ``<pad>`` = 0, ``</s>`` = 1 appended
    to each encoded text, and ``extra_ids`` sentinels as the last ids (``<extra_id_0>`` the very last, as in T5)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if not texts:
        raise ParameterError("train_t5_tokenizer: texts: expected at least one document")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - extra_ids, special_tokens=[PAD, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", pair=f"$A {EOS} $B {EOS}",
                                                             special_tokens=[(EOS, tokenizer.token_to_id(EOS))])
    sentinels = [sentinel(i) for i in reversed(range(extra_ids))]
    tokenizer.add_special_tokens(sentinels)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=PAD)


def sentinel_ids(tokenizer) -> list[int]:
    """Ids of ``<extra_id_0>``, ``<extra_id_1>``, ... as far as the tokenizer has them."""
    ids, vocab = [], tokenizer.get_vocab()
    while sentinel(len(ids)) in vocab:
        ids.append(vocab[sentinel(len(ids))])
    return ids


def create_tiny_t5(tokenizer, shape: TinyT5Shape = TinyT5Shape(), seed: int = 0):
    """A freshly initialised ``T5ForConditionalGeneration`` whose vocabulary is the tokenizer's."""
    from transformers import T5Config, T5ForConditionalGeneration

    values = {k: v for k, v in asdict(shape).items() if k != "extra_ids"}
    config = T5Config(**{**values, "vocab_size": len(tokenizer)}, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]), MODEL_CONSTRUCTION:
        torch.manual_seed(seed)
        model = T5ForConditionalGeneration(config)
    return model


def load_t5(model_dir: str | os.PathLike, *, device: str = "cpu"):
    """``(model, tokenizer)`` from a local directory written by ``pretrain_t5`` or ``finetune_t5(method="full")``."""
    from transformers import T5ForConditionalGeneration

    path = Path(model_dir)
    weight_format(path)
    with MODEL_CONSTRUCTION:
        model = T5ForConditionalGeneration.from_pretrained(str(path), local_files_only=True, use_safetensors=True)
    return model.to(resolve_device(device)).eval(), load_tokenizer(path)


# ---------------------------------------------------------------------------------------------- span corruption


def span_lengths(length: int, noise_density: float, mean_noise_span_length: float) -> tuple[int, int]:
    """(noise tokens, noise spans) of a block of ``length`` tokens, as T5 rounds them (at least one of each, and
    at least one token left); never more spans than kept tokens (as Hugging Face's T5 script guards it), so every
    span is separated from the next by kept tokens at any density."""
    if length < 2:
        raise ParameterError(f"span_lengths: length: expected >= 2, got {length}")
    num_noise = min(max(int(round(length * noise_density)), 1), length - 1)
    num_spans = max(int(round(min(num_noise, length - num_noise) / mean_noise_span_length)), 1)
    return num_noise, num_spans


def random_spans_noise_mask(length: int, noise_density: float, mean_noise_span_length: float,
                            rng: np.random.Generator) -> np.ndarray:
    """T5's ``random_spans_noise_mask`` (t5.data.preprocessors): a boolean mask of ``length`` with
    ``span_lengths`` noise tokens in that many spans, the span lengths a random segmentation, every block starting
    with kept tokens and alternating kept / noise spans."""
    num_noise, num_spans = span_lengths(length, noise_density, mean_noise_span_length)

    def segmentation(num_items: int, num_segments: int) -> np.ndarray:
        first = rng.permutation(np.arange(num_items - 1) < num_segments - 1)
        segment_id = np.cumsum(np.concatenate([[0], first]))
        return np.bincount(segment_id, minlength=num_segments)

    noise = segmentation(num_noise, num_spans)
    kept = segmentation(length - num_noise, num_spans)
    starts = np.cumsum(np.stack([kept, noise], axis=1).reshape(-1))[:-1]
    indicator = np.zeros(length, dtype=np.int64)
    indicator[starts] = 1
    return np.cumsum(indicator) % 2 == 1


def span_corrupt(ids: Sequence[int], mask: np.ndarray, sentinels: Sequence[int], eos_id: int
                 ) -> tuple[list[int], list[int]]:
    """(inputs, targets): inputs keep the unmasked tokens with each noise span replaced by its sentinel, targets are
    each sentinel followed by the tokens it replaced; both end with ``</s>``."""
    inputs, targets, span = [], [], -1
    for i, (token, noisy) in enumerate(zip(ids, mask)):
        if noisy:
            if i == 0 or not mask[i - 1]:
                span += 1
                if span >= len(sentinels):
                    raise ParameterError(f"span_corrupt: more noise spans than the {len(sentinels)} sentinels "
                                         "(raise TinyT5Shape.extra_ids)")
                inputs.append(sentinels[span])
                targets.append(sentinels[span])
            targets.append(int(token))
        else:
            inputs.append(int(token))
    return inputs + [eos_id], targets + [eos_id]


def _corruption_batches(blocks: torch.Tensor, tokenizer, config: Seq2SeqTrainConfig
                        ) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    """Each call corrupts the given blocks with fresh masks from one seeded generator (every row the same
    lengths, so no padding)."""
    rng = np.random.default_rng([config.seed, 1910])
    sentinels, eos = sentinel_ids(tokenizer), tokenizer.eos_token_id
    _, num_spans = span_lengths(blocks.shape[1], config.noise_density, config.mean_noise_span_length)
    if num_spans > len(sentinels):
        raise ParameterError(f"Seq2SeqTrainConfig.max_length: {blocks.shape[1]} tokens make {num_spans} noise spans "
                             f"but the tokenizer has {len(sentinels)} sentinels (raise TinyT5Shape.extra_ids)")

    def batch(idx: torch.Tensor) -> dict[str, torch.Tensor]:
        pairs = [span_corrupt(row.tolist(), random_spans_noise_mask(len(row), config.noise_density,
                                                                    config.mean_noise_span_length, rng),
                              sentinels, eos) for row in blocks[idx]]
        inputs = torch.tensor([p[0] for p in pairs], dtype=torch.long)
        return {"input_ids": inputs, "attention_mask": torch.ones_like(inputs),
                "labels": torch.tensor([p[1] for p in pairs], dtype=torch.long)}

    return batch


# ------------------------------------------------------------------------------------------------ fine-tuning data


def encode_pairs(tokenizer, inputs: Sequence[str], targets: Sequence[str], max_length: int, target_length: int
                 ) -> dict[str, torch.Tensor]:
    """Right-padded encoder inputs (each with its ``</s>``, the start cut past ``max_length``) and labels (target +
    ``</s>``, cut past ``target_length``, padded with -100)."""
    if len(inputs) != len(targets) or not inputs:
        raise ParameterError(f"encode_pairs: {len(inputs)} inputs but {len(targets)} targets")
    x = [ids[-max_length:] for ids in tokenizer(list(inputs))["input_ids"]]
    y = [ids[:target_length] for ids in tokenizer(list(targets))["input_ids"]]
    input_ids = torch.full((len(x), max(map(len, x))), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    labels = torch.full((len(y), max(map(len, y))), -100, dtype=torch.long)
    for i, (a, b) in enumerate(zip(x, y)):
        input_ids[i, :len(a)], mask[i, :len(a)] = torch.tensor(a), 1
        labels[i, :len(b)] = torch.tensor(b)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _row_batches(data: dict[str, torch.Tensor]) -> Callable[[torch.Tensor], dict[str, torch.Tensor]]:
    def batch(idx: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = {k: v[idx] for k, v in data.items()}
        width = int(rows["attention_mask"].sum(1).max())  # padding columns shared by the whole batch
        label_width = int((rows["labels"] != -100).sum(1).max())
        return {"input_ids": rows["input_ids"][:, :width], "attention_mask": rows["attention_mask"][:, :width],
                "labels": rows["labels"][:, :label_width]}

    return batch


# --------------------------------------------------------------------------------------------------- the loop


def train_seq2seq(model, batches: Callable[[torch.Tensor], dict[str, torch.Tensor]], n: int,
                  config: Seq2SeqTrainConfig, *, decay: bool = True, desc: str = "train", progress: bool = True,
                  device: str = "cpu") -> list[float]:
    """Train the trainable parameters of ``model`` in place on ``batches(row indices)`` over ``n`` rows (seeded
    order, reshuffled each epoch). ``decay=False``: no weight decay at all (IA³ vectors). Returns every step's
    loss."""
    device = resolve_device(device)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model.to(device).train()
        trainable = [p for p in model.parameters() if p.requires_grad]
        matrices = [p for p in trainable if p.ndim >= 2 and decay]
        others = [p for p in trainable if not (p.ndim >= 2 and decay)]
        optimizer = torch.optim.AdamW([{"params": matrices, "weight_decay": config.weight_decay},
                                       {"params": others, "weight_decay": 0.0}], lr=config.lr)
        warmup = int(config.warmup_fraction * config.steps)
        generator = torch.Generator().manual_seed(config.seed)
        size = min(config.batch_size, n)
        order, cursor = torch.randperm(n, generator=generator), 0
        for step in tqdm(range(config.steps), desc=desc, unit="step", disable=not progress):
            if cursor + size > n:
                order, cursor = torch.randperm(n, generator=generator), 0
            batch = {k: v.to(device) for k, v in batches(order[cursor:cursor + size]).items()}
            cursor += size
            loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
            set_lr(optimizer, cosine_lr(step, config.steps, warmup, config.lr))
            optimizer.step()
            losses.append(loss.item())
    return losses


def pretrain_t5(texts: Sequence[str], out_dir: str | os.PathLike, *, shape: TinyT5Shape = TinyT5Shape(),
                config: Seq2SeqTrainConfig = Seq2SeqTrainConfig(), progress: bool = True, device: str = "cpu") -> Path:
    """Train the tokenizer and a tiny T5 on ``texts`` by span corruption; save both (and ``training.json``) to
    ``out_dir``, a directory ``T5ForConditionalGeneration.from_pretrained`` loads."""
    tokenizer = train_t5_tokenizer(texts, shape.vocab_size, shape.extra_ids)
    model = create_tiny_t5(tokenizer, shape, seed=config.seed)
    blocks = pack_corpus(tokenizer, texts, config.max_length)  # documents joined by </s>
    num_noise, num_spans = span_lengths(config.max_length, config.noise_density, config.mean_noise_span_length)
    losses = train_seq2seq(model, _corruption_batches(blocks, tokenizer, config), int(blocks.shape[0]), config,
                           desc="pretrain (span corruption)", progress=progress, device=device)
    model.to("cpu").eval()
    save_causal_lm(model, tokenizer, out_dir)
    write_metadata(out_dir, {"task": "pretrain", "objective": "span_corruption", "shape": asdict(shape),
                             "config": asdict(config), "data_sha256": text_digest(texts), "n_documents": len(texts),
                             "n_blocks": int(blocks.shape[0]), "noise_tokens_per_block": num_noise,
                             "noise_spans_per_block": num_spans,
                             "input_length": config.max_length - num_noise + num_spans + 1,
                             "target_length": num_noise + num_spans + 1, "parameters": count_parameters(model),
                             **_summary(losses)})
    return Path(out_dir)


def finetune_t5(model_dir: str | os.PathLike, examples: Sequence[dict], out_dir: str | os.PathLike, *, task: str,
                method: Literal["full", "ia3"] = "full", config: Seq2SeqTrainConfig = Seq2SeqTrainConfig(),
                base_name: str | None = None, progress: bool = True, device: str = "cpu") -> Path:
    """Fine-tune the T5 in ``model_dir`` on ``examples`` (``input``/``target``; ``mergecal.data.seq2seq``) and save
    to ``out_dir``: "full" a model directory like the base's, "ia3" a peft adapter directory (IA³ with peft's T5
    defaults, ``adapter_config.json`` + ``adapter_model.safetensors``, which ``mergecal.adapters.read_adapter``
    reads; its config names the base ``base_name``, or ``model_dir`` as given: ``train.adapter_out``). Both carry
    ``training.json``."""
    if method not in METHODS:
        raise UnknownNameError(f"finetune_t5: method {method!r}: choose one of: {', '.join(METHODS)}")
    if not examples:
        raise ParameterError("finetune_t5: examples: expected at least one")
    model, tokenizer = load_t5(model_dir)
    inputs, targets = [e["input"] for e in examples], [e["target"] for e in examples]
    data = encode_pairs(tokenizer, inputs, targets, config.max_length, config.target_length)
    if method == "ia3":
        from peft import IA3Config, get_peft_model

        model = get_peft_model(model, IA3Config(task_type="SEQ_2_SEQ_LM"))
    losses = train_seq2seq(model, _row_batches(data), len(examples), config, decay=method == "full",
                           desc=f"fine-tune {task} ({method})", progress=progress, device=device)
    model.to("cpu").eval()
    metadata = {"task": task, "method": method, "base_weights_sha256": weights_digest(model_dir),
                "config": asdict(config),
                "data_sha256": text_digest([f"{a}\t{b}" for a, b in zip(inputs, targets)]),
                "n_examples": len(examples), "trainable_parameters": sum(p.numel() for p in model.parameters()
                                                                         if p.requires_grad), **_summary(losses)}
    if method == "full":
        save_causal_lm(model, tokenizer, out_dir)
        write_metadata(out_dir, metadata)
    else:
        save_adapter(model, out_dir, base=model_dir, base_name=base_name, metadata=metadata)
    return Path(out_dir)
