"""The papers' analysis figures on the testbed's models: what ``stages/paper_analysis.py`` computes for the
analyses of ``mergecal/experiments/<paper>.yaml`` (``analyses:``), from the vision track's files of its first
fine-tuning seed and the standard regime.

Each analysis is a function of the models alone (no resampling of test examples): the SVC paper's Figs. 2/4 and 3
(``mergecal.analysis.svc_spectrum``) for each merge it names, read at scaling 1; MAGIC's Figs. 1, 3, 4, 5 and 9
(``mergecal.analysis.magic_features``) on the merges at the scaling the default run chose for them
(results/benchmark.json) and on each task's first test images. The document is rounded to six significant digits,
so it is stable to read and compare."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..analysis.magic_features import (clip_probe, default_operations, feature_projection, fsc_coefficients,
                                       layer_swap_gain, magnitude_ratios, merge_visual, task_sensitivity)
from ..analysis.svc_spectrum import figure_data
from ..errors import MergecalError
from ..task_vectors import TaskVectorSet
from .config import Params
from .distac_analysis import ANALYSES as DISTAC_ANALYSES
from .rounding import rounded
from .tracks.clip.built.stages import VisionModels, preprocessed, task_split



def merge_settings(params: Params, merge: str) -> dict[str, Any]:
    """The matrix's settings of ``merge`` without its scaling (the analyses read every merge at scaling 1)."""
    if merge not in params.benchmark.merges:
        raise MergecalError(f"analysis: merge {merge!r} is not in params.yaml's benchmark.merges")
    return {k: v for k, v in (params.benchmark.merges[merge] or {}).items() if k != "scaling"}


def _svc_figure_data(params: Params, models, merge: str, regime: str) -> dict[str, Any]:
    """Figs. 2/4 and 3 share one computation per merge (``figure_data``: the spectra and the cross terms), kept on
    the models' loader for the document's other analyses."""
    cache = models.__dict__.setdefault("svc_figure_data", {})
    if (merge, regime) not in cache:
        tvs = TaskVectorSet.from_models(models.visual_pretrained(), models.finetuned(regime),
                                        names=list(params.vision.tasks))
        cache[(merge, regime)] = figure_data(tvs, merge, method_params=merge_settings(params, merge), top=3)
    return cache[(merge, regime)]


def svc_spectrum(params: Params, models, merges: list[str], regime: str, root: Path) -> dict[str, Any]:
    """Per merge and key class: sigma, sigma* and gamma sigma per subspace r (the class means)."""
    return {merge: {"alpha": (data := _svc_figure_data(params, models, merge, regime))["alpha"],
                    "classes": {name: {"keys": len(c["keys"]), "shape": c["shape"], "spectrum": c["spectrum"]}
                                for name, c in data["classes"].items()}} for merge in merges}


def svc_cross_terms(params: Params, models, merges: list[str], regime: str, root: Path) -> dict[str, Any]:
    """Per merge and key class: the K x K cross terms of the top subspaces, each divided by sigma_r^2."""
    return {merge: {"tasks": (data := _svc_figure_data(params, models, merge, regime))["tasks"],
                    "classes": {name: {"keys": len(c["keys"]), "cross_terms": c["cross_terms"]}
                                for name, c in data["classes"].items()}} for merge in merges}


# ------------------------------------------------------------------------------------------------------ MAGIC

IMAGES_PER_TASK = 32  # test images of each task the feature analyses run on (Fig. 9: its first XI_SAMPLES)
XI_SAMPLES = 8
#: the "intermediate layer" of Figs. 1 and 9 and the layers of Fig. 4: the middle blocks' attention and MLP outputs
MIDDLE_BLOCK = "visual.transformer.resblocks.{}"


def _magic_inputs(params: Params, models, regime: str) -> dict[str, Any]:
    """What every MAGIC analysis reads, loaded once per regime: a CLIP factory, the image encoders, each task's
    first test images."""
    cache = models.__dict__.setdefault("magic_inputs", {})
    if regime not in cache:
        tasks = list(params.vision.tasks)
        cache[regime] = {
            "clip": lambda: models.model({}), "pretrained": models.visual_pretrained(),
            "finetuned": models.finetuned(regime), "tasks": tasks,
            "images": [preprocessed(task_split(models.paths.data, t, "test", max_items=IMAGES_PER_TASK)[0],
                                    params.vision.arch) for t in tasks]}
    return cache[regime]


def chosen_scaling(root: Path, merge: str, regime: str, seed: int) -> float:
    """The scaling the default run chose for ``merge`` alone (results/benchmark.json): the merge as the board runs
    it."""
    rows = json.loads((Path(root) / "results" / "benchmark.json").read_text())["rows"]
    for row in rows:
        if (row["track"], row["regime"], row.get("seed", 0), row["label"]) == ("vision", regime, seed, merge):
            if "selected_scaling" in row:
                return float(row["selected_scaling"])
    raise MergecalError(f"results/benchmark.json: no vision {regime} row of {merge} (seed {seed}) with its scaling")


