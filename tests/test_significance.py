"""MAGIC's all-subsets significance test (mergecal.analysis.significance): the subsets, the paired t-test against a
hand computation, the summary, and one-line errors on bad input."""

from __future__ import annotations

import math

import pytest

from mergecal.analysis.significance import paired_t_test, subset_count, subsets, summary
from mergecal.errors import ParameterError

EIGHT = ["objects", "digits", "numerals", "symbols", "arrows", "greek", "dots", "patterns"]


def test_every_subset_of_at_least_two_of_eight_experts_is_listed_once_smallest_first():
    found = subsets(EIGHT)
    assert len(found) == len(set(found)) == subset_count(8) == 247  # MAGIC's 255 less the 8 single experts
    assert subset_count(8, min_size=1) == len(subsets(EIGHT, min_size=1)) == 255
    assert found[0] == ("objects", "digits") and found[-1] == tuple(EIGHT)
    assert [len(s) for s in found] == sorted(len(s) for s in found)
    assert all(list(s) == [n for n in EIGHT if n in s] for s in found)  # each in the experts' order
    assert subsets(["a", "b", "c"]) == [("a", "b"), ("a", "c"), ("b", "c"), ("a", "b", "c")]


def test_the_paired_t_test_is_the_hand_computation():
    # differences 1, 2, 3: mean 2, sd 1, t = 2 / (1 / sqrt 3) = 2 sqrt 3; with 2 degrees of freedom the t
    # distribution's CDF is 1/2 + t / (2 sqrt(2 + t^2)), so the two-sided p is 1 - t / sqrt(2 + t^2)
    found = paired_t_test([11.0, 12.0, 13.0], [10.0, 10.0, 10.0])
    t = 2 * math.sqrt(3)
    assert found["n"] == 3 and found["df"] == 2 and found["mean_difference"] == pytest.approx(2.0)
    assert found["sd_difference"] == pytest.approx(1.0)
    assert found["t"] == pytest.approx(t, rel=1e-12)
    assert found["p"] == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-9)
    # one degree of freedom (Cauchy): differences 2, 3 give t = 2.5 / 0.5 = 5, p = 1 - (2 / pi) atan 5
    found = paired_t_test([3.0, 5.0], [1.0, 2.0])
    assert found["t"] == pytest.approx(5.0, rel=1e-12)
    assert found["p"] == pytest.approx(1 - 2 / math.pi * math.atan(5.0), rel=1e-9)
    # the sign follows the calibration: worse everywhere gives a negative t, the same p
    assert paired_t_test([1.0, 2.0], [3.0, 5.0])["t"] == pytest.approx(-5.0, rel=1e-12)


def test_a_t_as_large_as_magics_keeps_its_tiny_p():
    base = [70.0 + (i % 7) for i in range(255)]
    calibrated = [b + 8.0 + 0.25 * ((i * 37) % 11 - 5) for i, b in enumerate(base)]
    found = paired_t_test(calibrated, base)
    assert found["t"] > 100 and 0 < found["p"] < 1e-200  # no underflow to 0 at MAGIC's scale (p = 1.5e-89)


def test_differences_without_spread_have_no_t():
    found = paired_t_test([2.0, 3.0, 4.0], [1.0, 2.0, 3.0])
    assert found["t"] is None and found["p"] is None and found["sd_difference"] == 0.0


def test_the_summary_counts_the_subsets_improved_worse_and_equal():
    found = summary([5.0, 4.0, 3.0, 2.0], [4.0, 4.0, 4.0, 1.0])
    assert (found["improved"], found["worse"], found["equal"]) == (2, 1, 1)
    assert (found["improved_share"], found["worse_share"], found["equal_share"]) == (0.5, 0.25, 0.25)
    assert found["mean_base"] == 3.25 and found["mean_calibrated"] == 3.5 and found["mean_difference"] == 0.25


@pytest.mark.parametrize("call, message", [
    (lambda: subsets(["a"]), "1 expert(s), fewer than min_size 2"),
    (lambda: subsets(["a", "a", "b"]), "the names repeat one"),
    (lambda: subsets(["a", "b"], min_size=0), "min_size 0: expected an integer >= 1"),
    (lambda: subset_count(1), "K = 1 and min_size 2"),
    (lambda: paired_t_test([1.0, 2.0], [1.0]), "2 calibrated values against 1 base values"),
    (lambda: paired_t_test([1.0], [0.0]), "1 pair(s); expected at least 2"),
    (lambda: paired_t_test([1.0, float("nan")], [0.0, 0.0]), "calibrated holds nan; expected finite numbers"),
    (lambda: summary([1.0, 2.0], [0.0, "1"]), "base holds '1'; expected finite numbers"),
])
def test_bad_input_is_one_line_naming_what_was_expected(call, message):
    with pytest.raises(ParameterError) as err:
        call()
    assert message in str(err.value) and "\n" not in str(err.value)


