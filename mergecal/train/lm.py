"""Pretraining a tiny Llama-family causal LM from scratch, and fine-tuning it into task experts.

Nothing can be downloaded, so the LLM track makes its own base model: a byte-level BPE tokenizer trained on the
corpus (digits split one per token, so sums are learnable) wrapped in ``PreTrainedTokenizerFast``, and a small
``LlamaConfig`` model (tied embeddings, grouped-query attention, as in small Llama 3 models). Pretraining packs
the corpus into fixed-length blocks (documents separated by EOS); fine-tuning learns ``prompt + completion + EOS``
with the loss on the completion and EOS only (supervised fine-tuning). Both use AdamW, linear warmup then cosine
decay, gradient clipping, seeded initialisation and data order; the caller's global RNG state is left unchanged.
Each saved directory carries ``training.json``: task, hyperparameters, data sha256, losses; nothing measured at
run time (seconds go to the caller, which logs them), so the same inputs write the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..backbones.hf_causal_lm import load_causal_lm, save_causal_lm, weights_digest
from ..config_types import ConfigValueError, Count, Flag, NonNegativeInt, NonNegativeReal, PositiveReal, Probability, \
    Steps
from ..device import resolve_device
from ..checkpoint import atomic_write_text
from ..errors import ParameterError
from .adapter_out import METADATA_FILE, save_adapter
from .lr_schedule import cosine_lr, set_lr

EOS, PAD = "<|endoftext|>", "<|pad|>"
#: peft's LoRA targets of a Llama block: every linear map (attention and MLP), as QLoRA and most lab adapters
LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TinyLlamaShape:
    """The model's shape; the defaults give about 0.9 M parameters with a 1024-token vocabulary."""

    vocab_size: Count = 1024
    hidden_size: Count = 128
    intermediate_size: Count = 384
    num_hidden_layers: Count = 4
    num_attention_heads: Count = 4
    num_key_value_heads: Count = 2
    max_position_embeddings: Count = 128
    tie_word_embeddings: Flag = True

    def __post_init__(self):
        problem = shape_problem(self)
        if problem is not None:
            raise ConfigValueError(*problem)


def shape_problem(shape: TinyLlamaShape) -> tuple[str, str] | None:
    """(field, message) of the first rule of transformers' Llama that ``shape`` breaks, else None: heads split
    the hidden size, key/value heads group the attention heads (grouped-query attention), and rotary embeddings
    rotate pairs of dimensions, so a head's size is even. Checked when the shape is built (params.yaml is
    loaded), not deep inside a stage."""
    hidden, heads, kv_heads = shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads
    if hidden % heads:
        return "num_attention_heads", f"{heads} heads do not divide hidden_size {hidden}"
    if heads % kv_heads:
        return "num_key_value_heads", f"{kv_heads} key/value heads do not divide num_attention_heads {heads}"
    if (hidden // heads) % 2:
        return "num_attention_heads", (f"a head's size hidden_size / num_attention_heads = {hidden // heads} is "
                                       "odd; rotary embeddings need it even")
    return None


@dataclass(frozen=True)
class LmTrainConfig:
    steps: Steps = 300
    batch_size: Count = 32
    lr: PositiveReal = 3e-3
    weight_decay: NonNegativeReal = 0.1
    warmup_fraction: Probability = 0.05
    max_length: Count = 64  # tokens per pretraining block; fine-tuning examples are truncated to it
    grad_clip: PositiveReal = 1.0
    freeze_embeddings: Flag = False  # keep the (tied) token embeddings: task vectors then live in the blocks
    seed: NonNegativeInt = 0


@dataclass(frozen=True)
class LoraSettings:
    """A LoRA fine-tune (peft's ``LoraConfig``): rank, alpha (peft's scaling alpha / rank), the target modules;
    no dropout, A drawn from the fine-tune's seed, B zero (peft's default initialisation)."""

    rank: Count = 8
    alpha: PositiveReal = 16.0
    targets: tuple[str, ...] = LLAMA_LINEARS

    def __post_init__(self):
        targets = tuple(self.targets)
        if not targets or not all(isinstance(t, str) and t for t in targets):
            raise ConfigValueError("targets", f"expected module names, got {self.targets!r}")
        object.__setattr__(self, "targets", targets)


def train_tokenizer(texts: Sequence[str], vocab_size: int = 1024):
    """A byte-level BPE (no unknown tokens) trained on ``texts``, every digit its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                       pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=PAD)


def create_tiny_llama(tokenizer, shape: TinyLlamaShape = TinyLlamaShape(), seed: int = 0):
    """A freshly initialised ``LlamaForCausalLM`` whose vocabulary is the tokenizer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**asdict(shape), "vocab_size": len(tokenizer)}, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


