"""DVC stage: leaderboards (Markdown, HTML, JSON), diagnostic plots and the rerun history, from MLflow."""

import json

from stages._common import run


def stage(params, root, args):
    from mergecal.pipeline.results import INVOCATION_FILE
    from mergecal.pipeline.tracking import resolve_uri
    from mergecal.pipeline.track_registry import lab_tracks
    from mergecal.published import for_tracks
    from mergecal.reports.write import write_reports
    from mergecal.reports.stability import read_document

    testbed = root / "reports" / "testbed.md"
    # the invocation that wrote results/benchmark.json (the flow writes its id beside it); else the latest
    run_file = root / "results" / INVOCATION_FILE
    invocation = json.loads(run_file.read_text())["invocation_id"] if run_file.exists() else None
    written = write_reports(resolve_uri(root, params.tracking), params.tracking.experiment, root / "reports",
                            invocation, testbed=testbed.read_text() if testbed.exists() else None,
                            stability=read_document(root / "reports" / "stability.json"),  # stages/stability.py
                            published=for_tracks(lab_tracks(params)))  # a preset track's published rows
    print(f"{len(written)} report files for invocation {invocation}; leaderboard: "
          f"{root / 'reports' / 'leaderboard.html'}, history: {root / 'reports' / 'history.html'}")


if __name__ == "__main__":
    raise SystemExit(run(stage))
