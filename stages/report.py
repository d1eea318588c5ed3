"""DVC stage: leaderboards (Markdown, HTML, JSON), diagnostic plots and the rerun history, from MLflow."""

from stages._common import run


def stage(params, root, args):
    from mergecal.pipeline.tracking import tracking_uri
    from mergecal.reports import write_reports

    testbed = root / "reports" / "testbed.md"
    written = write_reports(tracking_uri(root, params.tracking.store), params.tracking.experiment, root / "reports",
                            testbed=testbed.read_text() if testbed.exists() else None)
    print(f"{len(written)} report files; leaderboard: {root / 'reports' / 'leaderboard.html'}")


if __name__ == "__main__":
    raise SystemExit(run(stage))
