"""What every source of the CLIP family shares at the stages (``built``: the vision track, a small open_clip ViT
the pipeline pretrains and fine-tunes; ``files``: the ``local_clip`` tracks, a lab's checkpoints and datasets read
in place): the classifier DisTaC and the probe train and score (a CLIP with one task's frozen zero-shot head), and
the check of a DisTaC stage's conditioned checkpoint. What the cells share is ``session`` (kept apart, so that the
stages do not depend on the cells' code). A source never imports another; this module imports none."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ....errors import CheckpointError


class TaskHeadModel(torch.nn.Module):
    """A CLIP classifying with one task's frozen zero-shot head: logits = scale * norm(f(x)) @ W. Its state
    dict keys are the CLIP's (the head is a buffer that is not saved), as DisTaC needs."""

    def __init__(self, clip: torch.nn.Module, head: torch.Tensor):
        super().__init__()
        self.clip = clip
        self.register_buffer("head", head.detach().clone(), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
        from ....backbones.open_clip_vit import logits

        return logits(self.clip, self.head, images)

    def state_dict(self, *args, **kwargs):  # the CLIP's own key names
        return self.clip.state_dict(*args, **kwargs)

    def load_state_dict(self, state, strict: bool = True, assign: bool = False):
        return self.clip.load_state_dict(state, strict=strict, assign=assign)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.clip.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)


def check_distac_file(path: Path, expected: dict, against: str) -> None:
    """A DisTaC stage's conditioned checkpoint (this module's ``distac``,
    ``mergecal.pipeline.tracks.clip.files.calibration``) whose recorded step (its ``distac`` metadata) is
    ``expected``: one CheckpointError naming ``path`` otherwise (``against``: where ``expected`` comes from, for
    the message)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as fh:
            stored = json.loads((fh.metadata() or {}).get("distac", "null"))
    except (OSError, SafetensorError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a readable DisTaC checkpoint ({err})") from None
    if stored != expected:
        raise CheckpointError(f"{path}: DisTaC parameters differ from {against} (rerun `dvc repro`)")

