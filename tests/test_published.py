"""Published rows (#42, step 4): the SVC paper's Tables 5-10, the MAGIC paper's Tables I-III and FusionBench's
documented numbers for its own pools as transcribed are consistent with themselves (each printed average is the
mean of its printed per-task numbers up to their rounding, each printed gain the difference of two printed
averages; the sources' own slips named) and the SVC paper's with its Table 1 (two disagreements, named); a
leaderboard table built from a preset is compared row by row with them (inside / outside a run's interval,
allowing the printed rounding: 0.05 point, 0.005 for a two-decimal table), and the report writes that section."""

from __future__ import annotations

import json

import pytest

from mergecal.pipeline.config import parse_params
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
                assert row["chain"] != "{merge}" and round(row["average"] - base[key][0], 1) == row["gain"], row
                checked += 1
            elif "gains" in row:  # one a column
                assert row["chain"] != "{merge}" and len(row["gains"]) == len(tasks), row
                for task, value, before, gain in zip(tasks, row["per_task"], base[key][1], row["gains"]):
                    difference = round(value - before, 1)
                    assert abs(difference - gain) <= 0.1 + 1e-9, (row, task)  # rounding, at most
                    if difference != gain:
                        off_columns.append((str(table["table"]), row["row"], task, difference, gain))
                    checked += 1
            elif row["chain"] == "{merge}":
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
        assert recipes == ["zeroshot", "finetuned", "weight_averaging", "task_arithmetic(scaling=0.3)",
                           "ties(scaling=0.3)"]
        for merge in ("task_arithmetic", "ties"):  # the fixed-scaling cell's label, not the searched one's
            assert labels[(merge, False)] in recipes and labels[(merge, True)] not in recipes
            assert Recipe.parse(labels[(merge, False)]).steps[0].params.scaling == 0.3
        assert {r.decimals for r in found} == {1}
    b32 = rows("fusionbench", "ViT-B/32", "ta8")
    assert cite(b32) == ("FusionBench's documentation, docs/modelpool/clip_vit.md (tanganke/fusion_bench at "
                         "26ffec5), table “Multi-task model merging methods using CLIP-ViT-B/32 models” "
                         "(its paper: arXiv:2406.03280)")
    assert len([r for r in b32 if r.recipe is None]) == 12  # RegMean, AdaMerging, WEMoE, ...: not mergecal's


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
    assert [r.recipe for r in magic][-1] == "task_arithmetic>wsc"
    # the two papers agree on GSM8K for three of six merges
    gsm8k = {p.recipe: p.per_task[1] for p in svc}
    assert [p.recipe for p in magic if p.recipe in gsm8k and p.per_task[1] == gsm8k[p.recipe]] == \
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
    assert [r.recipe for r in b16][:5] == ["zeroshot", "finetuned", "task_arithmetic", "task_arithmetic>svc", "dare"]
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
    # FusionBench's own numbers for its pool first, then the papers'
    assert for_tracks(params) == {"fb16": [rows("fusionbench", "ViT-B/16", "ta8"), b16,
                                           rows("magic", "ViT-B/16", "ta8")]}
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
    assert rep.unmatched_published == ("STAR",) and rep.unmatched_here == ("consensus",)
    assert rep.counts() == {"inside": 2, "outside": 2, "no_interval": 5, "published_without_row": 1,
                            "rows_without_published": 1}  # cars inside (70 in [68, 72]) x1, outside (60) x2 ...
    text = markdown([rep])
    assert "## Published: fb · ta8 · standard" in text and "Against A paper (arXiv:0000.00000), Table 5." in text
    assert "| `task_arithmetic>svc` | TASK_ARITHMETIC>SVC | avg | 81.1 | 80.0 [79.0, 81.0] | **no** |" in text
    assert ("Reproduction over 9 compared values: 2 inside their interval, 2 outside, 5 without an interval; "
            "published rows with no row here: STAR; rows here with no published counterpart: `consensus`.") in text
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
