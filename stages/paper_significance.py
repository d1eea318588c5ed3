"""DVC stage (papers/dvc.yaml, `make paper`): MAGIC's all-subsets significance test (the `significance:` entries of
mergecal/experiments/<paper>.yaml) on the vision track's models; writes results/papers/significance.json.

Each test merges every subset of at least two of the K experts with and without its calibration, as the
benchmark's own cells at the test's fixed scaling (mergecal/pipeline/paper_significance.py): for K = 8, 247 subsets
for TA at 0.3 against TA>DSC, TA at 1.0 against TA>SVC and TA at 0.3 against DisTaC>TA under low confidence, and
127 (those holding the lengthened task) for DisTaC under the norm mismatch: 1,736 cells in all.

Cost (K = 8, `runner.max_workers` = 2 one-thread workers, the 2-core machine): the two tests MAGIC's and SVC's took
about 1,500 CPU-seconds, about 13 min of wall time when the machine is otherwise idle. Measured as CPU time per
cell on the testbed's models (one thread): task arithmetic 0.55 s on 2 experts to 1.9 s on 8, TA>DSC 1.1 to 3.0 s,
TA>SVC 1.9 to 3.2 s, most of it scoring the subset's test images (DisTaC's cells read conditioned models and merge
as task arithmetic does); the full run's first 49 subsets (the largest) took 196 CPU-seconds against 206
predicted. Those measurements ran beside another pipeline (load 10-15 on the 2 cores), so their wall time was 4-7x
their CPU time; on such a shared machine the stage takes that much longer. The four tests' wall time, measured
in a full `make paper`: docs/performance.md, "The significance tests".
"""

import json

from stages._common import device, run


def stage(params, root, args):
    from mergecal.checkpoint import atomic_write_text
    from mergecal.pipeline.paper_significance import load_significance, significance_document

    tests = [t for found in load_significance().values() for t in found]
    document = significance_document(params, root, tests, device=device(params))
    path = atomic_write_text(root / "results" / "papers" / "significance.json",
                             json.dumps(document, indent=1, sort_keys=True, allow_nan=False) + "\n")
    print(f"{path}: " + "; ".join(f"{name}: {len(entry['subsets'])} subsets, t = {entry['summary']['t']}, "
                                  f"p = {entry['summary']['p']}" for name, entry in document.items()))


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