# ------------------------------------------------------------------------ the stage's cells and the report section

def test_each_subset_runs_the_boards_own_cells_and_the_full_set_is_the_boards_cell():
    """The significance tests' cells are the vision track's own (no copy of its code): for the full set of experts
    they are the default matrix's fixed-scaling cells (the same Cell, so the same id; DisTaC's at λ 0.3 is the
    papers' profile's only), for a subset the same cells on its tasks."""
    from mergecal.pipeline.cells import enumerate_cells
    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.paper_significance import load_significance, narrowed_for, subset_cells, subset_params

    params = load_params("params.yaml")
    params = params.model_copy(update={"seeds": params.seeds[:1]})
    matrix = set(enumerate_cells(params))
    tests = {t.id: t for found in load_significance().values() for t in found}
    assert {"magic.significance", "svc.significance", "distac.significance_norm_mismatch",
            "distac.significance_low_confidence"} <= tests.keys()
    for test in tests.values():
        narrowed = narrowed_for(params, test)
        base, calibrated = subset_cells(subset_params(narrowed, test, tuple(params.vision.tasks)), test)
        assert base in matrix and (calibrated in matrix) != test.calibrated.startswith("distac>"), test.id
        assert base.regime == calibrated.regime == test.regime
        assert (base.label, calibrated.label) == test.chains and base.grid == calibrated.grid == ()
        pair = subset_cells(subset_params(narrowed, test, ("digits", "greek")), test)
        assert [c.tasks for c in pair] == [("digits", "greek")] * 2
        assert [c.recipe for c in pair] == [base.recipe, calibrated.recipe]


def _entry(rows: list[tuple[list[str], float, float, list[float]]]) -> dict:
    subsets_ = [{"tasks": t, "base": b, "calibrated": c, "interval": i} for t, b, c, i in rows]
    return {"track": "vision", "regime": "standard", "seed": 0, "merge": "task_arithmetic", "scaling": 0.3,
            "base": "task_arithmetic(scaling=0.3)", "calibrated": "task_arithmetic(scaling=0.3)>dsc",
            "tasks": ["a", "b", "c"], "min_size": 2, "value": "average accuracy over the subset's tasks (%)",
            "subsets": subsets_, "summary": summary([r[2] for r in rows], [r[1] for r in rows])}


def test_the_report_section_counts_subsets_by_their_paired_interval_and_words_the_t_test():
    from mergecal.pipeline.paper_significance import SignificanceTest
    from mergecal.reports import papers as reports

    test = SignificanceTest.model_validate({
        "id": "magic.significance", "item": "Significance test (text)", "shows": "TA against TA w/ DSC",
        "merge": "task_arithmetic", "scaling": 0.3, "calibrated": "{merge}>dsc", "printed_where": "the text",
        "printed": {"t": 31.4, "p": 1.5e-89, "subsets": 255},
        "claims": [{"kind": "subsets", "text": "it improves the subsets"},
                   {"kind": "t_test", "text": "significantly"}]})
    entry = _entry([(["a", "b"], 80.0, 84.0, [1.5, 6.5]), (["a", "c"], 70.0, 74.0, [-0.5, 8.5]),
                    (["b", "c"], 60.0, 66.0, [3.0, 9.0]), (["a", "b", "c"], 50.0, 58.0, [5.0, 11.0])])
    pages = []
    for _ in range(2):
        blocks, document = reports.significance_section(test, entry, "magic.significance")
        page = reports.paper_blocks("T", "0000.00000", [blocks])
        pages.append((reports.to_markdown(page), reports.to_json(document)))
    assert pages[0] == pages[1]  # the same data, the same bytes
    markdown, _ = pages[0]
    assert "## magic.significance: Significance test (text)" in markdown
    assert "“it improves the subsets”: the testbed agrees in direction — 3 of 4 subsets agree" in markdown
    assert "0 disagree, 1 inside the noise." in markdown
    found = summary([84.0, 74.0, 66.0, 58.0], [80.0, 70.0, 60.0, 50.0])
    assert found["p"] < 0.05 and f"t = {found['t']:.2f}, p = {found['p']:.2g} over 4 subsets" in markdown
    assert "“significantly”: the testbed agrees in direction — 1 of 1 paired t-tests over the subsets agree" in \
        markdown
    assert "| 4 | 65.0 | 70.5 | +5.50 |" in markdown and "| 4 (100%) | 0 (0%) | 0 |" in markdown
    assert "| 2 | 3 | 70.0 | 74.7 | +4.67 | 3 | 0 |" in markdown  # per number of experts merged
    assert "t = 31.4, p = 1.5e-89, subsets = 255" in markdown and "plots/magic.significance.svg" in markdown
    assert document["claims"][0]["counts"] == {"agrees": 3, "disagrees": 0, "inconclusive": 1}


