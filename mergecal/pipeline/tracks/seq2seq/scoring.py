"""How the seq2seq family's models are loaded and scored T0-style, by rank classification
(``mergecal.evaluation.seq2seq``), and a regime's references (base and experts' scores, task-vector norms): what
the sources' stages and the family's cells both read. Beneath the cells (it imports none of the pipeline's cell
code), so that an edit to the cells reruns no stage that builds models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ....adapters import LoraExpert, linear_layouts, read_adapter
from ....checkpoint import SafetensorsSource, load_state_dict
from ....evaluation.seq2seq import rank_classification
from ....train.seq2seq import load_t5

#: a regime's experts: full model directories, or PEFT adapters of the base (``mergecal.adapters.expert_kind``)
EXPERT_KIND = {"standard": "full", "ia3": "ia3", "lora": "lora"}


@dataclass(frozen=True)
class Scorer:
    """Rank classification of a track's tasks: ``examples(task, split)`` gives a split's examples (``{"input",
    "choices", "label"}``), ``batch_size`` the scorer's, ``max_validation`` the examples per task on validation
    (choosing the scaling; the whole split when larger)."""

    examples: Callable[[str, str], list[dict]]
    batch_size: int
    max_validation: int

    def score(self, model, tokenizer, tasks, split: str, *, device: str = "cpu") -> dict[str, dict]:
        """{task: ``accuracy`` and per-example ``correct``} of one model on one split (validation: its first
        ``max_validation`` examples)."""
        limit = self.max_validation if split == "validation" else None
        out = {}
        for task in tasks:
            found = rank_classification(model, tokenizer, self.examples(task, split)[:limit],
                                        batch_size=self.batch_size, device=device)
            out[task] = {"accuracy": float(found["accuracy"]), "correct": [float(c) for c in found["correct"]]}
        return out


def load_model(base: Path, model: Path, *, device: str = "cpu"):
    """A model directory (the base, a full expert, a merge), or a PEFT adapter applied on the base by peft, ready to
    score; with the base's tokenizer."""
    if model != base and (model / "adapter_config.json").is_file():
        from peft import PeftModel

        pretrained, tokenizer = load_t5(base, device=device)
        return PeftModel.from_pretrained(pretrained, str(model)).eval(), tokenizer
    return load_t5(model, device=device)


def task_vector_norm(base: Path, expert: Path, regime: str) -> float:
    """‖τ‖ of an expert: its weights minus the base's (full), its IA³ vectors minus one (ia3), or its LoRA deltas on
    the base (lora, read as ``mergecal.adapters`` merges them)."""
    if regime == "ia3":
        tensors = load_state_dict(expert / "adapter_model.safetensors")
        return float(sum((t.double() - 1).square().sum() for t in tensors.values()) ** 0.5)
    if regime == "lora":
        source = SafetensorsSource(base)
        applied = LoraExpert(source, read_adapter(expert), layouts=linear_layouts(base))
        return float(sum((applied.get(k).double() - source.get(k).double()).square().sum()
                         for k in applied.keys() if applied.touches(k)) ** 0.5)
    pretrained = load_state_dict(base / "model.safetensors")
    fine = load_state_dict(expert / "model.safetensors")
    return float(sum((fine[k].double() - v.double()).square().sum() for k, v in pretrained.items()
                     if torch.is_floating_point(v)) ** 0.5)


def score_base(scorer: Scorer, base: Path, tasks, *, device: str = "cpu") -> dict[str, dict[str, float]]:
    """The base's accuracy per task on validation and on test."""
    model, tokenizer = load_model(base, base, device=device)
    return {split: {t: s["accuracy"] for t, s in scorer.score(model, tokenizer, tasks, split, device=device).items()}
            for split in ("validation", "test")}


def expert_reference(scorer: Scorer, base: Path, expert: Path, task: str, tasks, regime: str, *,
                     device: str = "cpu") -> dict:
    """An expert's references: its score on its own task (validation and test, the normalized score's
    denominators; per-example on test: the finetuned row's interval), on every task's test split, and its task
    vector's norm."""
    model, tokenizer = load_model(base, expert, device=device)
    val = scorer.score(model, tokenizer, [task], "validation", device=device)[task]
    test = scorer.score(model, tokenizer, tasks, "test", device=device)
    return {"val_accuracy": val["accuracy"], "test_accuracy": test[task]["accuracy"],
            "test_all_tasks": {t: s["accuracy"] for t, s in test.items()}, "test_correct": test[task]["correct"],
            "norm": task_vector_norm(base, expert, regime)}


def references(scorer: Scorer, base: Path, experts: dict[str, Path], regime: str, *, device: str = "cpu") -> dict:
    """A regime's references: the base's scores (``score_base``) and each expert's (``expert_reference``)."""
    tasks = list(experts)
    return {"base": score_base(scorer, base, tasks, device=device),
            "tasks": {task: expert_reference(scorer, base, expert, task, tasks, regime, device=device)
                      for task, expert in experts.items()}}
