"""The papers' analysis figures on the testbed's models: what ``stages/paper_analysis.py`` computes for the
analyses of ``mergecal/experiments/<paper>.yaml`` (``analyses:``), from the vision track's files of its first
fine-tuning seed and the standard regime.

Each analysis is a function of the models alone (no sampling of test examples): ``svc_spectrum`` the SVC paper's
Figs. 2/4 and 3 (``mergecal.analysis.svc_spectrum``) for each merge it names. The document is rounded to six
significant digits, so it is stable to read and compare."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import MergecalError
from .config import Params

DIGITS = 6


def rounded(value: Any) -> Any:
    """``value`` with every float rounded to ``DIGITS`` significant digits (None, ints and strings unchanged)."""
    if isinstance(value, float):
        return float(f"{value:.{DIGITS}g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v) for v in value]
    return value


def merge_settings(params: Params, merge: str) -> dict[str, Any]:
    """The matrix's settings of ``merge`` without its scaling (the analyses read every merge at scaling 1)."""
    if merge not in params.benchmark.merges:
        raise MergecalError(f"analysis: merge {merge!r} is not in params.yaml's benchmark.merges")
    return {k: v for k, v in (params.benchmark.merges[merge] or {}).items() if k != "scaling"}


def _svc_figure_data(params: Params, models, merge: str, regime: str) -> dict[str, Any]:
    """Figs. 2/4 and 3 share one computation per merge (``figure_data``: the spectra and the cross terms), kept on
    the models' loader for the document's other analyses."""
    from ..analysis.svc_spectrum import figure_data
    from ..task_vectors import TaskVectorSet

    cache = models.__dict__.setdefault("svc_figure_data", {})
    if (merge, regime) not in cache:
        tvs = TaskVectorSet.from_models(models.visual_pretrained(), models.finetuned(regime),
                                        names=list(params.vision.tasks))
        cache[(merge, regime)] = figure_data(tvs, merge, method_params=merge_settings(params, merge), top=3)
    return cache[(merge, regime)]


def svc_spectrum(params: Params, models, merges: list[str], regime: str) -> dict[str, Any]:
    """Per merge and key class: sigma, sigma* and gamma sigma per subspace r (the class means)."""
    return {merge: {"alpha": (data := _svc_figure_data(params, models, merge, regime))["alpha"],
                    "classes": {name: {"keys": len(c["keys"]), "shape": c["shape"], "spectrum": c["spectrum"]}
                                for name, c in data["classes"].items()}} for merge in merges}


def svc_cross_terms(params: Params, models, merges: list[str], regime: str) -> dict[str, Any]:
    """Per merge and key class: the K x K cross terms of the top subspaces, each divided by sigma_r^2."""
    return {merge: {"tasks": (data := _svc_figure_data(params, models, merge, regime))["tasks"],
                    "classes": {name: {"keys": len(c["keys"]), "cross_terms": c["cross_terms"]}
                                for name, c in data["classes"].items()}} for merge in merges}


#: analysis kind -> its function (params, the regime's models, the merges, the regime) -> JSON-able data
ANALYSES: dict[str, Callable[..., dict[str, Any]]] = {"svc_spectrum": svc_spectrum, "svc_cross_terms": svc_cross_terms}


def analysis_document(params: Params, root: str | Path, analyses: list) -> dict[str, Any]:
    """Every analysis's data by its id (``analyses``: ``mergecal.pipeline.experiments.Analysis``)."""
    from .tracks.clip.built.stages import VisionModels

    if not params.vision.enabled:
        raise MergecalError("the papers' analyses read the vision track's models: vision.enabled is false")
    models = VisionModels(params, Path(root), params.seeds[0])
    out = {}
    for analysis in analyses:
        out[analysis.id] = {"regime": analysis.regime, "seed": params.seeds[0],
                            "data": ANALYSES[analysis.kind](params, models, analysis.merges, analysis.regime)}
    return rounded(out)
