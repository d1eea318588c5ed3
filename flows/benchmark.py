"""The benchmark flow's command line (``python -m flows.benchmark``). The flow itself lives in the installed
package, ``mergecal.pipeline.flow``, so that Dask workers and Prefect workers on other hosts import it by name."""

from mergecal.pipeline.flow import benchmark, main, run_benchmark

__all__ = ["benchmark", "main", "run_benchmark"]

if __name__ == "__main__":
    raise SystemExit(main())