def text_digest(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
        h.update(b"\n")
    return h.hexdigest()


def pack_corpus(tokenizer, texts: Sequence[str], block: int) -> torch.Tensor:
    """[n_blocks, block] token ids: documents joined by EOS, cut into blocks (the ragged tail is dropped)."""
    ids: list[int] = []
    for encoded in tokenizer(list(texts), add_special_tokens=False)["input_ids"]:
        ids += encoded + [tokenizer.eos_token_id]
    n = len(ids) // block
    if n == 0:
        raise ParameterError(f"pack_corpus: {len(ids)} tokens do not fill one block of {block}")
    return torch.tensor(ids[:n * block], dtype=torch.long).view(n, block)


def encode_examples(tokenizer, prompts: Sequence[str], completions: Sequence[str], max_length: int
                    ) -> dict[str, torch.Tensor]:
    """Right-padded ``prompt + completion + EOS`` (at most ``max_length`` tokens); labels are -100 except on the
    completion and EOS."""
    if len(prompts) != len(completions) or not prompts:
        raise ParameterError(f"encode_examples: {len(prompts)} prompts but {len(completions)} completions")
    p_ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    c_ids = tokenizer(list(completions), add_special_tokens=False)["input_ids"]
    rows, starts = [], []  # too long: the prompt loses its start (as lm-eval truncates contexts), never the answer
    for p, c in zip(p_ids, c_ids):
        row = p + c + [tokenizer.eos_token_id]
        cut = max(0, len(row) - max_length)
        rows.append(row[cut:])
        starts.append(max(0, len(p) - cut))
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row, start) in enumerate(zip(rows, starts)):
        input_ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
        labels[i, start:len(row)] = torch.tensor(row[start:], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def train_causal_lm(model, data: dict[str, torch.Tensor], config: LmTrainConfig, *, desc: str = "train",
                    progress: bool = True, device: str = "cpu") -> list[float]:
    """Train ``model`` in place on rows of ``data`` (``input_ids`` and optionally ``attention_mask``/``labels``;
    without labels every token is a target). Returns the loss of every step."""
    if config.steps < 1 or config.batch_size < 1:
        raise ParameterError(f"LmTrainConfig: steps and batch_size must be >= 1, got {config.steps}, "
                             f"{config.batch_size}")
    n = data["input_ids"].shape[0]
    device = resolve_device(device)
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model.to(device).train()
        if config.freeze_embeddings:
            model.get_input_embeddings().requires_grad_(False)
            model.get_output_embeddings().requires_grad_(False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": config.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=config.lr)
        warmup = int(config.warmup_fraction * config.steps)
        generator = torch.Generator().manual_seed(config.seed)
        order, cursor = torch.randperm(n, generator=generator), 0
        for step in tqdm(range(config.steps), desc=desc, unit="step", disable=not progress):
            if cursor + config.batch_size > n:
                order, cursor = torch.randperm(n, generator=generator), 0
            idx = order[cursor:cursor + config.batch_size]
            cursor += config.batch_size
            batch = {k: v[idx].to(device) for k, v in data.items()}
            if "attention_mask" in batch:  # trim padding columns shared by the whole batch
                width = int(batch["attention_mask"].sum(1).max())
                batch = {k: v[:, :width] for k, v in batch.items()}
            labels = batch.pop("labels", batch["input_ids"])
            loss = model(**batch, labels=labels).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable, config.grad_clip)
            set_lr(optimizer, cosine_lr(step, config.steps, warmup, config.lr))
            optimizer.step()
            losses.append(loss.item())
    return losses


def write_metadata(out_dir: str | os.PathLike, metadata: dict) -> Path:
    return atomic_write_text(Path(out_dir) / METADATA_FILE, json.dumps(metadata, indent=2))


def read_metadata(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / METADATA_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _summary(losses: list[float]) -> dict:
    tail = losses[-max(1, len(losses) // 10):]
    return {"first_loss": losses[0], "final_loss": sum(tail) / len(tail),
            "losses_every_10": [round(x, 4) for x in losses[::10]]}


def pretrain_lm(texts: Sequence[str], out_dir: str | os.PathLike, *, shape: TinyLlamaShape = TinyLlamaShape(),
                config: LmTrainConfig = LmTrainConfig(), progress: bool = True, device: str = "cpu") -> Path:
    """Train the tokenizer and a tiny Llama on ``texts``; save both (and ``training.json``) to ``out_dir``."""
    tokenizer = train_tokenizer(texts, shape.vocab_size)
    model = create_tiny_llama(tokenizer, shape, seed=config.seed)
    blocks = pack_corpus(tokenizer, texts, config.max_length)
    losses = train_causal_lm(model, {"input_ids": blocks}, config, desc="pretrain", progress=progress, device=device)
    model.to("cpu").eval()
    save_causal_lm(model, tokenizer, out_dir)
    write_metadata(out_dir, {"task": "pretrain", "shape": asdict(shape), "config": asdict(config),
                             "data_sha256": text_digest(texts), "n_documents": len(texts),
                             "n_blocks": int(blocks.shape[0]), "parameters": count_parameters(model),
                             **_summary(losses)})
    return Path(out_dir)


def finetune_lm(model_dir: str | os.PathLike, records: Sequence[dict], out_dir: str | os.PathLike, *,
                task: str, config: LmTrainConfig = LmTrainConfig(), lora: LoraSettings | None = None,
                base_name: str | None = None, progress: bool = True, device: str = "cpu") -> Path:
    """Fine-tune the model in ``model_dir`` on ``records`` (``prompt``/``completion``); save to ``out_dir``: the
    whole model (a directory like the base's), or with ``lora`` a peft LoRA adapter (``adapter_config.json`` +
    ``adapter_model.safetensors``, which ``mergecal.adapters`` merges; its config names the base ``base_name``, or
    ``model_dir`` as given). Both carry ``training.json``."""
    model, tokenizer = load_causal_lm(model_dir)
    prompts, completions = [r["prompt"] for r in records], [r["completion"] for r in records]
    data = encode_examples(tokenizer, prompts, completions, config.max_length)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        with torch.random.fork_rng(devices=[]):  # A's initialisation from the fine-tune's seed
            torch.manual_seed(config.seed)
            model = get_peft_model(model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                     target_modules=list(lora.targets), lora_dropout=0.0,
                                                     bias="none", task_type="CAUSAL_LM"))
    losses = train_causal_lm(model, data, config, desc=f"fine-tune {task}", progress=progress, device=device)
    model.to("cpu").eval()
    metadata = {"task": task, "base_weights_sha256": weights_digest(model_dir), "config": asdict(config),
                "data_sha256": text_digest([p + c for p, c in zip(prompts, completions)]),
                "n_examples": len(records), **_summary(losses)}
    if lora is None:
        save_causal_lm(model, tokenizer, out_dir)
        write_metadata(out_dir, metadata)
    else:
        metadata.update(lora={**asdict(lora), "targets": list(lora.targets)},
                        trainable_parameters=sum(p.numel() for p in model.parameters() if p.requires_grad))
        save_adapter(model, out_dir, base=model_dir, base_name=base_name, metadata=metadata)
    return Path(out_dir)
