"""The training-time stability diagnostic (mergecal/pipeline/refit_stability.py, issue #30): which fine-tune is
refit, which rows are re-measured, the verdict on a constructed regime whose refit flips examples against one that
does not, and the warning under the unstable regime's tables only. The refit itself on built models:
tests/test_pipeline.py."""

import json

import pytest
import torch

from mergecal.errors import MergecalError
from mergecal.pipeline.refit_stability import (largest_task_vector, other_threads, recorded, regime_stability,
                                               regime_rows)
from mergecal.reports.stability import section_markdown, stability_markdown, table_warning


def test_the_refit_trains_at_another_thread_count():
    assert other_threads(2) == 1 and other_threads(16) == 1 and other_threads(1) == 2


def test_each_track_refits_at_a_count_it_does_not_train_at():
    """Regression (#43): the vision fine-tunes moved to one thread each, and a refit at other_threads(threads=2)
    = 1 was their own bits, so every vision regime read as stable. The refit count follows each track's own."""
    from mergecal.pipeline.config import parse_params
    from mergecal.pipeline.tracks.causal_lm.built import diagnostics as llm
    from mergecal.pipeline.tracks.clip.built import diagnostics as vision
    from mergecal.pipeline.tracks.text.built import diagnostics as text

    params = parse_params({"threads": 2})
    assert other_threads(vision.training_threads(params, "cpu")) == 2
    assert other_threads(text.training_threads(params, "cpu")) == 1
    assert other_threads(llm.training_threads(params, "cpu")) == 1


def test_the_refit_model_is_the_one_furthest_from_the_pretrained_weights():
    pretrained = {"a": torch.zeros(3), "b": torch.ones(2)}
    finetuned = {("x", "standard"): {"a": torch.tensor([1.0, 1.0, 1.0]), "b": torch.ones(2)},  # norm sqrt(3)
                 ("y", "norm_mismatch"): {"a": torch.zeros(3), "b": torch.tensor([3.0, 1.0])},  # norm 2
                 ("z", "standard"): {"a": torch.tensor([0.0, 1.5, 0.0]), "b": torch.ones(2)}}  # norm 1.5
    assert largest_task_vector(pretrained, finetuned) == ("y", "norm_mismatch")


def test_a_missing_or_malformed_training_record_is_refused_in_one_line(tmp_path):
    record = tmp_path / "digits.json"
    with pytest.raises(MergecalError, match=r"digits.json: expected the fine-tune's record with its "
                                            r"`hyperparameters` \(FileNotFoundError\); run its fine-tuning stage"):
        recorded(record, "hyperparameters")
    record.write_text(json.dumps({"hyperparameters": [1, 2]}))
    with pytest.raises(MergecalError, match="digits.json: expected `hyperparameters` to be a mapping"):
        recorded(record, "hyperparameters")
    record.write_text(json.dumps({"hyperparameters": {"lr": 0.001}}))
    assert recorded(record, "hyperparameters") == {"lr": 0.001}


def test_the_rows_are_the_regimes_uncalibrated_task_arithmetic_rows_of_the_seed():
    def row(label, regime="norm_mismatch", seed=0, merge="task_arithmetic", scaling=0.3, track="vision"):
        return {"track": track, "regime": regime, "seed": seed, "merge": merge, "label": label,
                "selected_scaling": scaling}

    results = {"rows": [row("task_arithmetic", scaling=0.05), row("task_arithmetic(scaling=1.0)", scaling=1.0),
                        row("task_arithmetic(scaling=0.3)"), row("task_arithmetic>svc"),
                        row("task_arithmetic(scaling=0.3)>wsc"), row("distac>task_arithmetic", merge="task_arithmetic"),
                        row("task_arithmetic", regime="standard"), row("task_arithmetic", seed=1),
                        row("ties", merge="ties"), row("task_arithmetic", track="text"),
                        {**row("task_arithmetic(scaling=0.5)"), "selected_scaling": None}]}
    assert regime_rows(results, "vision", "norm_mismatch", 0) == [
        ("task_arithmetic", 0.05), ("task_arithmetic(scaling=0.3)", 0.3),
        ("task_arithmetic(scaling=1.0)", 1.0)]
    assert regime_rows(results, "vision", "low_confidence", 0) == []
    assert regime_rows(results, "text", "norm_mismatch", 0) == [("task_arithmetic", 0.3)]


def _scorer(flips_per_point: int):
    """A fake regime's merge at a scaling: 400 examples per task, the first 200 correct, of which
    ``flips_per_point`` x scaling x 10 are wrong instead."""
    def score(scaling):
        flipped = int(round(flips_per_point * scaling * 10))
        outcome = [0.0] * flipped + [1.0] * (200 - flipped) + [0.0] * 200
        return {"a": list(outcome), "b": list(outcome)}

    return score