def test_a_malformed_significance_entry_is_one_line(monkeypatch):
    from mergecal.errors import MergecalError
    from mergecal.pipeline import experiments
    from mergecal.pipeline import paper_significance as ps
    from mergecal.reports import papers as reports

    good = {"id": "magic.significance", "item": "x", "shows": "x", "merge": "task_arithmetic", "scaling": 0.3,
            "calibrated": "{merge}>dsc"}
    for bad, message in (({"printed": {"z": 1.0}}, "printed: 'z' is none of t, p, subsets"),
                         ({"calibrated": "{merge}>nope"}, "nope"), ({"scaling": 0.0}, "scaling")):
        monkeypatch.setattr(experiments, "read", lambda paper, bad=bad: {"significance": [{**good, **bad}]})
        with pytest.raises(MergecalError) as err:
            ps.load_significance(("magic",))
        assert str(err.value).startswith("mergecal/experiments/magic.yaml: magic.significance: ")
        assert message in str(err.value) and "\n" not in str(err.value)
    test = ps.SignificanceTest.model_validate(good)
    with pytest.raises(MergecalError, match="significance.json: magic.significance: not a significance test's data"):
        reports.significance_section(test, {"seed": 0, "subsets": []}, "p")


def test_a_norm_mismatch_test_compares_only_the_subsets_holding_the_lengthened_task():
    """DisTaC conditions the lengthened task alone under the norm mismatch: a subset without it merges the same
    model twice, so ``with_lengthened`` keeps the 2^7 - 1 subsets that hold it; elsewhere it is refused."""
    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.paper_significance import SignificanceTest

    params = load_params("params.yaml")
    good = {"id": "distac.x", "item": "x", "shows": "x", "merge": "task_arithmetic", "scaling": 0.3,
            "calibrated": "distac>{merge}", "regime": "norm_mismatch", "with_lengthened": True}
    test = SignificanceTest.model_validate(good)
    found = test.subsets(params)
    lengthened = params.vision.norm_mismatch_task
    assert test.includes(params) == [lengthened] and len(found) == 2 ** 7 - 1
    assert all(lengthened in s for s in found) and len(set(found)) == len(found)
    other = SignificanceTest.model_validate({**good, "regime": "norm_mismatch_digits"})
    assert other.includes(params) == ["digits"] and all("digits" in s for s in other.subsets(params))
    everything = SignificanceTest.model_validate({**good, "with_lengthened": False})
    assert everything.includes(params) == [] and len(everything.subsets(params)) == 247
    with pytest.raises(ValueError, match="with_lengthened: regime 'low_confidence' lengthens no task"):
        SignificanceTest.model_validate({**good, "regime": "low_confidence"})


def test_the_report_says_which_task_every_subset_holds():
    from mergecal.pipeline.paper_significance import SignificanceTest
    from mergecal.reports import papers as reports

    test = SignificanceTest.model_validate({
        "id": "distac.x", "item": "x", "shows": "x", "merge": "task_arithmetic", "scaling": 0.3,
        "calibrated": "distac>{merge}", "regime": "norm_mismatch", "with_lengthened": True})
    entry = {**_entry([(["a", "b"], 80.0, 84.0, [1.5, 6.5]), (["a", "b", "c"], 70.0, 74.0, [-0.5, 8.5])]),
             "regime": "norm_mismatch", "includes": ["a"]}
    blocks, _ = reports.significance_section(test, entry, "distac.x")
    text = reports.to_markdown(reports.paper_blocks("T", "0000.00000", [blocks]))
    assert "every subset of at least 2 of its 3 experts, each holding `a` (the lengthened task) (2 subsets)" in text
    blocks, _ = reports.significance_section(test, {**entry, "includes": []}, "distac.x")
    assert "experts (2 subsets)" in reports.to_markdown(reports.paper_blocks("T", "0000.00000", [blocks]))
