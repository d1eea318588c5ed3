"""Evaluating an encoder-decoder (T5-shaped) model T0-style: rank classification and greedy exact match.

T0 (Sanh et al. 2022) and the SVC / MAGIC papers' T5 / T0 merges score a multiple-choice example by rank
classification: every answer choice is scored by its log-likelihood under the model given the input, and the
highest wins. Pairs are encoded as lm-eval's seq2seq backend encodes them (``HFLM(backend="seq2seq")``, lm-eval
0.4.13: ``_encode_pair``), so the scores equal lm-eval's: the context with the tokenizer's special tokens (a T5
tokenizer appends ``</s>``), the continuation without (no ``</s>`` scored), trailing spaces of the context moved
to the continuation, and the decoder fed the continuation shifted right after the decoder start token. The sum of
the continuation tokens' log-probabilities is the score (not normalised by length, as T0's). Generation is greedy
(``num_beams=1``, no sampling) until ``</s>`` or ``max_new_tokens``; exact match compares the stripped text.
Batches are in the given order, padded on the right (encoder positions masked; decoder padding comes after every
scored position, so a causal decoder never sees it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..device import resolve_device
from ..errors import ParameterError


def _check(batch_size: int, device: str | None) -> str:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ParameterError(f"batch_size: expected an integer >= 1, got {batch_size!r}")
    return resolve_device(device)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's seq2seq backend encodes them."""
    if not context:
        raise ParameterError("encode_pair: the context is empty (a seq2seq model scores a continuation of an input)")
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    cont = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    if not cont:
        raise ParameterError(f"encode_pair: the continuation {continuation!r} has no tokens")
    return tokenizer(stripped)["input_ids"], cont


@torch.no_grad()
def loglikelihoods(model, tokenizer, pairs: Sequence[tuple[str, str]], *, batch_size: int = 32,
                   device: str = "cpu") -> list[float]:
    """log p(continuation | context) of every (context, continuation) pair, summed over the continuation's tokens."""
    device = _check(batch_size, device)
    model.to(device).eval()
    encoded = [encode_pair(tokenizer, c, x) for c, x in pairs]
    out: list[float] = []
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start:start + batch_size]
        width, cont_width = max(len(c) for c, _ in chunk), max(len(x) for _, x in chunk)
        input_ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        labels = torch.full((len(chunk), cont_width), -100, dtype=torch.long)
        for i, (c, x) in enumerate(chunk):
            input_ids[i, :len(c)], mask[i, :len(c)] = torch.tensor(c), 1
            labels[i, :len(x)] = torch.tensor(x)
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device), labels=labels.to(device)).logits
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        scored = labels != -100
        token = torch.gather(logprobs, 2, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        out += [float(v) for v in (token * scored).sum(1)]
    return out


def rank_classification(model, tokenizer, examples: Sequence[dict], *, batch_size: int = 32,
                        device: str = "cpu") -> dict:
    """T0's rank classification of ``examples`` (``input``, ``choices``, ``label``): ``accuracy``, ``correct``
    (0/1 per example), ``predictions`` (the winning choice's index; the first on a tie) and ``scores`` (per choice)."""
    if not examples:
        raise ParameterError("rank_classification: examples: expected at least one")
    pairs = [(e["input"], choice) for e in examples for choice in e["choices"]]
    flat = loglikelihoods(model, tokenizer, pairs, batch_size=batch_size, device=device)
    scores, correct, predictions, at = [], [], [], 0
    for e in examples:
        row = flat[at:at + len(e["choices"])]
        at += len(row)
        best = max(range(len(row)), key=lambda i: (row[i], -i))
        scores.append(row)
        predictions.append(best)
        correct.append(int(best == e["label"]))
    return {"accuracy": sum(correct) / len(correct), "correct": correct, "predictions": predictions,
            "scores": scores}


@torch.no_grad()
def generate(model, tokenizer, inputs: Sequence[str], *, max_new_tokens: int = 8, batch_size: int = 32,
             device: str = "cpu") -> list[str]:
    """Greedy generations for ``inputs`` (special tokens dropped, stripped)."""
    device = _check(batch_size, device)
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ParameterError(f"max_new_tokens: expected an integer >= 1, got {max_new_tokens!r}")
    model.to(device).eval()
    texts: list[str] = []
    for start in range(0, len(inputs), batch_size):
        batch = tokenizer(list(inputs[start:start + batch_size]), padding=True, return_tensors="pt")
        ids = model.generate(input_ids=batch["input_ids"].to(device),
                             attention_mask=batch["attention_mask"].to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id,
                             decoder_start_token_id=model.config.decoder_start_token_id)
        texts += [t.strip() for t in tokenizer.batch_decode(ids, skip_special_tokens=True)]
    return texts


def exact_match(model, tokenizer, examples: Sequence[dict], *, max_new_tokens: int = 8, batch_size: int = 32,
                device: str = "cpu") -> dict:
    """Greedy generation against ``target``: ``accuracy``, ``correct`` (0/1 per example), ``generations``."""
    if not examples:
        raise ParameterError("exact_match: examples: expected at least one")
    texts = generate(model, tokenizer, [e["input"] for e in examples], max_new_tokens=max_new_tokens,
                     batch_size=batch_size, device=device)
    correct = [int(t == e["target"].strip()) for t, e in zip(texts, examples)]
    return {"accuracy": sum(correct) / len(correct), "correct": correct, "generations": texts}
