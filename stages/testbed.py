"""DVC stage: the vision testbed's health (mergecal.pipeline.testbed), read before any calibration row."""

import json

from stages._common import device, run


def stage(params, root, args):
    from mergecal.checkpoint import atomic_write_text
    from mergecal.pipeline.testbed import health_markdown, vision_health

    results = json.loads((root / "results" / "benchmark.json").read_text())
    health = vision_health(params, root, results, device=device(params))
    atomic_write_text(root / "reports" / "testbed.json", json.dumps(health, indent=2, sort_keys=True) + "\n")
    text = health_markdown(health)
    atomic_write_text(root / "reports" / "testbed.md", text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(run(stage, threads=True))
