"""The catalogue of the papers' tables and figures (mergecal/experiments/catalogue.yaml): complete, each status
with its detail, each item the papers' profile regenerates held to its experiment and its committed report section,
and docs/papers.md its rendering."""

from __future__ import annotations

from pathlib import Path

import pytest

from mergecal.experiments import read
from mergecal.pipeline.experiments import load_analyses, load_comparisons, load_experiments, load_measurements
from mergecal.pipeline.paper_significance import load_significance
from mergecal.presets import PRESETS
import scripts.catalogue as catalogue

ITEMS = read("catalogue")["items"]
REPORTS = Path("reports/papers")


def test_every_item_is_listed_once_with_its_statuses_detail():
    ids = [i["id"] for i in ITEMS]
    assert len(ids) == len(set(ids)) == 60
    assert {p: sum(i["paper"] == p for i in ITEMS) for p in catalogue.PAPERS} == {"svc": 23, "magic": 22,
                                                                                   "distac": 15}
    for item in ITEMS:
        assert {"id", "paper", "item", "shows", "claim", "needs", "status"} <= item.keys(), item["id"]
        assert item["id"].startswith(item["paper"] + "."), item["id"]
        assert item["status"] in catalogue.STATUSES, item["id"]
        keys = catalogue.DETAIL[item["status"]]
        assert any(k in item for k in (keys if isinstance(keys, tuple) else (keys,))), item["id"]
        if "preset" in item:
            named = item["preset"] if isinstance(item["preset"], list) else [item["preset"]]
            assert set(named) <= set(PRESETS), item["id"]


def test_each_item_the_papers_profile_regenerates_is_an_experiment_with_its_committed_report_section():
    loaded = (load_experiments(), load_analyses(), load_measurements(), load_comparisons(), load_significance())
    experiments = {e.id: paper for found in loaded for paper, items in found.items() for e in items}
    profiled = {i["id"]: i for i in ITEMS if i["status"] in ("paper", "measured")}
    assert set(profiled) == set(experiments)  # every experiment is catalogued, every such item runs
    named = {e.id: e.item for found in loaded for items in found.values() for e in items}
    for item_id, item in profiled.items():
        assert item["section"] == item_id and named[item_id] == item["item"], item_id
        report = (REPORTS / f"{item['paper']}.md").read_text()
        assert f"## {item_id}: {item['item']}" in report, item_id


@pytest.mark.parametrize("paper", ["svc", "magic", "distac"])
def test_every_claim_of_a_committed_report_has_its_computed_sentence(paper):
    report = (REPORTS / f"{paper}.md").read_text()
    for experiment in (load_experiments((paper,))[paper] + load_analyses((paper,))[paper]
                       + load_comparisons((paper,))[paper] + load_significance((paper,))[paper]):
        for claim in experiment.claims:
            assert f"“{claim.text}”: " in report, (experiment.id, claim.text)


def test_the_docs_page_is_the_catalogues_rendering():
    assert catalogue.main(["--check"]) == 0
