"""DVC stage (papers/dvc.yaml, `make paper`): the papers' experiments (mergecal/experiments) as cells of the
benchmark, through the same Prefect flow, cell ids and cache as the default matrix (every cell it shares with the
matrix is reused); writes results/papers/ (benchmark.json, and invocation.json which no stage declares)."""

from stages._common import run

OUTPUT = "results/papers/benchmark.json"


def stage(params, root, args):
    from mergecal.errors import MergecalError
    from mergecal.pipeline.experiments import paper_cells
    from mergecal.pipeline.flow import run_benchmark

    cells, _ = paper_cells(params, root)
    print(f"the papers' experiments: {len(cells)} cells (those the default matrix runs are reused)")
    result = run_benchmark(params_path=args.params, root=str(root), output=OUTPUT, cells=cells, profile="paper")
    if result["failed"] == result["cells"]:
        raise MergecalError(f"every one of the {result['cells']} experiment cells failed; see MLflow "
                            f"({result['tracking_uri']})")


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
