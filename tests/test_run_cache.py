"""mergecal.reports.run_cache: a board that keeps what it read asks the store only for what is new, and reads the
same runs as one that reads them all."""

import json

import pandas as pd

from mergecal.pipeline.tracking import Tracker, tag
from mergecal.reports import run_cache
from mergecal.reports.runs import load_examples, load_runs


def _invocation(tracker: Tracker, name: str, cells: list[str], reused: dict[str, str] | None = None) -> str:
    parent = tracker.start_invocation(name, {}, {})
    manifest = {}
    for cell in cells:
        run_id = tracker.log_cell(parent_run_id=parent, invocation_id=name, cell_id=cell,
                                  tags={tag("regime"): "standard", tag("recipe"): "ties", tag("merge"): "ties"},
                                  params={"p": "1"}, metrics={"avg_acc": 0.5, "acc.a": 0.25}, artifacts={},
                                  examples={"a": [1.0, 0.0]})
        manifest[cell] = {"status": "ok", "run_id": run_id, "cached": False}
    for cell, run_id in (reused or {}).items():
        manifest[cell] = {"status": "ok", "run_id": run_id, "cached": True}
    tracker.finish_invocation(parent, manifest, {})
    return parent


def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(a.reset_index(drop=True), b.reset_index(drop=True), check_like=True)


def test_a_cached_board_reads_what_a_full_one_reads_and_asks_only_for_the_new(tmp_path, monkeypatch):
    uri, cache = f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "cache"
    tracker = Tracker(tmp_path, uri=uri, artifacts=(tmp_path / "artifacts").as_uri())
    _invocation(tracker, "i1", ["c1", "c2"])
    first = load_runs(uri, "mergecal", cache_dir=cache)
    _same(first, load_runs(uri, "mergecal"))
    [path] = cache.glob("runs-*.json")
    assert len(json.loads(path.read_text())["rows"]) == 3 and len(json.loads(path.read_text())["manifests"]) == 1

    # a new invocation reusing c1: the store is asked for runs since the newest kept (the slack's), not all
    c1 = first.loc[first["cell_id"] == "c1", "run_id"].item()
    _invocation(tracker, "i2", ["c3"], reused={"c1": c1})
    asked = []
    refresh = run_cache.RunCache.refresh

    def counted(self, *args):
        rows = refresh(self, *args)
        asked.append(self.asked)
        return rows

    monkeypatch.setattr(run_cache.RunCache, "refresh", counted)
    second = load_runs(uri, "mergecal", cache_dir=cache)
    _same(second, load_runs(uri, "mergecal"))
    assert (second["cached"] & (second["invocation_id"] == "i2")).sum() == 1  # the reused cell, from i2's manifest
    monkeypatch.setattr(run_cache, "SLACK_MS", 0)
    load_runs(uri, "mergecal", cache_dir=cache)
    assert asked[-1] == 1  # only the newest run itself (start_time >= the newest kept)

    # a deleted run leaves the cached board too; an unended run is asked for again until it ends
    tracker.client.delete_run(second.loc[second["cell_id"] == "c3", "run_id"].item())
    running = tracker.client.create_run(tracker.experiment_id, tags={tag("kind"): "cell", tag("cell_id"): "c9"})
    third = load_runs(uri, "mergecal", cache_dir=cache)
    _same(third, load_runs(uri, "mergecal"))
    assert "c3" not in set(third["cell_id"]) and third.loc[third["cell_id"] == "c9", "run_status"].item() == "RUNNING"
    tracker.client.set_terminated(running.info.run_id, "FAILED")
    assert load_runs(uri, "mergecal", cache_dir=cache).loc[lambda f: f["cell_id"] == "c9", "run_status"].item() == \
        "FAILED"


def test_a_cache_of_another_reader_or_unreadable_is_rebuilt(tmp_path):
    uri, cache = f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "cache"
    tracker = Tracker(tmp_path, uri=uri, artifacts=(tmp_path / "artifacts").as_uri())
    _invocation(tracker, "i1", ["c1"])
    load_runs(uri, "mergecal", cache_dir=cache)
    [path] = cache.glob("runs-*.json")
    for text in ("{not json", json.dumps({"fingerprint": "other", "rows": {"x": {}}})):
        path.write_text(text)
        _same(load_runs(uri, "mergecal", cache_dir=cache), load_runs(uri, "mergecal"))


def test_examples_are_read_once_per_finished_run(tmp_path, monkeypatch):
    uri, cache = f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "cache"
    tracker = Tracker(tmp_path, uri=uri, artifacts=(tmp_path / "artifacts").as_uri())
    _invocation(tracker, "i1", ["c1"])
    cell = load_runs(uri, "mergecal").loc[lambda f: f["cell_id"] == "c1"].iloc[0]
    assert load_examples(uri, cell["artifact_uri"], cache, cell["run_id"]) == {"a": [1.0, 0.0]}
    monkeypatch.setattr("mergecal.reports.runs._load_json_artifacts", lambda *a: (_ for _ in ()).throw(AssertionError))
    assert load_examples(uri, cell["artifact_uri"], cache, cell["run_id"]) == {"a": [1.0, 0.0]}  # not read again


def test_the_lab_board_from_its_cache_is_the_board_read_whole(tmp_path):
    from mergecal.reports.lab import write_lab_reports

    uri, cache = f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "cache"
    tracker = Tracker(tmp_path, uri=uri, artifacts=(tmp_path / "artifacts").as_uri())
    _invocation(tracker, "i1", ["c1", "c2"])
    write_lab_reports(uri, None, tmp_path / "warm", cache_dir=cache)  # builds the cache
    _invocation(tracker, "i2", ["c3"])
    cached = write_lab_reports(uri, None, tmp_path / "warm", cache_dir=cache)
    whole = write_lab_reports(uri, None, tmp_path / "whole")
    assert {n: p.read_text() for n, p in cached.items()} == {n: p.read_text() for n, p in whole.items()}
    assert "from 2 invocation(s)" in cached["lab-leaderboard.md"].read_text()  # the new one is on it
