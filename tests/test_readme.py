"""The README's library examples run as written."""

import re
from pathlib import Path

import torch


def test_readme_library_examples_run():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    namespace: dict = {}
    for example in re.findall(r"```python\n(.*?)```", text, re.S):  # in order, sharing one namespace
        exec(compile(example, "README.md", "exec"), namespace)
    assert set(namespace["result"].state_dict) == {"w", "b"}
    merged, tau, same = namespace["merged"], namespace["tau"], namespace["same"]
    assert set(merged) == {"w", "b"} and all(torch.isfinite(v).all() for v in merged.values())
    torch.testing.assert_close(same["w"], namespace["pre"]["w"] + tau["w"])
