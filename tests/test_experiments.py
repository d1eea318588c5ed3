"""The papers' experiments as cells of the benchmark (mergecal.pipeline.experiments) and their reports
(mergecal.reports.papers): validation, the cells an experiment makes, and claims computed from paired intervals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mergecal.errors import MergecalError
from mergecal.pipeline import experiments as ex
from mergecal.pipeline.cells import enumerate_cells
from mergecal.pipeline.config import load_params
from mergecal.reports import papers as reports

PARAMS = load_params("params.yaml")


def experiment(**values) -> ex.Experiment:
    return ex.Experiment.model_validate({"id": "svc.test", "item": "Fig. 0", "shows": "a test", **values})


def test_the_packaged_experiments_are_valid_and_name_their_papers():
    found = ex.load_experiments()
    assert set(found) == {"svc", "magic", "distac"}
    ids = [e.id for paper in found.values() for e in paper]
    assert len(ids) == len(set(ids)) and all(i.split(".")[0] in found for i in ids)


def test_each_experiment_makes_references_base_and_variants_per_merge_on_the_tracks_own_cells(monkeypatch):
    tasks = tuple(PARAMS.vision.tasks)
    monkeypatch.setattr(ex, "probed_ranking", lambda params, root, regime, seed: [f"key{i}" for i in range(17)])
    for paper in ex.load_experiments().values():
        for e in paper:
            made = ex.experiment_cells(PARAMS, e, root=".")
            found = ex.variants(e, tasks)
            names = [v.name for v in found]
            # a searched experiment's calibrated base takes its scaling from the merge alone, which runs too
            if e.scaling is None and "{merge}" not in {v.chain for v in found}:
                names.append("{merge}")
            per_group = len(e.merges) * len(names) + 2  # + zeroshot and finetuned
            multitask = e.regimes.count("standard") * (e.track == "vision")  # the vision track's standard regime's
            assert len(made) == (per_group * len(e.regimes) + multitask) * len(PARAMS.seeds)
            for merge in e.merges:
                assert sorted(c.variant for c in made if c.cell.merge == merge) == sorted(names)


def test_a_variant_the_matrix_runs_is_the_matrix_cell():
    """magic.tab2's WSC rows are the default matrix's `{merge}>wsc` cells (searched scaling), svc.tab3's column
    rows its fixed-scaling `{merge}>svc` at 1.0: the same Cell, so the same id and cache."""
    matrix = set(enumerate_cells(PARAMS))
    found = {e.id: e for paper in ex.load_experiments().values() for e in paper}
    wsc = [c.cell for c in ex.experiment_cells(PARAMS, found["magic.tab2"]) if c.variant == "wsc"]
    svc = [c.cell for c in ex.experiment_cells(PARAMS, found["svc.tab3"]) if c.variant in ("column", "base")]
    assert wsc and svc and set(wsc) <= matrix and set(svc) <= matrix
    row = [c.cell for c in ex.experiment_cells(PARAMS, found["svc.tab3"]) if c.variant == "row"]
    assert row and not set(row) & matrix
    # calibrated at the scaling its merge chose (weight averaging has no grid to choose from)
    assert all(c.scaling_from == ("{merge}" if c.grid else "") for c in wsc)


def test_narrowing_keeps_what_a_cell_id_hashes():
    e = experiment(scaling=1.0, merges=["ties"], variants={"row": "{merge}>svc(space='row')"})
    narrowed = ex.narrowed_params(PARAMS, e)
    assert narrowed.benchmark.evaluation == PARAMS.benchmark.evaluation
    assert narrowed.vision.arch == PARAMS.vision.arch and narrowed.vision.tasks == PARAMS.vision.tasks
    assert list(narrowed.benchmark.merges) == ["ties"] and narrowed.benchmark.chains == []
    assert PARAMS.benchmark.chains  # the given params are not changed


def test_a_sweep_over_the_probed_ranking_takes_its_first_keys_and_the_probes_own_at_probing_top(monkeypatch):
    e = experiment(merges=["tsv_m"], sweep={"parameter": "alpha", "over": "sensitive_top", "values": [0, 2, 10],
                                            "chain": "{merge}>wsc(sensitive={sensitive})", "probed": "{merge}>wsc"})
    monkeypatch.setattr(ex, "probed_ranking", lambda params, root, regime, seed: ["k1", "k2", "k3"])
    made = {c.variant: c.cell for c in ex.experiment_cells(PARAMS, e, root=".")}
    assert made["0"].label == "tsv_m>wsc(sensitive=[])"
    assert made["2"].label == "tsv_m>wsc(sensitive=['k1', 'k2'])"
    assert made["10"] in set(enumerate_cells(PARAMS))  # probing.top: the matrix's own `{merge}>wsc`
    with pytest.raises(MergecalError, match="reads the probe's ranking: give the checkout"):
        ex.experiment_cells(PARAMS, e)


def test_sweeps_over_values_and_over_tasks():
    by_value = experiment(scaling=1.0, merges=["task_arithmetic"],
                          sweep={"parameter": "alpha", "chain": "{merge}>svc(alpha={value})", "values": [0.5, 1.0]})
    assert [(v.name, v.chain) for v in ex.variants(by_value, ("a", "b"))] == [
        ("base", "{merge}"), ("0.5", "{merge}>svc(alpha=0.5)"), ("1.0", "{merge}>svc(alpha=1.0)")]
    by_task = experiment(scaling=1.0, merges=["task_arithmetic"], plot="heatmap",
                         sweep={"parameter": "t", "chain": "{merge}>svc(targeted_task={index})", "over": "tasks"})
    assert [v.chain for v in ex.variants(by_task, ("a", "b"))][1:] == ["{merge}>svc(targeted_task=0)",
                                                                       "{merge}>svc(targeted_task=1)"]
    assert [v.name for v in ex.variants(by_task, ("a", "b"))][1:] == ["a", "b"]


def test_a_paper_without_analyses_or_measurements_loads_none_and_an_id_is_listed_once(monkeypatch):
    entry = {"id": "svc.one", "item": "x", "shows": "x", "merges": ["ties"], "variants": {"x": "{merge}>wsc"}}
    monkeypatch.setattr(ex, "read", lambda paper: {"experiments": [entry]})
    assert ex.load_measurements(("svc",)) == {"svc": []} and ex.load_analyses(("svc",)) == {"svc": []}
    monkeypatch.setattr(ex, "read", lambda paper: {"experiments": [entry, entry]})
    with pytest.raises(MergecalError, match="svc.yaml: svc.one: listed twice under `experiments:`"):
        ex.load_experiments(("svc",))


@pytest.mark.parametrize("values, message", [
    ({"merges": ["task_arithmetic"], "variants": {"x": "{merge}>svc"},
      "sweep": {"parameter": "a", "chain": "{merge}>svc(alpha={value})", "values": [1]}}, "not both"),
    ({"merges": ["task_arithmetic"], "variants": {"x": "{merge}>nope"}}, "nope"),
    ({"merges": ["task_arithmetic"], "sweep": {"parameter": "a", "chain": "{merge}>svc", "values": [1]}},
     "has no {value}"),
    ({"merges": ["task_arithmetic"], "variants": {"x": "{merge}>svc"}, "plot": "heatmap"}, "sweep over tasks"),
    ({"merges": [], "variants": {"x": "{merge}>svc"}}, "merges"),
    ({"merges": ["ties"], "variants": {"x": "{merge}>svc"}, "claims": [{"kind": "gain", "variant": "y", "text": "t"}]},
     "'y' is no variant"),
    ({"merges": ["ties"], "variants": {"x": "{merge}>svc"}, "printed": {"ties": {"z": 1.0}}}, "printed.ties"),
    ({"merges": ["ties"], "variants": {"x": "{merge}>svc"}, "claims": [{"kind": "diagonal", "text": "t"}]},
     "a diagonal claim is for a sweep over tasks"),
    ({"merges": ["ties"], "variants": {"finetuned": "{merge}>svc"}}, "variant names must be distinct"),
    ({"merges": ["ties"], "variants": {"x": "{merge}>svc"}, "base": "{merge}>wsc", "base_scaling": "searched"},
     "base_scaling: searched takes the matrix's merge alone"),
    ({"merges": ["ties"], "variants": {"x": "{merge}>svc"}, "scaling": {"dare": 0.3}}, "scaling: a positive lambda"),
    ({"merges": ["ties"], "variants": {"x": "{merge}>svc"}, "merge_settings": {"dare": {}}},
     "merge_settings.dare: not one of the experiment's merges"),
    ({"merges": ["adamerging_lw"], "variants": {"x": "{merge}>svc"},
      "merge_settings": {"adamerging_lw": {"steps": 0}}}, "merge_settings.adamerging_lw: .*steps"),
    ({"merges": ["ties"], "variants": {"x": "{merge}>svc"},
      "claims": [{"kind": "gain", "variant": "x", "than_merge": "dare", "text": "t"}]}, "merge 'dare' is not one"),
])
def test_a_bad_experiment_is_one_line_naming_its_file_and_id(monkeypatch, values, message):
    monkeypatch.setattr(ex, "read", lambda paper: {"experiments": [{"id": "svc.bad", "item": "x", "shows": "x",
                                                                   **values}]})
    with pytest.raises(MergecalError, match="mergecal/experiments/svc.yaml: svc.bad: .*" + message) as err:
        ex.load_experiments(("svc",))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"merges": ["ties", "adamerging"]}, "merge 'adamerging' is not in params.yaml's benchmark.merges"),
    ({"regimes": ["mixups"]}, "regime 'mixups' is not among vision.regimes or paper_regimes"),
    ({"track": "text"}, None),
])
def test_an_experiment_outside_the_configured_matrix_is_refused(change, message):
    e = experiment(**{"merges": ["ties"], "variants": {"x": "{merge}>wsc"}, **change})
    if message is None:  # the text track has no regimes list beyond standard: fine
        ex.narrowed_params(PARAMS, e)
        return
    with pytest.raises(MergecalError, match=message):
        ex.narrowed_params(PARAMS, e)
    data = PARAMS.model_copy(update={"vision": PARAMS.vision.model_copy(update={"enabled": False})})
    with pytest.raises(MergecalError, match="track 'vision' is not enabled"):
        ex.narrowed_params(data, experiment(merges=["ties"], variants={"x": "{merge}>wsc"}))


def test_a_merge_the_matrix_leaves_out_takes_the_experiments_settings_and_the_matrixs_own_come_first():
    assert "adamerging_lw" not in PARAMS.benchmark.merges  # opt-in: 500 steps a cell
    e = experiment(merges=["adamerging_lw", "ties"], variants={"x": "{merge}>wsc"},
                   merge_settings={"adamerging_lw": {"steps": 10}, "ties": {"top_k": 0.5}})
    merges = ex.narrowed_params(PARAMS, e).benchmark.merges
    assert merges == {"adamerging_lw": {"steps": 10}, "ties": PARAMS.benchmark.merges["ties"]}
    cells = [c.cell.label for c in ex.experiment_cells(PARAMS, e)]
    assert "adamerging_lw" in cells and "adamerging_lw>wsc" in cells


# ------------------------------------------------------------------------------------------------ the reports

TASKS = ("a", "b")


def outcome(correct: dict[str, list[int]]) -> reports.Outcome:
    metrics = {f"acc.{t}": float(np.mean(v)) for t, v in correct.items()}
    metrics["avg_norm_acc"] = float(np.mean([metrics[f"acc.{t}"] for t in TASKS]))
    return reports.Outcome(metrics, correct)


def group(outcomes) -> reports.Group:
    return reports.Group("standard", 0, TASKS, {f"acc.{t}": 1.0 for t in TASKS}, outcomes)


def scores(n_right: int, n: int = 200) -> list[int]:
    return [1] * n_right + [0] * (n - n_right)


def test_a_claims_verdict_comes_from_the_paired_interval_in_the_papers_direction():
    base = outcome({"a": scores(100), "b": scores(100)})
    better = outcome({"a": scores(160), "b": scores(150)})  # +55 points on the same examples
    same = outcome({"a": scores(101), "b": scores(100)})
    g = group({"up": {"base": base, "x": better}, "flat": {"base": base, "x": same},
               "down": {"base": better, "x": base}})
    e = experiment(merges=["up", "flat", "down"], variants={"x": "{merge}>svc"},
                   claims=[{"kind": "gain", "variant": "x", "text": "x helps"},
                           {"kind": "loss", "variant": "x", "merges": ["down"], "text": "x hurts down"}])
    gain, loss = (reports.claim_verdicts(e, [g], c, ["x"]) for c in e.claims)
    assert [u["verdict"] for u in gain] == ["agrees", "inconclusive", "disagrees"]
    assert [u["verdict"] for u in loss] == ["agrees"]
    counts = {v: sum(u["verdict"] == v for u in gain) for v in reports.VERDICTS}
    assert reports.sentence("x helps", counts, "merges").startswith("“x helps”: the testbed is mixed — 1 of 3")
    assert reports.overall({"inconclusive": 3}) == "is inconclusive"
    assert reports.overall({"agrees": 2, "inconclusive": 1}) == "agrees in direction"


def test_a_claim_with_than_merge_pairs_each_merge_with_that_merges_chain():
    base = outcome({"a": scores(100), "b": scores(100)})
    better = outcome({"a": scores(160), "b": scores(150)})
    g = group({"lwa": {"base": better}, "up": {"base": base, "x": better}, "down": {"base": better, "x": base}})
    e = experiment(merges=["lwa", "up", "down"], variants={"x": "{merge}>dsc"},
                   claims=[{"kind": "gain", "variant": "x", "than_merge": "lwa", "merges": ["up", "down"],
                            "text": "x beats lwa"}])
    found = reports.claim_verdicts(e, [g], e.claims[0], ["x"])
    # up's x equals lwa's base (the paired interval is 0): inside the noise; down's x is 55 points below it
    assert [(u["merge"], u["than_merge"], u["verdict"]) for u in found] == [("up", "lwa", "inconclusive"),
                                                                           ("down", "lwa", "disagrees")]


def test_the_diagonal_claim_compares_a_task_targeted_with_the_other_targets():
    targeted = {"a": outcome({"a": scores(180), "b": scores(100)}), "b": outcome({"a": scores(100), "b": scores(100)})}
    g = group({"m": {"base": outcome({"a": scores(100), "b": scores(100)}), **targeted}})
    e = experiment(merges=["m"], scaling=1.0, plot="heatmap",
                   claims=[{"kind": "diagonal", "than": "others", "text": "d"}],
                   sweep={"parameter": "t", "chain": "{merge}>svc(targeted_task={index})", "over": "tasks"})
    found = reports.claim_verdicts(e, [g], e.claims[0], list(TASKS))
    assert [(u["task"], u["verdict"]) for u in found] == [("a", "agrees"), ("b", "inconclusive")]


def test_a_report_renders_the_same_bytes_from_the_same_outcomes_and_says_what_is_missing():
    base = outcome({"a": scores(100), "b": scores(120)})
    e = experiment(merges=["m", "gone"], scaling=1.0, plot="line",
                   sweep={"parameter": "alpha", "chain": "{merge}>svc(alpha={value})", "values": [0.5, 1.0]},
                   claims=[{"kind": "increase", "text": "more is better"}],
                   printed={"m": {"base": 60.0, "1.0": 70.0}}, printed_where="Fig. 0")
    g = group({"m": {"base": base, "0.5": outcome({"a": scores(90), "b": scores(120)}),
                     "1.0": outcome({"a": scores(150), "b": scores(120)})}})
    chains = {v.name: v.chain for v in ex.variants(e, TASKS)}
    pages = []
    for _ in range(2):
        blocks, document = reports.experiment_section(e, [g], ["0.5", "1.0"], chains, "svc.test")
        page = reports.paper_blocks("T", "0000.00000", [blocks])
        pages.append((reports.to_markdown(page), reports.to_html("T", page), reports.to_json(document)))
    assert pages[0] == pages[1]
    markdown, html, _ = pages[0]
    assert "| `gone` | — | — | — |" in markdown  # a merge without cells: shown, outside every count
    assert "“more is better”: the testbed agrees in direction — 1 of 1 merges agree" in markdown
    assert "0 disagree, 0 inside the noise (1 not measured)." in markdown  # the missing merge is no verdict
    assert "| `m` | `1.0` | 60.0 → 70.0 | +10.0 |" in markdown and "| agrees |" in markdown
    assert html.count("<figure>") == 1 and "<svg" not in html.split("<figure>")[0]


def test_the_reference_rows_are_shown_under_the_table_the_multitask_one_as_the_ceiling():
    e = experiment(merges=["m"], scaling=1.0, variants={"x": "{merge}>svc"})
    g = group({"m": {"base": outcome({"a": scores(100), "b": scores(100)}),
                     "x": outcome({"a": scores(120), "b": scores(100)})}})
    g.references = {"finetuned": outcome({"a": scores(200), "b": scores(200)}),
                    "multitask": outcome({"a": scores(190), "b": scores(170)})}
    blocks, document = reports.experiment_section(e, [g], ["x"], {"base": "{merge}", "x": "{merge}>svc"}, "t")
    shown = next(text for kind, text, *_ in blocks if kind == "p" and text.startswith("References"))
    assert shown.startswith("References: `finetuned` (the fine-tuned models, each on its own task) 100.0")
    assert "`multitask` (one model fine-tuned on all tasks at once, the papers' multi-task ceiling) 90.0 [" in shown
    assert "zeroshot" not in shown  # a reference the group lacks is not named
    assert document["groups"][0]["references"]["multitask"]["value"] == 90.0


def test_samples_per_task_are_read_from_the_recipe():
    assert reports.samples_per_task("{merge}>wsc") == "0"
    assert reports.samples_per_task("{merge}>dsc") == "1"
    assert reports.samples_per_task("{merge}>dsc(fsc={'n_samples_per_task': 4})") == "4"
    assert reports.samples_per_task("{merge}>dsc_a(fsc={'n_samples_per_task': 16})") == "0 (16 task-agnostic)"


def test_an_analysis_claim_counts_its_units_from_the_models_numbers():
    analysis = ex.Analysis.model_validate({
        "id": "svc.fig9", "item": "Fig. 9", "shows": "a test", "kind": "svc_spectrum", "merges": ["a", "b"],
        "claims": [{"kind": "top_gap", "text": "gap"}, {"kind": "both_signs", "text": "both"}]})
    spectrum = {"r": [1, 2], "sigma": [2.0, 1.0], "sigma_star": [1.0, 1.5], "gamma_sigma": [1.0, 1.0]}
    data = {"a": {"alpha": 0.5, "classes": {"mlp": {"keys": 2, "shape": [4, 4],
                                                     "spectrum": {**spectrum, "gap": [1.0, -0.5]}}}},
            "b": {"alpha": 0.5, "classes": {"mlp": {"keys": 2, "shape": [4, 4],
                                                     "spectrum": {**spectrum, "gap": [-0.2, None]}}}}}
    gap, both = (reports.analysis_claim_units(c, analysis.merges, data) for c in analysis.claims)
    assert [u["verdict"] for u in gap] == ["agrees", "disagrees"]
    assert [u["verdict"] for u in both] == ["agrees", "disagrees"]
    blocks, document = reports.analysis_section(analysis, {"seed": 0, "regime": "standard", "data": data}, "svc.fig9")
    text = reports.to_markdown(blocks)
    assert "| `mlp` | 2 | 2 | 1 | 1 | 1 | 1 of 2 |" in text and text.count("![Fig. 9") == 2
    assert "“gap”: on the testbed's models it is mixed — 1 of 2 (merge, key class) units agree, 1 disagree" in text
    cross = ex.Analysis.model_validate({"id": "svc.fig8", "item": "Fig. 8", "shows": "t", "kind": "svc_cross_terms",
                                        "merges": ["a"], "claims": [{"kind": "positive_cross", "text": "c"}]})
    data = {"a": {"tasks": ["x", "y"], "classes": {"mlp": {"keys": 1, "cross_terms": [[[0.4, 0.1], [0.1, 0.4]],
                                                                                        [[0.5, -0.1], [-0.1, 0.7]]]}}}}
    units = reports.analysis_claim_units(cross.claims[0], cross.merges, data)
    assert [(u["r"], u["verdict"]) for u in units] == [(1, "agrees"), (2, "disagrees")]


def test_a_measurement_is_read_from_its_committed_file_beside_the_printed_figures(tmp_path):
    item = ex.Measurement.model_validate({
        "id": "svc.tab4", "item": "Table 4", "shows": "cost", "command": "make perf-svc",
        "measured": [{"shape": "B/32", "file": "b32.json", "row": "svc (alpha=1/K)"},
                     {"shape": "L/14", "file": "l14.json", "row": "svc (alpha=1/K)"}],
        "printed": {"B/32": {"seconds": 5.1, "mib": 1027.4}, "7B": {"seconds": 517.2, "mib": 1898.7}},
        "printed_where": "Table 4"})
    (tmp_path / "b32.json").write_text(json.dumps({"setting": {"tasks": 8, "threads": 1}, "rows": [
        {"label": "svc (alpha=1/K)", "seconds": 2.345, "peak_extra_mb": 80.04}]}))
    blocks, document = reports.measurement_section(item, tmp_path)
    text = reports.to_markdown(blocks)
    assert "| B/32 | 2.35 | 80 | 5.1 | 1027 | `b32.json` |" in text
    assert "| L/14 | — | — | — | — | not measured |" in text
    assert "| 7B | — | — | 517.2 | 1899 | not measured here |" in text
    assert document["rows"][0] == {"shape": "B/32", "seconds": 2.35, "peak_extra_mib": 80.0,
                                   "printed": {"seconds": 5.1, "mib": 1027.4}}


def test_a_malformed_measurement_or_analysis_file_is_one_line(tmp_path):
    item = ex.Measurement.model_validate({
        "id": "svc.tab4", "item": "Table 4", "shows": "cost", "command": "make perf-svc",
        "measured": [{"shape": "B/32", "file": "b32.json", "row": "svc (alpha=1/K)"}]})
    (tmp_path / "b32.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(MergecalError, match=r"^b32.json: not a `mergecal perf` JSON .*KeyError"):
        reports.measurement_section(item, tmp_path)
    analysis = ex.Analysis.model_validate({"id": "svc.fig9", "item": "Fig. 9", "shows": "t", "kind": "svc_spectrum",
                                           "merges": ["a"], "claims": [{"kind": "top_gap", "text": "gap"}]})
    with pytest.raises(MergecalError, match="analysis.json: svc.fig9: not the data of a svc_spectrum analysis"):
        reports.analysis_section(analysis, {"seed": 0, "regime": "standard", "data": {"a": {"alpha": 1}}}, "p")


def test_the_protocol_names_a_merge_that_learns_its_coefficients_apart_from_the_searched_ones():
    e = experiment(merges=["adamerging_lw", "task_arithmetic", "tsv_m"], scaling={"task_arithmetic": 0.3},
                   variants={"x": "{merge}>dsc"})
    assert reports.protocol_text(e) == (
        "λ = 0.3 fixed (no search) for `task_arithmetic`; `adamerging_lw` with coefficients learned on unlabelled "
        "inputs (no λ searched); `tsv_m` at the scaling searched on validation, a calibration at the scaling its "
        "merge chose")
