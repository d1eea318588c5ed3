"""The leaderboard's opening summary (#62): each calibration's verdicts across the merges it calibrates, the median
change with its joint-bootstrap interval, and the headline claims computed from the verdicts."""

import json

import numpy as np
import pandas as pd
import pytest

from mergecal.intervals import N_RESAMPLES, SEED
from mergecal.reports.leaderboard import build_tables, table_html, table_markdown
from mergecal.reports.summary import heading_anchor, markdown, summarize, to_html, to_json

TASKS = ("a", "b")
N = 200


def _ones(k: int, shift: int = 0) -> list[int]:
    """N outcomes, k of them correct, starting at ``shift`` (so two rows differ on chosen examples)."""
    return [1 if shift <= i < shift + k else 0 for i in range(N)]


BASE = {"a": _ones(100), "b": _ones(100)}
# recipe -> (merge, calibration, {task: examples}); the changes of avg_acc against the base (all bases alike):
ROWS = {
    "finetuned": ("finetuned", "none", {"a": _ones(190), "b": _ones(180)}),
    "task_arithmetic": ("task_arithmetic", "none", BASE),
    "task_arithmetic>svc": ("task_arithmetic", "svc", {"a": _ones(140), "b": _ones(100)}),  # +10.0, a gain
    "ties": ("ties", "none", BASE),
    "ties>svc": ("ties", "svc", {"a": _ones(102), "b": _ones(100)}),  # +0.5, inside the noise
    "tsv_m": ("tsv_m", "none", BASE),
    "tsv_m>svc": ("tsv_m", "svc", {"a": _ones(100), "b": _ones(70)}),  # -7.5, a loss
    "tsv_m>wsc": ("tsv_m", "wsc", {"a": _ones(100), "b": _ones(100, shift=10)}),  # 0.0, but 20 examples swap
    "iso_c": ("iso_c", "none", BASE),
    "iso_c>svc": ("iso_c", "svc", {"a": _ones(190), "b": _ones(100)}),  # ill-posed: left out
}


def _table(rows=ROWS, without_examples=()):
    cells, examples = [], {}
    for i, (recipe, (merge, calibration, ex)) in enumerate(rows.items()):
        acc = {t: float(np.mean(ex[t])) for t in TASKS}
        row = {"backbone": "vit", "task_set": "v2", "regime": "standard", "status": "ok", "recipe": recipe,
               "merge": merge, "calibration": calibration, "cell_id": f"c{i}", "run_id": f"r{i}", "cached": False,
               "error": "", "tasks": TASKS, "metrics.avg_acc": sum(acc.values()) / 2,
               "metrics.avg_norm_acc": sum(acc.values()) / 2}
        row.update({f"metrics.acc.{t}": acc[t] for t in TASKS})
        cells.append(row)
        examples[f"r{i}"] = None if recipe in without_examples else ex
    (table,) = build_tables(pd.DataFrame(cells), examples)
    return table


@pytest.fixture(scope="module")
def table():
    return _table()


def _entry(summary, calibration):
    return next(e for e in summary.entries if e.calibration == calibration)


def test_counts_and_median_of_a_calibration_across_its_merges(table):
    svc = _entry(summarize([table]), "svc")
    assert svc.counts == {"gain": 1, "none": 1, "loss": 1}
    assert dict(svc.verdicts) == {"task_arithmetic>svc": "gain", "ties>svc": "none", "tsv_m>svc": "loss"}
    assert svc.ill_posed == ("iso_c>svc",) and svc.unmeasured == ()
    assert svc.median == pytest.approx(0.5)  # the median of +10.0, +0.5 and -7.5 (iso_c>svc's +45 left out)


def test_the_median_interval_resamples_the_examples_jointly_for_every_row(table):
    """Recomputed by hand: scipy's draws (one (N_RESAMPLES, n) index draw per task, seed SEED), the same indices for
    every row, each row's resampled change, then the median per resample, then its 2.5 and 97.5 percentiles."""
    rng = np.random.default_rng(SEED)
    draws = [rng.integers(0, N, (N_RESAMPLES, N)) for _ in TASKS]
    changes = []
    for recipe in ("task_arithmetic>svc", "ties>svc", "tsv_m>svc"):
        mine = ROWS[recipe][2]
        diffs = [np.array(mine[t]) - np.array(BASE[t]) for t in TASKS]
        changes.append(sum(0.5 * d[idx].mean(axis=1) for d, idx in zip(diffs, draws)))
    medians = np.median(np.stack(changes), axis=0)
    expected = 100 * np.percentile(medians, [2.5, 97.5])
    low, high = _entry(summarize([table]), "svc").median_interval
    assert (low, high) == pytest.approx(tuple(expected), abs=1e-9)
    assert low < 0.5 < high


def test_with_one_merge_the_median_interval_is_that_rows_paired_interval(table):
    wsc = _entry(summarize([table]), "wsc")
    row = next(r for r in table.rows if r.recipe == "tsv_m>wsc")
    assert wsc.median == pytest.approx(0.0) and wsc.median_interval == row.delta_intervals["avg_acc"]
    assert wsc.median_interval[0] < 0 < wsc.median_interval[1] and dict(wsc.verdicts) == {"tsv_m>wsc": "none"}


def test_a_row_without_per_example_results_is_counted_as_not_measured_and_takes_the_interval_away():
    summary = summarize([_table(without_examples=("ties>svc",))])
    svc = _entry(summary, "svc")
    assert svc.counts == {"gain": 1, "none": 0, "loss": 1} and svc.unmeasured == ("ties>svc",)
    assert svc.median == pytest.approx(0.5) and svc.median_interval is None
    claim = next(c for c in summary.claims if c.text == "SVC improves the merges it calibrates")
    assert claim.unmeasured == 1 and claim.sentence.endswith("(1 not measured).")


