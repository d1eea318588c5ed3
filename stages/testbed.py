"""DVC stage: the vision testbed's health (mergecal.pipeline.testbed), read before any calibration row."""

import json

from stages._common import device, run


def stage(params, root, args):
    from mergecal.checkpoint import atomic_write_text
    from mergecal.pipeline.testbed import testbed_document, testbed_markdown

    results = json.loads((root / "results" / "benchmark.json").read_text())
    health = testbed_document(params, root, results, device=device(params))  # every fine-tuning seed's
    atomic_write_text(root / "reports" / "testbed.json", json.dumps(health, indent=2, sort_keys=True) + "\n")
    text = testbed_markdown(health)
    atomic_write_text(root / "reports" / "testbed.md", text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
