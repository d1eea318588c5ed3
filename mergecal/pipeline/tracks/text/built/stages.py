"""The MiniLM text track of the pipeline: the packaged pretrained encoder, one fine-tuned encoder + head per
task, merged encoders scored with each task's own head.

    data/text/                                          the text suite (mergecal.data.text)
    models/<backbone>/seeds/<s>/                        one fine-tuning seed's (``seeds`` in params.yaml):
      finetuned/standard/<task>.safetensors (+ .json)   encoder keys that training changed,
                                                        plus ``head.*`` (the task's own head)
      references.json                                   each fine-tuned model's validation/test scores

Only data-free chains run on this track (merge, SVC, WSC without a probed ranking): the steps the calibration
registry marks ``needs_data`` (DisTaC, FSC, so DSC) need a task-model adapter for text that is not built yet,
so the pipeline skips those chains here (``cells._text_cells``).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from .....backbones.hf_text import build_classifier, load_encoder, tokenize
from .....checkpoint import SafetensorsSource, atomic_write_text, load_state_dict, save_state_dict
from .....data.text import TextSuiteConfig, build_text_suite, load_text_split
from .....data.vision import validation_indices
from .....train.finetune_text import (TextFinetuneConfig, classifier_logits, evaluate_text, finetune_text_task,
                                     text_scores)
from ....config import Params, fine_tuning_seed, seed_dir

HEAD = "head."


def data_root(root: str | Path) -> Path:
    return Path(root) / "data" / "text"


def models_root(params: Params, root: str | Path) -> Path:
    return Path(root) / "models" / params.text.backbone


def seed_root(params: Params, root: str | Path, seed: int | None = None) -> Path:
    """Fine-tuning seed ``seed``'s models (None: the first of ``params.seeds``)."""
    return seed_dir(models_root(params, root), fine_tuning_seed(params, seed))


def finetuned_path(params: Params, root: str | Path, task: str, seed: int | None = None) -> Path:
    return seed_root(params, root, seed) / "finetuned" / "standard" / f"{task}.safetensors"


def references_path(params: Params, root: str | Path, seed: int | None = None) -> Path:
    return seed_root(params, root, seed) / "references.json"


def split(root: str | Path, task: str, name: str, max_items: int | None = None):
    """(texts, labels); ``validation`` is the held-out part of train, ``train`` the rest."""
    texts, labels = load_text_split(data_root(root), task, "train" if name in ("train", "validation") else name)
    if name in ("train", "validation"):
        val = validation_indices(len(labels))
        keep = np.zeros(len(labels), dtype=bool)
        keep[val] = True
        keep = keep if name == "validation" else ~keep
        texts, labels = [t for t, k in zip(texts, keep) if k], labels[keep]
    if max_items is not None:
        texts, labels = texts[:max_items], labels[:max_items]
    return texts, labels


def n_classes(root: str | Path, task: str) -> int:
    manifest = json.loads((data_root(root) / "manifest.json").read_text())
    return len(manifest["tasks"][task]["classnames"])


def build_data(params: Params, root: str | Path = ".") -> dict:
    return build_text_suite(data_root(root), TextSuiteConfig(**{"seed": params.seed, **params.text.data}))


def finetune(params: Params, task: str, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
             progress: bool = True) -> dict:
    seed = fine_tuning_seed(params, seed)
    config = TextFinetuneConfig(**{"seed": seed, **params.text.finetune})
    encoder, _ = load_encoder()
    pretrained = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    texts, labels = split(root, task, "train")
    classes = n_classes(root, task)
    enc, head, history = finetune_text_task(pretrained, texts, labels, classes, config, progress=progress,
                                            device=device)
    changed = {k: v.contiguous() for k, v in enc.items() if not torch.equal(v, pretrained[k])}
    val_texts, val_labels = split(root, task, "validation")
    val = evaluate_text(enc, head, val_texts, val_labels, classes, max_length=config.max_length, device=device)
    manifest = json.loads((data_root(root) / "manifest.json").read_text())
    metadata = {"backbone": params.text.backbone, "task": task, "variant": "standard",
                "hyperparameters": asdict(config), "data_digest": manifest["tasks"][task]["digests"]["train"],
                "final_loss": history[-1]["loss"], "val_accuracy": val["accuracy"],
                "layout": "encoder keys changed by fine-tuning (others equal the packaged MiniLM) + head.*"}
    out = finetuned_path(params, root, task, seed)
    save_state_dict({**changed, **{HEAD + k: v.contiguous() for k, v in head.items()}}, out,
                    {"mergecal": json.dumps(metadata)})
    atomic_write_text(out.with_suffix(".json"), json.dumps(metadata, indent=2))
    return metadata


