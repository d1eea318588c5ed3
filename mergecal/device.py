"""Which torch device to compute on: one resolver for the library, the trainers, the evaluators and the pipeline."""

from __future__ import annotations

import torch

from .errors import ParameterError


def resolve_device(device: str | torch.device | None) -> str:
    """``None`` -> ``"cpu"``; ``"auto"`` -> ``"cuda"`` when a GPU is present, else ``"cpu"``; ``cpu``, ``cuda`` and
    ``cuda:N`` as given, checked against this machine (a one-line ParameterError otherwise)."""
    if device is None:
        return "cpu"
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):  # torch's message is several lines about every backend it knows
        raise ParameterError(f"device={device!r}: expected auto, cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise ParameterError(f"device={str(device)!r}: expected auto, cpu, cuda or cuda:N")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ParameterError(f"device={str(device)!r}: CUDA was requested but torch.cuda.is_available() is False")
    if parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ParameterError(f"device={str(device)!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return str(parsed)
