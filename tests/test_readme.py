"""The README's library example runs as written."""

import re
from pathlib import Path

import torch


def test_readme_library_example_runs():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    example = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    namespace: dict = {}
    exec(compile(example, "README.md", "exec"), namespace)
    merged, tau, same = namespace["merged"], namespace["tau"], namespace["same"]
    assert set(merged) == {"w", "b"} and all(torch.isfinite(v).all() for v in merged.values())
    torch.testing.assert_close(same["w"], namespace["pre"]["w"] + tau["w"])