class TextModels:
    """What a text cell reads, loaded once per instance: the pretrained encoder, each task's head and its
    tokenized splits, and one classifier whose encoder weights are replaced for each evaluated encoder. The
    fine-tuned models are those of fine-tuning seed ``seed`` (None: the first of ``params.seeds``)."""

    def __init__(self, params: Params, root: str | Path = ".", seed: int | None = None):
        self.params, self.root, self.seed = params, Path(root), fine_tuning_seed(params, seed)
        self.max_length = params.text.finetune.get("max_length", 32)
        self._heads: dict[str, dict[str, torch.Tensor]] = {}
        self._inputs: dict[tuple, tuple[dict[str, torch.Tensor], np.ndarray]] = {}

    @cached_property
    def pretrained(self) -> dict[str, torch.Tensor]:
        encoder, _ = load_encoder()
        return {k: v.detach().clone() for k, v in encoder.state_dict().items() if v.is_floating_point()}

    def finetuned(self, task: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(full encoder state, head state) of a task's fine-tuned model."""
        stored = load_state_dict(finetuned_path(self.params, self.root, task, self.seed))
        head = {k[len(HEAD):]: v for k, v in stored.items() if k.startswith(HEAD)}
        encoder = {**self.pretrained, **{k: v for k, v in stored.items() if not k.startswith(HEAD)}}
        return encoder, head

    def head(self, task: str) -> dict[str, torch.Tensor]:
        if task not in self._heads:
            source = SafetensorsSource(finetuned_path(self.params, self.root, task, self.seed))
            self._heads[task] = {k[len(HEAD):]: source.get(k) for k in source.keys() if k.startswith(HEAD)}
        return self._heads[task]

    def inputs(self, task: str, which: str, max_items: int | None) -> tuple[dict[str, torch.Tensor], np.ndarray]:
        key = (task, which, max_items)
        if key not in self._inputs:
            _, tokenizer = load_encoder()
            texts, labels = split(self.root, task, which, max_items)
            self._inputs[key] = (tokenize(tokenizer, texts, self.max_length), labels)
        return self._inputs[key]

    @cached_property
    def _classifier(self):
        return build_classifier(self.pretrained, None, 1).eval()

    def evaluate(self, encoder: dict[str, torch.Tensor], tasks, which: str, *, max_items: int | None = None,
                 device: str = "cpu", per_example: bool = False) -> dict[str, dict[str, float]]:
        """Each task's accuracy, entropy and ECE with ``encoder`` and the task's own head (``per_example``: and
        each example's 0/1 outcome, ``"correct"``)."""
        model = self._classifier
        model.encoder.load_state_dict({**self.pretrained, **encoder}, strict=False)
        model.to(device)
        out = {}
        for task in tasks:
            head = self.head(task)
            model.head = torch.nn.Linear(head["weight"].shape[1], head["weight"].shape[0]).to(device)
            model.head.load_state_dict(head)
            encoded, labels = self.inputs(task, which, max_items)
            out[task] = text_scores(classifier_logits(model, encoded, device=device), labels,
                                    per_example=per_example)
        return out


def references(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu") -> dict:
    """Each task's own fine-tuned model on validation and test (normalized accuracy's denominator), the
    pretrained encoder with each head (the text track's ``zeroshot`` row: no fine-tuned encoder) and norms."""
    models = TextModels(params, root, seed)
    report = {}
    for task in params.text.tasks:
        encoder, _ = models.finetuned(task)
        val = models.evaluate(encoder, [task], "validation", device=device)[task]
        test = models.evaluate(encoder, [task], "test", device=device, per_example=True)[task]
        norm = float(sum((encoder[k] - v).double().pow(2).sum() for k, v in models.pretrained.items()) ** 0.5)
        report[task] = {"norm": norm, "entropy": test["entropy"], "ece": test["ece"], "val_accuracy": val["accuracy"],
                        "test_accuracy": test["accuracy"],
                        "test_correct": test["correct"]}  # the finetuned row's per-example results
    atomic_write_text(references_path(params, root, models.seed), json.dumps(report, indent=2))
    return report