def _svc_claim(gain_examples: int):
    rows = {k: ROWS[k] for k in ("finetuned", "task_arithmetic")}
    rows["task_arithmetic>svc"] = ("task_arithmetic", "svc", {"a": _ones(100 + gain_examples), "b": _ones(100)})
    summary = summarize([_table(rows)])
    (claim,) = summary.claims
    return claim, summary.entries[0]


def test_the_claim_sentence_flips_when_the_interval_crosses_zero():
    claim, entry = _svc_claim(20)  # +5.0 points: the paired interval lies above 0
    assert entry.changes[0][1][0] > 0
    assert claim.sentence == ("“SVC improves the merges it calibrates”: the testbed agrees in direction — 1 of 1 "
                              "calibrated rows agree (paired 95 % interval above 0), "
                              "0 disagree, 0 inside the noise.")
    claim, entry = _svc_claim(2)  # +0.5 points: the interval holds 0 (its lower end is 0 exactly)
    assert entry.changes[0][1][0] <= 0 < entry.changes[0][1][1]
    assert claim.sentence == ("“SVC improves the merges it calibrates”: the testbed is inconclusive — 0 of 1 "
                              "calibrated rows agree (paired 95 % interval above 0), "
                              "0 disagree, 1 inside the noise.")


def test_a_claim_is_checked_once_per_protocol_and_families_group_their_calibrations():
    rows = dict(ROWS)
    rows["task_arithmetic(scaling=1.0)"] = ("task_arithmetic", "none@λ=1", BASE)
    rows["task_arithmetic(scaling=1.0)>svc"] = ("task_arithmetic", "svc@λ=1", {"a": _ones(140), "b": _ones(100)})
    summary = summarize([_table(rows)])
    assert summary.calibrations == ["svc", "svc@λ=1", "wsc"]
    texts = [c.text for c in summary.claims]
    assert texts == ["SVC improves the merges it calibrates, at their validation-chosen scaling",
                     "SVC improves the merges it calibrates, at the fixed scaling λ=1",
                     "MAGIC's calibrations (WSC, FSC, DSC) improve the merges they calibrate"]
    assert [c.counts for c in summary.claims] == [{"agrees": 1, "disagrees": 1, "inconclusive": 1},
                                                  {"agrees": 1, "disagrees": 0, "inconclusive": 0},
                                                  {"agrees": 0, "disagrees": 0, "inconclusive": 1}]
    assert "is inconclusive" in summary.claims[2].sentence  # WSC's one row lies inside the noise


def test_the_summary_renders_counts_medians_and_links_to_the_tables(table):
    summary = summarize([table])
    md = markdown(summary, ["Diagnostics: fine."])
    assert md.startswith("## What this run found\n\n- “SVC improves the merges it calibrates”: **the testbed is "
                         "mixed** — 1 of 3 calibrated rows agree")  # the verdict in bold, for the eye
    assert "| calibration | [vit · v2 · standard](#vit--v2--standard) |" in md
    svc_line = next(line for line in md.splitlines() if line.startswith("| `svc` |"))
    assert svc_line.startswith("| `svc` | ▲1 ≈1 ▼1 †1 · +0.5 [")
    assert svc_line.endswith("]≈ |") and "Diagnostics: fine." in md
    page = to_html(summary)
    assert '<a href="#vit-v2-standard">vit · v2 · standard</a>' in page  # plots.slug: the page's section id
    assert "”: <strong>the testbed is mixed</strong> — 1 of 3" in page
    assert 'title="▲ task_arithmetic&gt;svc; ≈ ties&gt;svc; ▼ tsv_m&gt;svc; ill-posed, left out: iso_c&gt;svc"' in page
    document = to_json(summary)
    svc = next(c for c in document["calibrations"] if c["calibration"] == "svc")
    assert svc["counts"] == {"gain": 1, "none": 1, "loss": 1} and svc["median_points"] == pytest.approx(0.5)
    assert svc["median_ci95"][0] < 0.5 < svc["median_ci95"][1] and svc["ill_posed"] == ["iso_c>svc"]
    assert "error" not in json.dumps(document)  # DVC takes such a key for a failure to read the file


def test_a_table_with_no_calibrated_row_says_so():
    summary = summarize([_table({k: ROWS[k] for k in ("finetuned", "task_arithmetic")})])
    assert summary.entries == () and summary.claims == ()
    assert "No calibrated row on this board." in markdown(summary) and "No calibrated row" in to_html(summary)


def test_github_heading_anchor():
    assert heading_anchor("clip-small · headroom8 · norm_mismatch") == "clip-small--headroom8--norm_mismatch"
    assert heading_anchor("Testbed health (clip-small, seed 0): healthy") == "testbed-health-clip-small-seed-0-healthy"


def test_the_averages_come_right_after_the_row_label(table):
    md = table_markdown(table)
    assert "| recipe | avg | norm. avg | a | b |" in md
    line = next(line for line in md.splitlines() if line.startswith("| `task_arithmetic>svc` |"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    assert cells[0].startswith("**60.0 [") and cells[2:] == ["**70.0 (+20.0▲)**", "50.0 (+0.0≈)"]
    page = table_html(table)
    assert '<th class="avg">avg</th><th class="avg">norm. avg</th><th>a</th><th>b</th>' in page
