"""Shared start-up of the DVC stage scripts: offline settings, params.yaml, one-line errors."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path



def setup_env(root: Path) -> None:
    """Must run before prefect/mlflow are imported: their settings are read at import time."""
    from mergecal import offline

    offline.apply()
    home = root / ".mergecal" / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(home))


def run(stage: Callable, argv: list[str] | None = None, *, threads: bool = False) -> int:
    """``stage(params, root, args)`` with params.yaml loaded; MergecalErrors become one line and exit 2.
    ``threads``: the stage trains or evaluates with torch, whose bits depend on its thread count: pin it to
    params.yaml's ``threads`` first (dvc.yaml lists ``threads`` in the stage's params; a test checks both)."""
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=".")
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--task")
    parser.add_argument("--variant")
    parser.add_argument("--regime", help="a regime of the papers' profile (vision.paper_regimes)")
    parser.add_argument("--seed", type=int, help="a per-seed stage's fine-tuning seed (one of params.yaml's seeds)")
    args = parser.parse_args(argv)
    root = Path(args.root).resolve()
    setup_env(root)
    from mergecal.errors import MergecalError, ParameterError
    from mergecal.pipeline.config import load_params

    try:
        params = load_params(root / args.params)
        if args.seed is not None and args.seed not in params.seeds:
            raise ParameterError(f"--seed {args.seed}: not one of {args.params}'s seeds {params.seeds}")
        if threads:
            from mergecal.pipeline.threads import pin_threads

            pin_threads(params.threads, interop=True)
        stage(params, root, args)
    except MergecalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


def device(params) -> str:
    from mergecal.device import resolve_device

    return resolve_device(params.device)
