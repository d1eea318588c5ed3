"""DVC stage (papers/dvc.yaml, `make paper`): one report per paper, reports/papers/<paper>.{md,html,json} and
plots/, from the experiment cells' MLflow runs (the invocation stages/paper_cells.py wrote)."""

import json

from stages._common import run


def stage(params, root, args):
    import math

    from mergecal.errors import MergecalError
    from mergecal.pipeline.tracking import resolve_uri
    from mergecal.reports.papers import Outcome, write_paper_reports
    from mergecal.reports.runs import cells_of, load_examples, load_runs

    invocation_file = root / "results" / "papers" / "invocation.json"
    if not invocation_file.is_file():
        raise MergecalError(f"{invocation_file}: missing; run the experiment cells first (dvc repro papers/dvc.yaml)")
    invocation = json.loads(invocation_file.read_text())["invocation_id"]
    uri = resolve_uri(root, params.tracking)
    cells = cells_of(load_runs(uri, params.tracking.experiment), invocation)
    ok = cells[cells["status"] == "ok"]
    outcomes = {}
    for _, row in ok.iterrows():
        metrics = {k[len("metrics."):]: float(v) for k, v in row.items()
                   if k.startswith("metrics.") and isinstance(v, float) and not math.isnan(v)}
        outcomes[row["cell_id"]] = Outcome(metrics, load_examples(uri, row["artifact_uri"]))
    analysis_file = root / "results" / "papers" / "analysis.json"  # stages/paper_analysis.py
    analysis = json.loads(analysis_file.read_text()) if analysis_file.is_file() else None
    significance_file = root / "results" / "papers" / "significance.json"  # stages/paper_significance.py
    significance = json.loads(significance_file.read_text()) if significance_file.is_file() else None
    written = write_paper_reports(params, root, outcomes, root / "reports" / "papers", analysis, significance)
    print(f"{len(written)} files under {root / 'reports' / 'papers'} from {len(outcomes)} cells of invocation "
          f"{invocation}: " + ", ".join(n for n in written if not n.startswith("plots/")))


if __name__ == "__main__":
    raise SystemExit(run(stage))
