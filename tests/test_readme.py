"""The README's library examples run as written."""

import re
from pathlib import Path

import torch
import yaml

from mergecal.pipeline.config import parse_params


def test_readme_library_examples_run():
    text = (Path(__file__).parent.parent / "README.md").read_text()
    namespace: dict = {}
    for example in re.findall(r"```python\n(.*?)```", text, re.S):  # in order, sharing one namespace
        exec(compile(example, "README.md", "exec"), namespace)
    assert set(namespace["result"].state_dict) == {"w", "b"}
    merged, tau, same = namespace["merged"], namespace["tau"], namespace["same"]
    assert set(merged) == {"w", "b"} and all(torch.isfinite(v).all() for v in merged.values())
    torch.testing.assert_close(same["w"], namespace["pre"]["w"] + tau["w"])


README = Path(__file__).parent.parent / "README.md"


def test_readme_is_a_short_guide_whose_links_exist():
    """The README stays a newcomer's guide (the manuals live in docs/), and every file it links to exists."""
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert "docs/own-models.md" in links and "docs/references.md" in links
    missing = [link for link in links if not (README.parent / link).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_readme_own_models_example_is_valid_params():
    """The one example per family under "Your own models" validates as params.yaml entries."""
    section = README.read_text().split("## Your own models", 1)[1].split("\n## ", 1)[0]
    example = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    params = parse_params(yaml.safe_load(example))
    assert [t.name for t in params.local_llm] == ["lab-llama-1b"]
    assert [t.name for t in params.local_clip] == ["vitb32-fusionbench"]


def test_readme_test_command_is_what_ci_runs():
    """.ci/run runs the README's commands: `make setup` then `make test`."""
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make setup\nmake test" in ci and "make test" in README.read_text()
