"""DVC stage: each track's stability under 1e-6 relative weight noise (mergecal.pipeline.stability) and each vision
regime's under a refit of one fine-tune at another thread count (mergecal.pipeline.refit_stability)."""

import json

from stages._common import device, run


def stage(params, root, args):
    from mergecal.checkpoint import atomic_write_text
    from mergecal.pipeline.refit_stability import measure_refits
    from mergecal.pipeline.stability import measure, read_results
    from mergecal.reports.stability import stability_markdown
    from mergecal.pipeline.stability_inputs import PATH

    results = read_results(root / PATH)  # the benchmark's task-arithmetic rows: all that both diagnostics read
    document = {**measure(params, root, results, device=device(params)),
                "refits": measure_refits(params, root, results, device=device(params))}
    text = stability_markdown(document)
    # both files rendered before either is written: a failure leaves the previous pair
    atomic_write_text(root / "reports" / "stability.json", json.dumps(document, indent=2, sort_keys=True) + "\n")
    atomic_write_text(root / "reports" / "stability.md", text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
