"""Comparisons across settings (DisTaC's tables and figures): the schema, their cells (the track's own, the papers'
regimes included) and the report's values, paired changes and claim verdicts on hand-made outcomes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mergecal.errors import MergecalError
from mergecal.pipeline.config import load_params
from mergecal.pipeline.experiments import Comparison, Experiment, load_comparisons, narrowed_params, paper_cells
from mergecal.reports.paper_comparisons import Scores, claim_verdict, comparison_section
from mergecal.reports.papers import Outcome

PARAMS = load_params(Path("params.yaml"))
BASE = {"id": "distac.x", "item": "Table 9", "shows": "s", "merges": ["task_arithmetic"],
        "settings": {"original": ["standard"], "nm": ["norm_mismatch", "norm_mismatch_objects"]},
        "reference": "original", "chains": {"merge": "{merge}", "distac": "distac>{merge}"}}


@pytest.mark.parametrize("change,message", [
    ({"reference": "nope"}, "reference 'nope' is not one of the settings"),
    ({"chains": {"distac": "distac>{merge}"}}, "the first is the merge alone"),
    ({"settings": {"original": ["standard"], "nm": ["standard"]}}, "none twice"),
    ({"claims": [{"kind": "gain", "text": "t", "chain": "distac", "than": "merge", "settings": ["x"]}]},
     "'x' is no setting"),
    ({"plot": "line"}, "takes a value"),
    ({"printed": {"task_arithmetic": {"original": 1.0}}}, "<setting>/<chain>"),
])
def test_a_bad_comparison_says_what_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        Comparison.model_validate({**BASE, **change})


def test_the_committed_comparisons_load_and_their_cells_are_the_tracks():
    found = load_comparisons()["distac"]
    assert [c.id for c in found] == ["distac.tab1", "distac.tab2", "distac.fig1a", "distac.fig4b", "distac.fig8"]
    tab1 = found[0]
    assert len(tab1.settings["norm_mismatch"]) == len(PARAMS.vision.tasks)  # each task lengthened in turn
    _, listed = paper_cells(PARAMS, ".", papers=("distac",))
    mine = [e for e in listed if e.experiment == "distac.tab1"]
    assert {e.cell.regime for e in mine} == set(tab1.regimes)
    # the references, the multi-task one in the standard regime of the vision track (its ceiling row)
    assert {e.variant for e in mine} == {"base", "distac", "zeroshot", "finetuned", "multitask"}
    assert {e.cell.regime for e in mine if e.variant == "multitask"} == {"standard"}
    rescaled = [e.cell for e in listed if e.experiment == "distac.fig8" and e.variant == "rescale"]
    assert rescaled and all(c.chain == "rescale>{merge}" for c in rescaled)


def test_a_papers_regime_may_not_take_a_chain_that_reads_the_probe():
    experiment = Experiment(id="distac.y", item="i", shows="s", regimes=["mixup"], merges=["task_arithmetic"],
                            variants={"wsc": "{merge}>wsc"})
    with pytest.raises(MergecalError, match="reads the probe, which the papers' regime 'mixup' does not run"):
        narrowed_params(PARAMS, experiment)
    with pytest.raises(MergecalError, match="neither|not among"):
        narrowed_params(PARAMS, experiment.model_copy(update={"regimes": ["focal_typo"], "variants": {}}))


def _outcome(per_task: list[list[float]], tasks=("a", "b")) -> Outcome:
    examples = dict(zip(tasks, per_task))
    return Outcome({"avg_norm_acc": 0.0}, examples)


def _scores() -> Scores:
    ones, halves, zeros = [1.0] * 4, [1.0, 1.0, 0.0, 0.0], [0.0] * 4
    outcomes = {("standard", "ta", "merge"): _outcome([ones, ones]),
                ("nm1", "ta", "merge"): _outcome([halves, ones]),
                ("nm2", "ta", "merge"): _outcome([zeros, halves]),
                ("nm1", "ta", "distac"): _outcome([ones, ones]),
                ("nm2", "ta", "distac"): _outcome([ones, ones])}
    finetuned = {r: {"acc.a": 1.0, "acc.b": 1.0} for r in ("standard", "nm1")} | {"nm2": {"acc.a": 0.5, "acc.b": 1.0}}
    return Scores(("a", "b"), outcomes, finetuned)


def test_a_setting_of_several_regimes_is_their_mean_normalized_by_each_regimes_own_fine_tunes():
    scores = _scores()
    # nm1: a 0.5, b 1.0; nm2: a 0 / 0.5 = 0, b 0.5 -> the mean setting: a 0.25, b 0.75 -> 50 %
    value, interval = scores.value(["nm1", "nm2"], "ta", "merge")
    assert value == 50.0 and interval[0] <= 50.0 <= interval[1]
    assert scores.value(["standard"], "ta", "merge") == (100.0, [100.0, 100.0])
    low, high = scores.change((["nm1", "nm2"], "ta", "merge"), (["standard"], "ta", "merge"))
    assert high < 0  # every example at or below the reference's
    assert scores.value(["nm1"], "ta", "rescale") == (None, None)  # no such cell: no value, never an error


def test_claim_verdicts_gain_loss_and_par():
    assert claim_verdict("gain", [0.1, 2.0]) == "agrees" and claim_verdict("loss", [0.1, 2.0]) == "disagrees"
    assert claim_verdict("gain", [-1.0, 2.0]) == "inconclusive"
    assert claim_verdict("par", [-1.0, 2.0]) == "agrees" and claim_verdict("par", [-3.0, -1.0]) == "disagrees"
    assert claim_verdict("par", None) is None


def test_a_comparison_section_counts_its_claims_from_the_intervals():
    comparison = Comparison.model_validate({
        **BASE, "merges": ["ta"], "settings": {"original": ["standard"], "nm": ["nm1", "nm2"]},
        "claims": [{"kind": "loss", "text": "it degrades", "chain": "merge", "than": "merge",
                    "than_setting": "original"},
                   {"kind": "par", "text": "distac restores", "chain": "distac", "than": "merge",
                    "than_setting": "original"}],
        "plot": "members"})
    blocks, document = comparison_section(comparison, {0: _scores()}, "distac-x")
    first, second = document["claims"]
    assert first["counts"] == {"agrees": 1, "disagrees": 0, "inconclusive": 0}
    assert second["counts"] == {"agrees": 1, "disagrees": 0, "inconclusive": 0}  # 100 % against 100 %: par
    assert "not below the reference" in second["sentence"]
    tables = [b for b in blocks if b[0] == "table"]
    assert tables[0][1] == ["merge", "chain", "original", "nm"]
    assert tables[1][1] == ["merge", "chain", "`nm1`", "`nm2`"]  # the mean's members, each shown
    assert any(b[0] == "plot" for b in blocks)
    assert document["seeds"][0]["rows"]["ta/merge"]["nm"]["value"] == 50.0
    assert np.isclose(document["seeds"][0]["members"]["nm/ta/merge"]["nm1"]["value"], 75.0)


def test_the_reference_setting_shows_its_reference_rows_with_intervals():
    """The multi-task model (and zero-shot, fine-tuned) under a comparison's table: normalized by the reference
    setting's fine-tunes, in the JSON too; a reference row no regime of the setting has is left out."""
    comparison = Comparison.model_validate({**BASE, "merges": ["ta"], "settings": {"original": ["standard"],
                                                                                  "nm": ["nm1", "nm2"]}})
    scores = _scores()
    scores.references = {("standard", "finetuned"): _outcome([[1.0] * 4, [1.0] * 4]),
                         ("standard", "multitask"): _outcome([[1.0, 1.0, 1.0, 0.0], [1.0] * 4])}
    assert scores.reference_value(["standard"], "multitask")[0] == 87.5
    assert scores.reference_value(["nm1"], "multitask") == (None, None)
    blocks, document = comparison_section(comparison, {0: scores}, "distac-x")
    shown = [b[1] for b in blocks if b[0] == "p" and b[1].startswith("References in `original`")]
    assert len(shown) == 1 and "`multitask` (one model fine-tuned on all tasks at once" in shown[0]
    assert "87.5 [" in shown[0] and "`finetuned` (the fine-tuned models, each on its own task) 100.0" in shown[0]
    assert "zeroshot" not in shown[0]
    references = document["seeds"][0]["references"]
    assert set(references) == {"finetuned", "multitask"} and references["multitask"]["value"] == 87.5
    scores.references = {}
    blocks, document = comparison_section(comparison, {0: scores}, "distac-x")
    assert not any(b[0] == "p" and b[1].startswith("References") for b in blocks)
