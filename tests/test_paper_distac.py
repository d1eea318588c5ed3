"""The DisTaC analyses' report blocks and claim units (mergecal.reports.paper_distac) on data the library's functions
(mergecal.analysis.distac_figures) make from hand-made inputs: each claim's verdict follows its numbers."""

from __future__ import annotations

import numpy as np
import torch

from mergecal.analysis.distac_figures import (average_reliability, confidence_gap_interval, kappa_sweep_summary,
                                              layer_norm_comparison, reliability, trajectory_summary)
from mergecal.pipeline.experiments import AnalysisClaim
from mergecal.reports import paper_distac
from mergecal.reports.papers import analysis_claim_units


class Item:
    def __init__(self, item="Figure 0", merges=("none",)):
        self.item, self.merges = item, list(merges)


def _kinds(blocks):
    return [b[0] for b in blocks]


def test_norms_and_entropy_claims_count_the_tasks_on_their_side():
    data = {"tasks": ["a", "b"],
            "norms": {"a": {"standard": 1.0, "lengthened": 6.0, "ratio": 6.0, "lr_multiplier": 10.0},
                      "b": {"standard": 2.0, "lengthened": 1.0, "ratio": 0.5, "lr_multiplier": 3.0}}}
    units = analysis_claim_units(AnalysisClaim(kind="larger_norm", text="t"), ["none"], data)
    assert [u["verdict"] for u in units] == ["agrees", "disagrees"]
    blocks = paper_distac.RENDER["distac_norms"](Item(), data, "p", "standard")
    assert _kinds(blocks) == ["p", "table", "plot"]
    assert [row[1] for row in blocks[1][2]] == [["10×"], ["3×"]]  # each task's own lr multiple
    entropy = {"tasks": ["a"], "entropy": {"a": {"standard": 0.01, "low_confidence": 0.5}}}
    units = analysis_claim_units(AnalysisClaim(kind="higher_entropy", text="t"), ["none"], entropy)
    assert [u["verdict"] for u in units] == ["agrees"]


def test_trajectory_claims_compare_each_models_last_step_with_its_start():
    histories = {"a": [{"step": 0, "accuracy": 0.5, "entropy": 1.0, "tau_norm": 2.0},
                       {"step": 10, "accuracy": 0.8, "entropy": 0.2, "tau_norm": 2.1}],
                 "b": [{"step": 0, "accuracy": 0.9, "entropy": 0.1, "tau_norm": 1.0},
                       {"step": 10, "accuracy": 0.8, "entropy": 0.3, "tau_norm": 1.0}]}
    summary = trajectory_summary(histories, {"a": 1.0, "b": 1.0}, {"a": 2.0, "b": 1.0})
    data = {"norm_mismatch": summary, "low_confidence": summary}
    above = analysis_claim_units(AnalysisClaim(kind="above_start", text="t", setting="norm_mismatch"), [], data)
    falls = analysis_claim_units(AnalysisClaim(kind="entropy_falls", text="t", setting="low_confidence"), [], data)
    assert [u["verdict"] for u in above] == ["agrees", "disagrees"]
    assert [u["verdict"] for u in falls] == ["agrees", "disagrees"]
    blocks = paper_distac.RENDER["distac_trajectory"](Item(), data, "p", "standard")
    assert _kinds(blocks).count("plot") == 2 and _kinds(blocks).count("table") == 2


def test_kappa_claims_follow_the_sweep():
    kappas = [0.0, 0.5, 1.0, 1.5, 3.0]
    data = kappa_sweep_summary({"a": dict(zip(kappas, [0.3, 0.9, 0.95, 0.6, 0.1])),
                                "b": dict(zip(kappas, [0.3, 0.5, 0.95, 0.9, 0.4]))})
    below = analysis_claim_units(AnalysisClaim(kind="below_zero_shot", text="t"), [], data)
    shrink = analysis_claim_units(AnalysisClaim(kind="shrink_better", text="t"), [], data)
    assert [u["verdict"] for u in below] == ["agrees", "disagrees"]
    assert [u["verdict"] for u in shrink] == ["agrees", "disagrees"]
    assert "table" in _kinds(paper_distac.RENDER["distac_kappa"](Item(), data, "p", "standard"))


def test_reliability_claims_read_the_gap_interval_and_the_ece():
    rng = np.random.default_rng(0)
    diagrams = {}
    for name, alpha, confidence, accuracy in (("standard", 0.0, 0.95, 0.6), ("ls", 0.01, 0.8, 0.8),
                                              ("low", 0.1, 0.4, 0.9)):
        conf = [np.clip(rng.normal(confidence, 0.02, 200), 0, 1)]
        correct = [rng.random(200) < accuracy]
        diagrams[name] = {"alpha": alpha, "average": average_reliability([reliability(conf[0], correct[0])]),
                          "gap": confidence_gap_interval(conf, correct)}
    data = {"regimes": list(diagrams), "tasks": ["a"], "diagrams": diagrams}

    def verdicts(kind, setting):
        return [u["verdict"] for u in analysis_claim_units(AnalysisClaim(kind=kind, text="t", setting=setting), [],
                                                           data)]

    assert verdicts("over_confident", "standard") == ["agrees"]
    assert verdicts("under_confident", "low") == ["agrees"]
    assert verdicts("over_confident", "low") == ["disagrees"]
    assert verdicts("best_calibrated", "ls") == ["agrees"]
    assert verdicts("best_calibrated", "standard") == ["disagrees"]
    assert "plot" in _kinds(paper_distac.RENDER["distac_reliability"](Item(merges=list(diagrams)), data, "p", "s"))


def test_every_layer_claim_counts_the_keys_of_the_chosen_kind():
    keys = ["visual.transformer.resblocks.0.mlp.c_fc.weight", "visual.transformer.resblocks.0.mlp.c_fc.bias",
            "visual.transformer.resblocks.0.attn.in_proj_weight", "visual.ln_post.weight"]
    standard = [{k: torch.ones(4) for k in keys}]
    lengthened = [{k: (0.5 if k.endswith("in_proj_weight") else 3.0) * torch.ones(4) for k in keys}]
    data = layer_norm_comparison(standard, lengthened, ["a"])
    weights = analysis_claim_units(AnalysisClaim(kind="every_layer_larger", text="t"), ["weight"], data)
    biases = analysis_claim_units(AnalysisClaim(kind="every_layer_larger", text="t"), ["bias"], data)
    assert sorted(u["verdict"] for u in weights) == ["agrees", "agrees", "disagrees"]
    assert [u["verdict"] for u in biases] == ["agrees"]
    blocks = paper_distac.RENDER["distac_layer_norms"](Item(merges=["weight"]), data, "p", "standard")
    assert _kinds(blocks) == ["p", "table", "plot"]
