"""#55: the default tier passes in a checkout that a run has populated, not only in a clean clone: a test that reads
the workspace (a run's outputs beside the committed files) fails here, in CI, and not at a newcomer's `make test`
after `make run`. (tests/populated_checkout.py says how it is built, and how to build it by hand.)"""

import re

import pytest

from populated_checkout import copy_checkout, default_tier, populate

pytestmark = pytest.mark.slow


def test_the_default_tier_passes_in_a_checkout_a_run_populated(tmp_path):
    checkout = copy_checkout(tmp_path / "checkout")
    populate(checkout)
    assert (checkout / "results" / "benchmark.json").exists()  # populated: the benchmark ran there
    assert list((checkout / "models" / "tiny-llama" / "seeds" / "0" / "experts").iterdir())
    run = default_tier(checkout)
    failed = re.findall(r"^(?:FAILED|ERROR) .*$", run.stdout, flags=re.M)
    assert run.returncode == 0, "\n".join(failed) or run.stdout[-6000:]
