"""Published rows (#42, step 4): the SVC paper's Tables 5-10, the MAGIC paper's Tables I-III and FusionBench's
documented numbers for its own pools as transcribed are consistent with themselves (each printed average is the
mean of its printed per-task numbers up to their rounding, each printed gain the difference of two printed
averages; the sources' own slips named) and the SVC paper's with its Table 1 (two disagreements, named); a
leaderboard table built from a preset is compared row by row with them (inside / outside a run's interval,
allowing the printed rounding: 0.05 point, 0.005 for a two-decimal table), and the report writes that section."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mergecal.methods import MERGE_METHODS
from mergecal.pipeline.config import parse_params
from mergecal.pipeline.track_registry import lab_tracks
from mergecal.published import PublishedRow, cite, for_tracks, load, recipe_of, rows
from mergecal.reports.leaderboard import Row, Table
from mergecal.reports.published import compare, markdown, to_json

BACKBONES = ("ViT-B/32", "ViT-B/16", "ViT-L/14")


@pytest.mark.parametrize("source, gains, slips, column_slips", [
    # six merges with and without SVC on three backbones and two task sets (Tables 5-7, 8-10: Table 8's DARE row
    # prints 63.9 where its 14 numbers average 64.01), and on Llama-2-7B with a gain a column (Table 2), three of
    # which are 0.1 off the difference of the printed scores (so computed before rounding)
    ("svc", 18 + 18 + 12, [("8", "DARE")], [("2", "TA w/ SVC", "AlpacaEval", 2.6, 2.5),
                                            ("2", "TIES w/ SVC", "AlpacaEval", 1.4, 1.3),
                                            ("2", "TIES w/ SVC", "GSM8K", 3.1, 3.0)]),
    # MAGIC prints Traditional MTL's average as 88.9; its per-task numbers (the SVC paper's too) average 89.06
    ("magic", 15 + 1, [("I", "Traditional MTL [11]")], []),
    # FusionBench's documentation: no gains printed; every eight-task average adds up (its 20-task tables print none)
    ("fusionbench", 0, [], [])])
def test_each_transcribed_table_adds_up(source, gains, slips, column_slips):
    data = load(source)
    assert len(data["tasks"]) == 8 and data["paper"]["arxiv"]
    checked, off, off_columns, base = 0, [], [], {}
    for table in data["tables"]:
        tasks = table.get("tasks", data["tasks"])
        for row in table["rows"]:
            assert len(row["per_task"]) == len(tasks) and all(0 <= v <= 100 for v in row["per_task"]), row
            # per-task numbers and the average are each rounded to 0.1: the mean is within 0.05 + 0.05 of it
            if row["average"] is not None and abs(sum(row["per_task"]) / len(tasks) - row["average"]) > 0.1 + 1e-9:
                off.append((str(table["table"]), row["row"]))
            key = (table["backbone"], row["method"])
            if "gain" in row:  # against its base row: the same merge without a calibration, printed before it
                assert ">" in row["chain"] and round(row["average"] - base[key][0], 1) == row["gain"], row
                checked += 1
            elif "gains" in row:  # one a column
                assert ">" in row["chain"] and len(row["gains"]) == len(tasks), row
                for task, value, before, gain in zip(tasks, row["per_task"], base[key][1], row["gains"]):
                    difference = round(value - before, 1)
                    assert abs(difference - gain) <= 0.1 + 1e-9, (row, task)  # rounding, at most
                    if difference != gain:
                        off_columns.append((str(table["table"]), row["row"], task, difference, gain))
                    checked += 1
            elif row["chain"] is not None and ">" not in row["chain"]:  # the merge alone, searched or fixed
                base[key] = (row["average"], row["per_task"])
    assert checked == gains and off == slips and off_columns == column_slips


def test_fusionbenchs_two_printings_of_its_references_part_where_named():
    """FusionBench's page prints each pool's zero-shot and fine-tuned accuracies three times: in the eight-task
    merging tables, in the single-model tables (each encoder on all eight tasks) and in the 20-task tables (two
    decimals). The single-model tables' diagonals are the merging tables' fine-tuned rows; the 20-task tables are
    other evaluations, which part from the merging tables' on 21 of 48 eight-task columns by more than the two
    roundings (ViT-L/14's zero-shot EuroSAT by 2.3 points): the first run of a preset should read both."""
    data = load("fusionbench")
    eight = {(t["backbone"], r["method"]): r["per_task"] for t in data["tables"] if t["task_set"] == "ta8"
             for r in t["rows"] if r["method"] in ("zeroshot", "finetuned")}
    for backbone, single in data["single_model_ta8"].items():
        assert single["diagonal"] == eight[(backbone, "finetuned")]
        if "pretrained" in single:  # ViT-B/32's single-model table prints MNIST's zero-shot as 48.3, not 48.2
            assert [(t, a, b) for t, a, b in zip(data["tasks"], single["pretrained"], eight[(backbone, "zeroshot")])
                    if a != b] == ([("MNIST", 48.3, 48.2)] if backbone == "ViT-B/32" else [])
    parted = []
    for backbone in BACKBONES:
        twenty = rows("fusionbench", backbone, "tall20")
        assert [r.recipe for r in twenty] == ["zeroshot", "finetuned"] and {r.decimals for r in twenty} == {2}
        for row in twenty:
            assert row.tasks[:8] == tuple(data["tasks"]) and row.average is None
            parted += [(backbone, row.recipe, task) for task, a, b in zip(data["tasks"], eight[(backbone, row.recipe)],
                                                                          row.per_task) if abs(a - b) > 0.055 + 1e-9]
    assert len(parted) == 21 and ("ViT-L/14", "zeroshot", "EuroSAT") in parted
    assert [p for p in parted if p[0] == "ViT-B/16"] == [("ViT-B/16", "zeroshot", t) for t in
                                                         ("Cars", "RESISC45", "SVHN", "DTD")]


def test_fusionbenchs_rows_are_the_fixed_scaling_protocols_cells_and_cite_the_document():
    """Its Task Arithmetic and Ties-Merging rows are at lambda 0.3 with no search: they match the rows a
    ``benchmark.fixed_scaling`` protocol at 0.3 names, not the searched merge; Simple Averaging is the weight
    average; the citation names the page and its commit, and the tables by caption."""
    from mergecal.pipeline.cells import matrix_chains
    from mergecal.recipe import Recipe

    # the params docs/reproduce-a-paper.md gives a lab for these rows: the cells' labels (Cell.label)
    params = parse_params({"benchmark": {
        "merges": {"task_arithmetic": {"scaling": [0.1, 0.3]}, "ties": {"disjoint": "sum", "scaling": [0.1, 0.3]}},
        "chains": ["{merge}"], "fixed_scaling": [{"scaling": 0.3, "merges": ["task_arithmetic", "ties"],
                                                  "chains": ["{merge}"]}]},
        "local_clip": [{"name": "fb", "preset": "fusionbench-clip-vit-b32-ta8"}]})
    labels = {(merge, bool(grid)): chain.replace("{merge}", merge)
              for merge, chain, _, grid, _ in matrix_chains(params)}
    for backbone in BACKBONES:
        found = rows("fusionbench", backbone, "ta8")
        recipes = [r.recipe for r in found if r.recipe is not None]
        adamerging = ["adamerging_lw"] if backbone == "ViT-B/16" else ["adamerging_tw", "adamerging_lw"]
        assert recipes == ["zeroshot", "finetuned", "weight_averaging", "task_arithmetic(scaling=0.3)",
                           "ties(scaling=0.3)", *adamerging]
        for merge in ("task_arithmetic", "ties"):  # the fixed-scaling cell's label, not the searched one's
            assert labels[(merge, False)] in recipes and labels[(merge, True)] not in recipes
            assert Recipe.parse(labels[(merge, False)]).steps[0].params.scaling == 0.3
        assert {r.decimals for r in found} == {1}
    b32 = rows("fusionbench", "ViT-B/32", "ta8")
    assert cite(b32) == ("FusionBench's documentation, docs/modelpool/clip_vit.md (tanganke/fusion_bench at "
                         "26ffec5), table “Multi-task model merging methods using CLIP-ViT-B/32 models” "
                         "(its paper: arXiv:2406.03280)")
    assert len([r for r in b32 if r.recipe is None]) == 10  # RegMean, Concrete AdaMerging, WEMoE, ...: not mergecal's


def test_a_two_decimal_table_allows_only_its_own_rounding():
    """A number printed to two decimals lies within 0.005 of the value it rounds, not 0.05; the run's value and
    interval are shown to the same precision."""
    zeroshot = rows("fusionbench", "ViT-B/32", "tall20")[0]  # SUN397 63.18, Cars 59.58
    table = Table("fb", "tall14", "standard", "0", ("SUN397", "Cars"), (
        Row("zeroshot", "zeroshot", "none", "reference", "z", "run", False,
            {"acc.SUN397": 0.6310, "acc.Cars": 0.5950},
            intervals={"acc.SUN397": (0.6290, 0.6318), "acc.Cars": (0.5900, 0.5956)}),), ())
    rep = compare(table, [zeroshot])
    # SUN397: 63.18 at the interval's end; Cars: 59.58 above 59.56 + 0.005 (inside with a 0.05 allowance)
    assert {c.column: c.inside for c in rep.comparisons} == {"SUN397": True, "Cars": False}  # a subset: no average
    assert "| `zeroshot` | Pre-trained | Cars | 59.58 | 59.50 [59.00, 59.56] | **no** |" in markdown([rep])
    assert [c["decimals"] for c in to_json([rep])[0]["comparisons"]] == [2, 2]


def test_the_llm_tables_name_their_own_columns():
    svc, magic = rows("svc", "Llama-2-7B", "wizardmath-chat"), rows("magic", "Llama-2-7B", "wizardmath-chat")
    assert {r.tasks for r in svc + magic} == {("AlpacaEval", "GSM8K")}
    assert all(r.average is None for r in svc) and [r.average for r in magic][:1] == [43.2]
    assert [r.recipe for r in magic][-1] == "task_arithmetic(scaling=0.3)>wsc"  # MAGIC's lambda 0.3
    # the two papers agree on GSM8K for three of six merges (MAGIC's TA and TIES at lambda 0.3, SVC's searched)
    merge = {p.row: p.recipe.partition("(")[0] for p in svc + magic if ">" not in p.recipe}
    gsm8k = {merge[p.row]: p.per_task[1] for p in svc if p.row in merge}
    assert [merge[p.row] for p in magic if p.row in merge and p.per_task[1] == gsm8k[merge[p.row]]] == \
        ["ties", "iso_c", "iso_cts"]


def test_table_1_agrees_with_the_per_task_tables_but_for_two_printed_averages():
    data = load("svc")
    disagreements = []
    for table in data["tables"]:
        if table["task_set"] not in ("ta8", "svc14"):
            continue
        summary = data[f"table_1_{table['task_set']}"][table["backbone"]]
        printed = {row["row"]: row["average"] for row in table["rows"]}
        assert set(summary) <= set(printed)  # (Table 1 leaves out STAR, CAT and Traditional MTL)
        for name, average in summary.items():
            if printed[name] != average:
                disagreements.append((table["task_set"], table["backbone"], name, average, printed[name]))
    # Table 1 against Table 5 (ViT-B/32's zero-shot) and Table 9 (ViT-B/16's fine-tuned models on the 14 tasks,
    # whose per-task numbers average 88.23: Table 9's 88.2, not Table 1's 89.5)
    assert disagreements == [("ta8", "ViT-B/32", "PRETRAINED", 48.0, 48.1),
                             ("svc14", "ViT-B/16", "INDIVIDUAL", 89.5, 88.2)]


def test_the_14_task_tables_are_the_svc_papers_own_set_and_share_columns_with_the_tall_sets():
    from mergecal.data.real_vision_metadata import TASK_SETS

    b32 = rows("svc", "ViT-B/32", "svc14")
    assert len(b32) == 14 and {r.tasks for r in b32} == {(
        "Caltech101", "Cars", "CIFAR100", "DTD", "EuroSAT", "FGVCAircraft", "Flowers102", "Food101", "GTSRB", "MNIST",
        "OxfordIIITPet", "RESISC45", "SUN397", "SVHN")}
    assert set(b32[0].tasks) - set(TASK_SETS["tall20"]) == {"Caltech101", "FGVCAircraft"}
    assert set(b32[0].tasks) & set(TASK_SETS["tall14"]) == set(TASK_SETS["ta8"]) | {
        "CIFAR100", "Flowers102", "OxfordIIITPet"}
    assert [r.per_task[r.tasks.index("Food101")] for r in b32][:3] == [79.5, 85.0, 35.6]  # zero-shot, fine-tuned, TA


def test_published_rows_carry_mergecals_recipes_and_the_preset_names_its_table():
    assert recipe_of("ties", "{merge}>svc") == "ties>svc" and recipe_of("finetuned", None) == "finetuned"
    assert recipe_of(None, None) is None and recipe_of("tsv_m", "{merge}") == "tsv_m"
    b16 = rows("svc", "ViT-B/16", "ta8")
    # SVC's rows at lambda 1 with no search (its Implementation Detail), its merges' at their papers' settings
    assert [r.recipe for r in b16][:5] == ["zeroshot", "finetuned", "task_arithmetic",
                                           "task_arithmetic(scaling=1.0)>svc", "dare"]
    assert cite(b16) == ("When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging "
                         "(arXiv:2602.05536), Table 6")
    magic = rows("magic", "ViT-B/32", "ta8")
    assert cite(magic) == ("MAGIC: Achieving Superior Model Merging via Magnitude Calibration (arXiv:2512.19320), "
                           "Tables I, II")
    assert {r.recipe for r in magic} >= {"iso_cts>dsc", "tsv_m>wsc", "iso_c>fsc", "weight_averaging"}
    assert rows("svc", "ViT-B/32", "ta14") == []
    params = parse_params({"local_clip": [
        {"name": "fb16", "preset": "fusionbench-clip-vit-b16-ta8"},
        {"name": "mine", "model": {"pretrained": "/c"}, "finetuned": {"MNIST": "/a", "DTD": "/b"},
         "datasets": {"MNIST": "/d", "DTD": "/d"}}]})
    # FusionBench's own numbers for its pool first, then the papers' (task_vectors' checkpoints: no verdict)
    found = for_tracks(lab_tracks(params))
    assert list(found) == ["fb16"] and [[replace(r, unlike="") for r in paper] for paper in found["fb16"]] == \
        [rows("fusionbench", "ViT-B/16", "ta8"), b16, rows("magic", "ViT-B/16", "ta8")]
    assert [{r.unlike for r in paper} for paper in found["fb16"]] == \
        [{""}, {"other checkpoints (task_vectors)"}, {"other checkpoints (task_vectors)"}]
    assert "preset" not in params.local_clip[0].model_dump(mode="json")  # not in the cell ids


def _published(recipe: str, average: float, per_task=(70.0, 60.0)) -> PublishedRow:
    return PublishedRow("svc", "A paper", "0000.00000", "5", "ViT-B/32", "ta8", recipe.upper(), recipe, ("cars", "dtd"),
                        tuple(per_task), average)


def _row(recipe: str, avg: float, interval: tuple[float, float] | None) -> Row:
    merge, _, calibration = recipe.partition(">")
    return Row(recipe, merge, calibration or "none", "base", f"{recipe}-id", "run", False,
               {"acc.cars": avg, "acc.dtd": avg, "avg_acc": avg},
               intervals={"avg_acc": interval, "acc.cars": interval} if interval else {})


def test_a_table_is_compared_row_by_row_with_the_printed_rounding_allowed():
    table = Table("fb", "ta8", "standard", "0", ("cars", "dtd"), (
        _row("task_arithmetic", 0.700, (0.680, 0.720)),  # 70.0 [68.0, 72.0]
        _row("task_arithmetic>svc", 0.800, (0.790, 0.810)),  # 80.0 [79.0, 81.0]
        _row("ties", 0.650, None),  # no interval: no verdict
        _row("consensus", 0.600, (0.5, 0.7))), ())  # no published counterpart
    published = [_published("task_arithmetic", 72.05), _published("task_arithmetic>svc", 81.1),
                 _published("ties", 65.0), _published("star", 69.0)]  # STAR: a method mergecal does not run
    rep = compare(table, published)
    avg = {c.recipe: c for c in rep.comparisons if c.column == "avg"}
    assert avg["task_arithmetic"].inside is True  # 72.05 = 72.0 + the rounding: inside
    assert avg["task_arithmetic>svc"].inside is False  # 81.1 > 81.05
    assert avg["ties"].inside is None and avg["ties"].value == 65.0
    assert [c.column for c in rep.comparisons if c.recipe == "task_arithmetic"] == ["cars", "dtd", "avg"]
    assert rep.unmatched_published == ("STAR (`star`)",) and rep.unmatched_here == ("consensus",)
    assert rep.counts() == {"inside": 2, "outside": 2, "no_interval": 5, "not_comparable": 0,
                            "published_without_row": 1,
                            "rows_without_published": 1}  # cars inside (70 in [68, 72]) x1, outside (60) x2 ...
    text = markdown([rep])
    assert "## Published: fb · ta8 · standard" in text and "Against A paper (arXiv:0000.00000), Table 5." in text
    assert "| `task_arithmetic>svc` | TASK_ARITHMETIC>SVC | avg | 81.1 | 80.0 [79.0, 81.0] | **no** |" in text
    assert ("Reproduction over 9 compared values: 2 inside their interval, 2 outside, 5 without an interval; "
            "published rows with no row here: STAR (`star`); rows here with no published counterpart: "
            "`consensus`.") in text
    subset = Table("fb", "ta8", "standard", "0", ("cars",), table.rows, ())
    assert "avg" not in {c.column for c in compare(subset, published).comparisons}  # no published average
    assert compare(Table("fb", "ta8", "norm_mismatch", "0", ("cars", "dtd"), table.rows, ()), published) is None


def test_the_report_writes_the_published_section(tmp_path):
    """A leaderboard of the report tests' store (backbone mergecal-vit-tiny, tasks cars and dtd) with published rows
    for it: the Markdown section, the HTML section, the JSON document."""
    from mlflow import MlflowClient
    from test_reports import T0, _log_cell  # the cells the report tests log

    from mergecal.reports.write import write_reports

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mergecal", artifact_location=str(tmp_path / "artifacts"))
    parent = client.create_run(exp, start_time=T0, tags={"mergecal.kind": "invocation",
                                                         "mergecal.invocation_id": "inv-1"})
    for j, recipe in enumerate(("zeroshot", "task_arithmetic", "task_arithmetic>svc")):
        _log_cell(client, exp, parent.info.run_id, "inv-1", recipe, T0 + 10 * (j + 1))
    client.set_terminated(parent.info.run_id, end_time=T0 + 2000)
    published = {"mergecal-vit-tiny": [[_published("task_arithmetic", 63.9, (67.8, 60.0)),
                                        _published("task_arithmetic>svc", 66.0, (70.0, 62.0))]]}
    written = write_reports(uri, "mergecal", tmp_path / "out", published=published)
    text = written["leaderboard.md"].read_text()
    assert "## Published: mergecal-vit-tiny · vision2 · standard" in text
    assert "| `task_arithmetic` | TASK_ARITHMETIC | avg | 63.9 | 63.9 | — |" in text  # no per-example results logged
    assert 'id="published"' in written["leaderboard.html"].read_text()
    document = json.loads(written["leaderboard.json"].read_text())
    assert [(d["backbone"], d["counts"]["no_interval"]) for d in document["published"]] == [("mergecal-vit-tiny", 6)]
    assert "zeroshot" in document["published"][0]["unmatched_here"]
    plain = write_reports(uri, "mergecal", tmp_path / "plain")  # no preset track: no section
    assert "## Published" not in plain["leaderboard.md"].read_text()


@pytest.mark.parametrize("source", ["svc", "magic"])
def test_every_published_recipe_is_one_mergecal_runs_or_says_it_has_none(source):
    """A row's recipe is a reference or parses as a mergecal recipe (its merge and calibration exist); a row with
    none is a method mergecal does not implement."""
    from mergecal.recipe import Recipe

    found = [r for backbone in BACKBONES for r in rows(source, backbone, "ta8")]
    assert {r.row for r in found if r.recipe is None} <= {"TRADITIONAL MTL", "STAR", "CAT", "Traditional MTL [11]"}
    for row in found:
        if row.recipe is not None and row.recipe not in ("zeroshot", "finetuned"):
            Recipe.parse(row.recipe)  # raises on an unknown merge or calibration
    assert {r.recipe.partition(">")[2] for r in found if r.recipe and ">" in r.recipe} == (
        {"svc"} if source == "svc" else {"dsc", "wsc", "fsc"})


REPO_PARAMS = __import__("pathlib").Path(__file__).resolve().parents[1] / "params.yaml"
SVC_ROWS = ("TA w/ SVC", "DARE w/ SVC", "TIES w/ SVC", "TSV-M w/ SVC", "ISO-C w/ SVC", "ISO-CTS w/ SVC")


@pytest.mark.parametrize("source, backbone, task_set, fixed", [
    # MAGIC's Implementation Details: TA and TIES at lambda 0.3 (its other merges at their papers' settings)
    ("magic", "ViT-B/32", "ta8", {"TA ICLR’23 [9]": 0.3, "TIES NeurIPS’23 [15]": 0.3, "TA w/ DSC": 0.3,
                                  "TIES w/ DSC": 0.3}),
    ("magic", "Llama-2-7B", "wizardmath-chat", {"TA": 0.3, "TIES": 0.3, "TA w/ WSC (Ours)": 0.3}),
    # SVC's Implementation Detail: lambda = 1 throughout, no search, for every merge it calibrates
    ("svc", "ViT-B/32", "ta8", dict.fromkeys(SVC_ROWS, 1.0)),
    ("svc", "ViT-L/14", "svc14", dict.fromkeys(SVC_ROWS, 1.0)),
    ("svc", "Llama-2-7B", "wizardmath-chat", dict.fromkeys(("TA w/ SVC", "TIES w/ SVC", "DARE w/ SVC", "TSV-M w/ SVC",
                                                             "Iso-C w/ SVC", "Iso-CTS w/ SVC"), 1.0)),
    # FusionBench: TA and TIES at a fixed lambda 0.3
    ("fusionbench", "ViT-B/32", "ta8", {"Task Arithmetic (λ=0.3)": 0.3, "Ties-Merging (λ=0.3)": 0.3})])
def test_each_sources_rows_point_at_the_default_matrixs_cells_of_its_protocol(source, backbone, task_set, fixed):
    """Every published merge row names a cell of the default matrix, and the one that runs the source's protocol:
    the fixed scaling it states (no search), the searched merge where it states none."""
    from mergecal.pipeline.cells import matrix_chains
    from mergecal.pipeline.config import load_params

    cells = {chain.replace("{merge}", merge): (grid, recipe)
             for merge, chain, _, grid, recipe in matrix_chains(load_params(REPO_PARAMS))}
    merges = [r for r in rows(source, backbone, task_set) if r.recipe not in (None, "zeroshot", "finetuned")]
    assert {r.row for r in merges} >= set(fixed)
    # the default matrix has no searched `{merge}>fsc` chain: MAGIC's Table II FSC rows say which chain runs them;
    # AdaMerging (learned on data, too slow for the default run) is params.yaml's commented opt-in
    opt_in = {r.row for r in merges if MERGE_METHODS[r.recipe.partition(">")[0].partition("(")[0]].needs_data}
    absent = [r.row for r in merges if r.recipe not in cells and r.row not in opt_in]
    assert absent == (["TSV-M w/ FSC", "Iso-C w/ FSC", "Iso-CTS w/ FSC"] if (source, backbone) == ("magic", "ViT-B/32")
                      else [])
    for row in merges:
        if row.row in absent or row.row in opt_in:
            continue
        grid, recipe = cells[row.recipe]
        scaling = next(s for s in recipe.steps if s.phase == "merge").params.scaling
        if row.row in fixed:
            assert grid == () and scaling == fixed[row.row], row.row
        else:
            assert "(scaling=" not in row.recipe, row.row  # searched on validation (or weight averaging's own)


def test_a_row_is_compared_only_with_a_cell_running_its_stated_settings():
    """FusionBench's Ties-Merging merges with disjoint sum: the default ties(scaling=0.3) cell (disjoint mean) gets
    no verdict, and says what differs; a cell that sums gets one. MAGIC's TIES states top-k 20 % only."""
    from mergecal.recipe import Recipe
    from mergecal.reports.published import other_protocol

    fb = next(r for r in rows("fusionbench", "ViT-B/32", "ta8") if r.recipe == "ties(scaling=0.3)")
    assert dict(fb.params) == {"top_k": 0.2, "disjoint": "sum"}
    mean, summed = Recipe.parse("ties(scaling=0.3)").id, Recipe.parse("ties(scaling=0.3,disjoint='sum')").id
    assert other_protocol(fb, mean) == "another protocol (disjoint 'mean' here, 'sum' printed)"
    assert other_protocol(fb, summed) == ""
    magic = next(r for r in rows("magic", "ViT-B/32", "ta8") if r.recipe == "ties(scaling=0.3)")
    assert other_protocol(magic, mean) == "" and other_protocol(magic, Recipe.parse("ties(top_k=0.1)").id) == \
        "another protocol (top_k 0.1 here, 0.2 printed)"
    table = Table("fb", "ta8", "standard", "0", ("cars", "dtd"), (
        replace(_row("ties(scaling=0.3)", 0.7, (0.6, 0.8)), recipe_id=mean),), ())
    printed = replace(_published("ties(scaling=0.3)", 70.0), params=fb.params)
    rep = compare(table, [printed])
    assert {c.inside for c in rep.comparisons} == {None} and rep.counts()["not_comparable"] == 3
    assert "| 70.0 | 70.0 [60.0, 80.0] | — another protocol (disjoint 'mean' here, 'sum' printed) |" in markdown([rep])
    table = replace(table, rows=(replace(table.rows[0], recipe_id=summed),))
    assert [c.inside for c in compare(table, [printed]).comparisons] == [True, None, True]  # dtd: no interval


def test_rows_of_other_checkpoints_or_of_another_task_set_get_no_verdict():
    """A run on FusionBench's pool beside the SVC and MAGIC papers' rows (task_vectors' checkpoints), and a TALL14 run
    beside the SVC paper's 14-task tables (another 14 tasks merged): values shown, no inside/outside; on its own
    pool a reference row is per task (any task set), a merge row needs the same task set."""
    from mergecal.published import unlike

    svc = rows("svc", "ViT-B/32", "ta8")
    assert {unlike(r, "fusionbench", "ta8") for r in svc} == {"other checkpoints (task_vectors)"}
    assert {unlike(r, "task_vectors", "ta8") for r in svc} == {""}
    assert {unlike(r, None, "ta8") for r in svc} == {"other checkpoints (task_vectors; the preset names no pool)"}
    svc14 = rows("svc", "ViT-B/32", "svc14")
    assert {unlike(r, "svc-authors-14", "tall14") for r in svc14 if r.recipe in ("zeroshot", "finetuned")} == {""}
    assert {unlike(r, "svc-authors-14", "tall14") for r in svc14 if r.recipe not in ("zeroshot", "finetuned")} == \
        {"a merge of another task set (svc14)"}
    params = parse_params({"local_clip": [{"name": "tall", "preset": "fusionbench-clip-vit-b32-tall14"},
                                          {"name": "tv", "preset": "task-vectors-clip-vit-b32-ta8",
                                           "preset_roots": {"checkpoints": "/c", "data": "/d"}}]})
    found = for_tracks(lab_tracks(params))
    assert [{r.unlike for r in paper} for paper in found["tall"]] == [{""}, {"other checkpoints (svc-authors-14)"}]
    assert [{r.unlike for r in paper} for paper in found["tv"]] == [{""}, {""}]
    table = Table("tall", "tall14", "standard", "0", ("cars", "dtd"), (_row("task_arithmetic", 0.7, (0.6, 0.8)),), ())
    other = replace(_published("task_arithmetic", 70.0), unlike="other checkpoints (task_vectors)")
    rep = compare(table, [other])
    assert {c.inside for c in rep.comparisons} == {None} and rep.counts()["inside"] == 0
    assert "— other checkpoints (task_vectors) |" in markdown([rep])
    assert to_json([rep])[0]["comparisons"][0]["unlike"] == "other checkpoints (task_vectors)"


def test_every_transcribed_table_matches_its_stored_fingerprint():
    """A changed number, row name, column order or precision in any table fails here, naming the table; the stored
    digests were written from the transcriptions checked against each source (tests/published_fingerprints.py)."""
    from published_fingerprints import STORED, current

    stored, now = json.loads(STORED.read_text()), current()
    assert set(now) == set(stored)
    changed = [f"{source}: {name}" for source in now
               for name in set(now[source]["tables"]) | set(stored[source]["tables"])
               if now[source]["tables"].get(name) != stored[source]["tables"].get(name)]
    assert not changed, ("changed since checked against the source (python tests/published_fingerprints.py --write "
                         "once checked again): " + "; ".join(sorted(changed)))


def test_the_fingerprint_sees_a_swapped_pair_of_columns_and_a_one_digit_typo():
    import copy

    from published_fingerprints import fingerprints

    data = load("fusionbench")
    before = fingerprints(data)
    name = "Performance of the fine-tuned CLIP-ViT-B/32 models (20 tasks) · ViT-B/32 · tall20"
    typo = copy.deepcopy(data)
    table = next(t for t in typo["tables"] if t["table"].startswith("Performance of the fine-tuned CLIP-ViT-B/32"))
    row = table["rows"][1]
    assert row["per_task"][9] == 87.96
    row["per_task"][9] = 78.96
    swapped = copy.deepcopy(data)
    first = swapped["tables"][0]["rows"][4]  # the B/32 merging table's Simple Averaging row: SUN397 and Cars swapped
    first["per_task"][0], first["per_task"][1] = first["per_task"][1], first["per_task"][0]
    for edited, table in ((typo, name), (swapped, "Multi-task model merging methods using CLIP-ViT-B/32 models · "
                                                   "ViT-B/32 · ta8")):
        after = fingerprints(edited)
        assert [n for n in before if before[n] != after[n]] == [table]


def test_a_preset_turns_on_the_variant_its_own_pools_rows_run_beside_the_matrixs_merge():
    """FusionBench's preset adds ties(scaling=0.3,disjoint='sum') (base none@λ=0.3,disjoint=sum) to its own track
    only, beside the matrix's mean TIES at 0.3, and its Ties-Merging row is compared with it; the SVC and MAGIC rows
    (other checkpoints) add nothing, nor does a lab that already merges TIES with sum."""
    from mergecal.pipeline.cells import enumerate_cells

    benchmark = {"merges": {"task_arithmetic": {"scaling": [0.1, 0.3]}, "ties": {"scaling": [0.1, 0.3]}},
                 "chains": ["{merge}", "{merge}>svc"],
                 "fixed_scaling": [{"scaling": 0.3, "merges": ["task_arithmetic", "ties"], "chains": ["{merge}"]}]}
    own = {"name": "own", "model": {"pretrained": "/c"}, "finetuned": {"MNIST": "/a", "DTD": "/b"},
           "datasets": {"MNIST": "/d", "DTD": "/d"}}
    params = parse_params({"benchmark": benchmark,
                           "local_clip": [{"name": "fb", "preset": "fusionbench-clip-vit-b32-ta8"}, own]})
    labels = {track: [(c.label, c.calibration) for c in enumerate_cells(params) if c.track == f"local_clip:{track}"]
              for track in ("fb", "own")}
    variant = ("ties(scaling=0.3,disjoint='sum')", "none@λ=0.3,disjoint=sum")
    assert labels["fb"] == labels["own"] + [variant]
    summed = {"ties": {"disjoint": "sum", "scaling": [0.1, 0.3]}}
    same = parse_params({"benchmark": {**benchmark, "merges": {**benchmark["merges"], **summed}},
                         "local_clip": [{"name": "fb", "preset": "fusionbench-clip-vit-b32-ta8"}]})
    assert variant[0] not in {c.label for c in enumerate_cells(same)}
    # the report: the sum row matches by its settings, the mean row is a row with no published counterpart
    from mergecal.recipe import Recipe

    fb = [r for r in for_tracks(lab_tracks(params))["fb"][0] if r.recipe in ("ties(scaling=0.3)", "finetuned")]
    rows_here = (replace(_row("ties(scaling=0.3)", 0.6, (0.5, 0.7)), recipe_id=Recipe.parse("ties(scaling=0.3)").id),
                 replace(_row(variant[0], 0.7, (0.6, 0.8)), recipe_id=Recipe.parse(variant[0]).id))
    rep = compare(Table("fb", "ta8", "standard", "0", ("SUN397", "Cars"), rows_here, ()), fb)
    assert {c.recipe for c in rep.comparisons} == {variant[0]} and not [c for c in rep.comparisons if c.unlike]
    assert rep.unmatched_here == ("ties(scaling=0.3)",)
    assert rep.unmatched_published == ("Fine-tuned (STL) (`finetuned`)",)


def test_a_fixed_scaling_row_listed_twice_is_refused_in_one_line():
    from mergecal.errors import ParameterError

    twice = {"merges": {"ties": {"scaling": [0.1, 0.3]}}, "chains": ["{merge}"],
             "fixed_scaling": [{"scaling": 0.3, "chains": ["{merge}", "{merge}>svc"]},
                               {"scaling": 0.3, "merges": ["ties"], "chains": ["{merge}"]}]}
    with pytest.raises(ParameterError) as err:
        parse_params({"benchmark": twice})
    assert str(err.value) == ("params.yaml: benchmark.fixed_scaling[1]: the row ties(scaling=0.3) is listed by "
                              "fixed_scaling[0] already: list each chain at a scaling once")
    with pytest.raises(ParameterError, match=r"fixed_scaling\[0\].settings"):
        parse_params({"benchmark": {"merges": {"ties": {}}, "fixed_scaling": [
            {"scaling": 0.3, "chains": ["{merge}"], "settings": {"disjoint": "median"}}]}})