def test_a_regime_is_unstable_when_a_refit_moves_a_row_beyond_its_interval():
    rows = [("task_arithmetic", 0.1), ("task_arithmetic(scaling=1.0)", 1.0)]
    # the refit flips 40 of 400 examples per task at scaling 1.0: a 10-point move against a half-width of about 5
    shaky = regime_stability(_scorer(0), _scorer(4), rows)
    assert [r["largest_avg_move"] for r in shaky["rows"]] == [1.0, 10.0]
    assert [r["stable"] for r in shaky["rows"]] == [True, False] and shaky["stable"] is False
    assert shaky["worst_row"]["label"] == "task_arithmetic(scaling=1.0)" and shaky["worst_row"]["move"] == 10.0
    assert 3.0 < shaky["worst_row"]["half_width"] < 7.0
    calm = regime_stability(_scorer(0), _scorer(0), rows)
    assert calm["stable"] is True and calm["largest_avg_move"] == 0.0


def test_a_bit_identical_refit_scores_each_row_once_and_moves_nothing():
    calls = []

    def stored(scaling):
        calls.append(scaling)
        return _scorer(2)(scaling)

    same = regime_stability(stored, None, [("task_arithmetic", 0.3), ("task_arithmetic(scaling=1.0)", 1.0)])
    assert calls == [0.3, 1.0] and same["stable"] is True and same["largest_avg_move"] == 0.0
    assert [r["avg_acc"] for r in same["rows"]] == [48.5, 45.0]


def _document():
    row = {"label": "task_arithmetic(scaling=0.3)", "scaling": 0.3, "avg_acc": 37.4, "half_width": 1.9,
           "largest_avg_move": 4.2, "changed_fraction": 0.05, "stable": False}
    base = {"track": "vision", "backbone": "clip-small", "task_set": "headroom8", "recipe": "task_arithmetic",
            "threads": 2, "refit_threads": 1}
    unstable = {**base, "regime": "norm_mismatch", "refit": {"task": "symbols", "variant": "norm_mismatch",
                                                             "identical": False},
                "rows": [row], "largest_avg_move": 4.2, "stable": False,
                "worst_row": {"label": row["label"], "move": 4.2, "half_width": 1.9}}
    stable = {**base, "regime": "standard", "refit": {"task": "digits", "variant": "standard", "identical": True},
              "rows": [{**row, "largest_avg_move": 0.0, "changed_fraction": 0.0, "stable": True}],
              "largest_avg_move": 0.0, "stable": True,
              "worst_row": {"label": row["label"], "move": 0.0, "half_width": 1.9}}
    stable["rows"].append({**stable["rows"][0], "label": "task_arithmetic", "scaling": 0.1})
    missing = {**base, "regime": "low_confidence", "stable": None, "not_measured": "no row"}
    return {"relative_size": 1e-6, "seeds": [0, 1, 2], "tracks": [], "refits": [unstable, stable, missing]}


def test_an_unstable_regime_warns_under_its_own_tables_only_and_the_reports_say_why():
    document = _document()
    warning = table_warning(document, "clip-small", "headroom8", "norm_mismatch")
    assert warning.startswith("Refit at 1 thread(s) instead of 2, this regime's symbols (norm_mismatch) fine-tune "
                              "moves its task_arithmetic(scaling=0.3) row by 4.2 points, more than its interval (±1.9)")
    assert table_warning(document, "clip-small", "headroom8", "standard") == ""
    assert table_warning(document, "clip-small", "headroom8", "low_confidence") == ""
    assert table_warning(document, "minilm", "text4", "norm_mismatch") == ""
    section = section_markdown(document)
    assert "vision (clip-small · headroom8) · norm_mismatch: symbols (norm_mismatch) refit; rows move by " \
           "task_arithmetic(scaling=0.3) 4.2 of ±1.9 points: UNSTABLE" in section
    assert "standard: digits (standard) refit; the refit is bit-identical; rows move by " \
           "task_arithmetic(scaling=0.3) 0.0 of ±1.9, task_arithmetic (chosen scaling 0.1) 0.0 of ±1.9 points: " \
           "stable" in section
    assert "low_confidence: not measured (no row)" in section
    table = stability_markdown(document)
    assert "| vision | norm_mismatch | symbols (norm_mismatch) | no | task_arithmetic(scaling=0.3) | 0.3 | 37.4 | " \
           "1.90 | 4.20 | 5.00 | UNSTABLE |" in table
    # a document written before the refit diagnostic renders as before
    old = {k: v for k, v in document.items() if k != "refits"}
    assert "Training:" not in section_markdown(old) and table_warning(old, "clip-small", "headroom8",
                                                                      "norm_mismatch") == ""