def _merged(params: Params, models, root: Path, merge: str, regime: str) -> dict:

    inputs = _magic_inputs(params, models, regime)
    scaling = chosen_scaling(root, merge, regime, models.paths.seed)
    return merge_visual(inputs["pretrained"], inputs["finetuned"], merge,
                        **{**merge_settings(params, merge), "scaling": scaling})


def _middle(params: Params, models, regime: str) -> int:
    """The index of the middle transformer block (of blocks 0..L-1: L // 2)."""
    keys = _magic_inputs(params, models, regime)["pretrained"]
    return sum(1 for k in keys if k.endswith(".attn.in_proj_weight")) // 2


def magic_projection(params: Params, models, merges: list[str], regime: str, root: Path) -> dict[str, Any]:
    """Fig. 1: the merges' and the specialised models' task features at the middle block, in 2-D."""
    inputs = _magic_inputs(params, models, regime)
    merged = {m: _merged(params, models, root, m, regime) for m in merges}
    layer = MIDDLE_BLOCK.format(_middle(params, models, regime)) + ".mlp.c_proj"
    return feature_projection(inputs["clip"], inputs["pretrained"], inputs["finetuned"], merged, inputs["images"],
                              layer, task_names=inputs["tasks"])


def magic_magnitude(params: Params, models, merges: list[str], regime: str, root: Path) -> dict[str, Any]:
    """Fig. 3: weight against feature magnitude ratios of the operations ``merges`` names (trim, sum, disjoint)."""
    inputs = _magic_inputs(params, models, regime)
    operations = {k: v for k, v in default_operations(len(inputs["tasks"])).items() if k in merges}
    if len(operations) != len(merges):
        raise MergecalError(f"analysis magic_magnitude: operations are trim, sum, disjoint, not {merges}")
    return magnitude_ratios(inputs["clip"], inputs["pretrained"], inputs["finetuned"], inputs["images"],
                            operations=operations, task_names=inputs["tasks"])


def magic_swap(params: Params, models, merges: list[str], regime: str, root: Path) -> dict[str, Any]:
    """Fig. 4: per merge, each layer of every block swapped for a specialised model's: the task-feature gain."""
    inputs = _magic_inputs(params, models, regime)
    return {m: layer_swap_gain(inputs["clip"], inputs["pretrained"], inputs["finetuned"],
                               _merged(params, models, root, m, regime), inputs["images"], task_names=inputs["tasks"])
            for m in merges}


def magic_sensitivity(params: Params, models, merges: list[str], regime: str, root: Path) -> dict[str, Any]:
    """Fig. 5: the probe of each specialised model (the pipeline's probe set, metric and candidates)."""


    inputs, probing = _magic_inputs(params, models, regime), params.probing
    images, labels = task_split(models.paths.data, "letters", "test", max_items=probing.max_samples)
    x, y = preprocessed(images, params.vision.arch), torch.as_tensor(labels, dtype=torch.long)
    batches = [(x[i:i + 256], y[i:i + 256]) for i in range(0, len(y), 256)]
    return task_sensitivity(inputs["clip"], inputs["pretrained"], inputs["finetuned"],
                            clip_probe(models.heads["letters"], batches, probing.metric), scale=probing.scale,
                            top=probing.top, key_rule=probing.key_rule, key_pattern=probing.key_pattern or r"^visual\.",
                            task_names=inputs["tasks"], seed=models.paths.seed)


def magic_xi(params: Params, models, merges: list[str], regime: str, root: Path) -> dict[str, Any]:
    """Fig. 9: FSC's xi of the middle block's MLP output per task and sample, on each merge."""
    inputs = _magic_inputs(params, models, regime)
    layer = MIDDLE_BLOCK.format(_middle(params, models, regime)) + ".mlp.c_proj"
    return {m: fsc_coefficients(inputs["clip"], inputs["pretrained"], inputs["finetuned"],
                                _merged(params, models, root, m, regime),
                                [images[:XI_SAMPLES] for images in inputs["images"]], [layer],
                                task_names=inputs["tasks"]) for m in merges}


#: analysis kind -> its function (params, the regime's models, the merges, the regime, the root) -> JSON-able data
ANALYSES: dict[str, Callable[..., dict[str, Any]]] = {
    "svc_inflation": svc_spectrum, "svc_spectrum": svc_spectrum, "svc_cross_terms": svc_cross_terms,
    "magic_projection": magic_projection, "magic_magnitude": magic_magnitude, "magic_swap": magic_swap,
    "magic_sensitivity": magic_sensitivity, "magic_xi": magic_xi, **DISTAC_ANALYSES}


def analysis_document(params: Params, root: str | Path, analyses: list) -> dict[str, Any]:
    """Every analysis's data by its id (``analyses``: ``mergecal.pipeline.experiments.Analysis``)."""
    if not params.vision.enabled:
        raise MergecalError("the papers' analyses read the vision track's models: vision.enabled is false")
    models = VisionModels(params, Path(root), params.seeds[0])
    out = {}
    for analysis in analyses:
        out[analysis.id] = {"regime": analysis.regime, "seed": params.seeds[0],
                            "data": ANALYSES[analysis.kind](params, models, analysis.merges, analysis.regime,
                                                            Path(root))}
    return rounded(out)
