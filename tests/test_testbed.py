"""The vision testbed's health criteria (mergecal/pipeline/testbed.py) on hand-written stage outputs: no model
is built or evaluated (the norm-mismatch regime, which evaluates a merge, is left out of these params)."""

import json

import pytest

from mergecal.pipeline.config import parse_params
from mergecal.pipeline.testbed import health_markdown, vision_health
from mergecal.pipeline.tracks.clip.built.stages import paths_for

TASKS = ["objects", "digits"]


def _testbed(root, standard_entropy=0.1, low_entropy=0.36):
    """A vision track with the standard and low-confidence regimes, its pretraining and task-vector outputs."""
    regimes = ["standard", "low_confidence"]
    params = parse_params({"vision": {"task_set": "headroom8", "tasks": TASKS, "regimes": regimes,
                                      "finetune_variants": regimes}})
    paths = paths_for(params, root)
    paths.models.mkdir(parents=True)
    zeroshot = {t: {"test": {"accuracy": 0.5}} for t in TASKS}
    (paths.models / "pretrained.json").write_text(json.dumps({"zeroshot": zeroshot}))
    for regime, entropy in (("standard", standard_entropy), ("low_confidence", low_entropy)):
        paths.task_vectors(regime).mkdir(parents=True)
        diagnostics = {t: {"norm": 1.0, "relative_norms": {"all": 0.1}, "entropy": entropy, "test_accuracy": 0.98}
                       for t in TASKS}
        (paths.task_vectors(regime) / "diagnostics.json").write_text(json.dumps(diagnostics))
    return params


def _results(standard_norm_acc, low_confidence_norm_acc):
    return {"rows": [{"track": "vision", "regime": "standard", "label": "task_arithmetic", "avg_acc": 0.7,
                      "avg_norm_acc": standard_norm_acc, "selected_scaling": 0.3},
                     {"track": "vision", "regime": "low_confidence", "label": "task_arithmetic", "avg_acc": 0.66,
                      "avg_norm_acc": low_confidence_norm_acc, "selected_scaling": 0.3}]}


@pytest.mark.parametrize("low_confidence_norm_acc, holds", [(0.66, True), (0.68, False)])
def test_the_low_confidence_regime_must_cost_task_arithmetic_3_normalized_points(tmp_path, low_confidence_norm_acc,
                                                                                  holds):
    """Regression: the criterion is the regime's cost to task arithmetic (standard minus low-confidence normalized
    accuracy, >= 3 points; 3.5 on the default), no longer the entropy ratio (>= 10x, never met: 3.6x)."""
    health = vision_health(_testbed(tmp_path), tmp_path, _results(0.70, low_confidence_norm_acc))
    check = {c["key"]: c for c in health["criteria"]}["low_confidence_loss"]
    assert check["value"] == pytest.approx(70.0 - 100 * low_confidence_norm_acc)
    assert (check["threshold"], check["direction"], check["holds"]) == (3.0, ">=", holds)
    assert "low_confidence_entropy_ratio" not in {c["key"] for c in health["criteria"]}
    assert health["regimes"]["low_confidence"]["entropy_ratio"] == pytest.approx(3.6)  # reported, not judged
    assert "ratio 3.6" in health_markdown(health)


def test_without_a_low_confidence_task_arithmetic_row_the_criterion_is_not_measured(tmp_path):
    results = _results(0.70, 0.66)
    results["rows"] = results["rows"][:1]
    check = {c["key"]: c for c in vision_health(_testbed(tmp_path), tmp_path, results)["criteria"]}
    assert (check["low_confidence_loss"]["value"], check["low_confidence_loss"]["holds"]) == (None, None)
