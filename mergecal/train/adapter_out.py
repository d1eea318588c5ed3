"""Saving a peft adapter as a fine-tune's output: ``adapter_config.json`` + ``adapter_model.safetensors`` and
``training.json``, written atomically, with bytes that do not depend on where the checkout lies.

peft writes the base's path as given (absolute in a DVC stage) into ``adapter_config.json`` and a model card
(``README.md``, peft's template, read by nothing): the config names the base as the caller says (``base_name``:
relative to the checkout in the pipeline) and the card is not kept."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..outputs import OutputDir, remove_stale

METADATA_FILE = "training.json"


def save_adapter(model, out_dir: str | os.PathLike, *, base: str | os.PathLike, base_name: str | None,
                 metadata: dict) -> Path:
    """Write the adapter of the peft ``model`` (trained on the base at ``base``) to ``out_dir``; the config names
    the base ``base_name`` (None: ``base`` as given)."""
    remove_stale(out_dir)
    with OutputDir(out_dir, inputs=[base]) as staging:
        model.save_pretrained(str(staging), safe_serialization=True)
        config_path = staging / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = str(base) if base_name is None else base_name
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
        (staging / "README.md").unlink(missing_ok=True)
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2))
    return Path(out_dir)
