"""DVC stage: run the Prefect benchmark flow over every cell (MLflow-tracked); writes results/ (the summary, and the
task-arithmetic rows the stability stage reads: mergecal.pipeline.stability_inputs)."""

import json

from stages._common import run


def stage(params, root, args):
    from mergecal.checkpoint import atomic_write_text
    from mergecal.errors import MergecalError
    from mergecal.pipeline import stability_inputs
    from mergecal.pipeline.flow import run_benchmark
    from mergecal.pipeline.track_registry import enabled_tracks

    # a track whose models another profile builds (seq2seq: make paper) says so before any cell runs
    for track in enabled_tracks(params):
        reason = getattr(track, "unbuilt", lambda params, root: None)(params, root)
        if reason is not None:
            raise MergecalError(reason)
    result = run_benchmark(params_path=args.params, root=str(root))
    if result["failed"] == result["cells"]:
        raise MergecalError(f"every one of the {result['cells']} cells failed; see MLflow ({result['tracking_uri']})")
    summary = json.loads((root / "results" / "benchmark.json").read_text())
    atomic_write_text(root / stability_inputs.PATH,
                      json.dumps(stability_inputs.task_arithmetic_rows(summary), indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
