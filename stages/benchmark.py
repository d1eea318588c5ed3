"""DVC stage: run the Prefect benchmark flow over every cell (MLflow-tracked); writes results/."""

from stages._common import run


def stage(params, root, args):
    from mergecal.pipeline.flow import run_benchmark

    result = run_benchmark(params_path=args.params, root=str(root))
    if result["failed"] == result["cells"]:
        from mergecal.errors import MergecalError

        raise MergecalError(f"every one of the {result['cells']} cells failed; see MLflow ({result['tracking_uri']})")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
