"""The LLM suite's tasks in text-to-text form, for a tiny T5-shaped (encoder-decoder) model.

The SVC and MAGIC papers merge T5 / T0 models evaluated T0-style: each answer choice is scored by its
log-likelihood under the model and the highest wins (rank classification). The tasks here are the LLM suite's
(``mergecal.data.llm``: maximum, knowledge, sentiment), drawn by its own generators and splits, so a seq2seq family
and the causal-LM family see the same examples: only the form changes. Each example is
``{"input": prompt, "target": answer, "choices": [...], "label": i}``, with ``choices[label] == target``:

* ``maximum``: the two numbers, in the order the prompt shows them (generated greedily: exact match);
* ``knowledge``: the 4 categories of the LLM record; ``sentiment``: the two labels.

The target carries no leading space: the decoder starts it afresh, as a T5 target does. The pretraining corpus is
the LLM suite's, one document per string (span corruption turns it into inputs and targets,
``mergecal.train.seq2seq``). Everything is seeded per sample as in ``mergecal.data.llm``: same config, same examples.
"""

from __future__ import annotations

import re

from ..errors import ParameterError, UnknownNameError
from .llm import TASKS, LlmSuiteConfig, generate_corpus, generate_task

SPLITS = ("train", "validation", "test")
_MAX_ARGS = re.compile(r"max\((\d+), (\d+)\)")


def seq2seq_example(task: str, record: dict) -> dict:
    """One LLM record (``prompt``, ``completion``, and ``target`` or ``choices``/``label``) as a text-to-text
    example."""
    target = record["completion"].strip()
    if task == "maximum":
        found = _MAX_ARGS.search(record["prompt"])
        if found is None:
            raise ParameterError(f"seq2seq_example: no 'max(a, b)' in the maximum prompt {record['prompt']!r}")
        choices = list(found.groups())
    else:
        choices = list(record["choices"])
    if target not in choices:
        raise ParameterError(f"seq2seq_example: target {target!r} is not among the choices {choices}")
    return {"input": record["prompt"], "target": target, "choices": choices, "label": choices.index(target)}


def seq2seq_task(task: str, split: str, n: int, config: LlmSuiteConfig | None = None) -> list[dict]:
    """``n`` examples of one task's split: ``mergecal.data.llm.generate_task``'s records, in text-to-text form."""
    config = config or LlmSuiteConfig()
    if task not in TASKS:
        raise UnknownNameError(f"unknown seq2seq task {task!r}; choose one of: {', '.join(TASKS)}")
    if split not in SPLITS:
        raise UnknownNameError(f"unknown split {split!r}; choose one of: {', '.join(SPLITS)}")
    if n < 1:
        raise ParameterError(f"seq2seq_task: n: expected >= 1, got {n}")
    return [seq2seq_example(task, r) for r in generate_task(task, split, n, config)]


def seq2seq_splits(task: str, config: LlmSuiteConfig | None = None) -> dict[str, list[dict]]:
    """Every split of one task at the config's sizes (``n_train``, ``n_validation``, ``n_test``)."""
    config = config or LlmSuiteConfig()
    sizes = {"train": config.n_train, "validation": config.n_validation, "test": config.n_test}
    return {split: seq2seq_task(task, split, n, config) for split, n in sizes.items()}


def pretraining_documents(n: int, config: LlmSuiteConfig | None = None) -> list[str]:
    """The first ``n`` documents of the LLM suite's corpus (train-split facts only), as strings."""
    if n < 1:
        raise ParameterError(f"pretraining_documents: n: expected >= 1, got {n}")
    return [doc["text"] for doc in generate_corpus(n, config or LlmSuiteConfig())]
