"""CLIP checkpoints in any supported layout, opened lazily in open_clip's: a safetensors file or index, a Hugging
Face CLIP (or CLIPVisionModel) directory, open_clip and task_vectors state dicts; a pickled file only on request.

Checkpoints are read in open_clip's layout whatever their own (``OpenClipLayoutSource``), key by key from
safetensors; a pickled file (``.pt``, ``.pth``, ``.bin``, ``.ckpt``) is refused before it is opened unless
``allow_unsafe_pickle`` (it is then loaded whole, the warning naming it). A fine-tuned checkpoint must hold the
pretrained image encoder's keys with its shapes; a Hugging Face CLIPVisionModel has no projection
(``visual.proj``), which is then the pretrained one, as in FusionBench. ``VisualView`` gives an image encoder's
keys in float32, the merge's compute dtype; ``build_model`` an open_clip model with a checkpoint's weights.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import torch

from ..checkpoint import (INDEX_SUFFIX, PICKLE_SUFFIXES, DictSource, SafetensorsSource, safetensors_files,
                          weights_candidates)
from ..errors import CheckpointError, MergecalError
from .clip_layouts import OpenClipLayoutSource
from .loading import load_weights_file


VISUAL = "visual."


PROJECTION = "visual.proj"  # absent from a CLIPVisionModel: the pretrained one is kept


def open_checkpoint(path: Path, *, allow_unsafe_pickle: bool = False):
    """A checkpoint file or HF directory as a lazy ``TensorSource`` in open_clip's layout. A pickled file is
    refused from its name, before a byte of it is read, unless ``allow_unsafe_pickle``."""
    if not path.exists():
        raise CheckpointError(f"{path}: checkpoint not found (nothing is downloaded; give a local file or directory)")
    if path.is_file() and path.suffix in PICKLE_SUFFIXES:
        if not allow_unsafe_pickle:
            raise CheckpointError(f"{path}: a pickled checkpoint; unpickling can run arbitrary code, so it is not "
                                  "read: convert it to safetensors, or set allow_unsafe_pickle: true on the track "
                                  "for a file you trust")
        warnings.warn(f"{path}: unpickling (allow_unsafe_pickle: true); this runs any code the file holds",
                      stacklevel=2)
        try:
            state = load_weights_file(path, allow_unsafe_pickle=True)
        except (ImportError, AttributeError) as err:  # a pickled module whose class is not importable here
            raise CheckpointError(f"{path}: cannot unpickle ({type(err).__name__}: {err}); put the code that "
                                  "saved it (e.g. task_vectors' src/) on PYTHONPATH, or convert it") from None
        return OpenClipLayoutSource(DictSource(state, str(path)), str(path))
    return OpenClipLayoutSource(SafetensorsSource(path), str(path))


def register_hf_arch(directory: Path) -> str:
    """The open_clip architecture of a Hugging Face CLIP directory (from its config.json), registered under a
    name derived from that config."""
    import open_clip
    from transformers import CLIPConfig

    if not directory.is_dir():
        raise CheckpointError(f"{directory}: checkpoint not found (nothing is downloaded; give a local file or "
                              "directory)")
    try:
        config = CLIPConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise CheckpointError(f"{directory}: not a Hugging Face CLIP directory ({str(err).splitlines()[0]})") from None
    v, t = config.vision_config, config.text_config
    if v.hidden_act != t.hidden_act or v.hidden_act not in ("quick_gelu", "gelu"):
        raise CheckpointError(f"{directory}/config.json: activation {v.hidden_act!r}/{t.hidden_act!r}; open_clip "
                              "builds quick_gelu or gelu towers")
    cfg = {"embed_dim": config.projection_dim, "quick_gelu": v.hidden_act == "quick_gelu",
           "vision_cfg": {"image_size": v.image_size, "patch_size": v.patch_size, "layers": v.num_hidden_layers,
                          "width": v.hidden_size, "head_width": v.hidden_size // v.num_attention_heads,
                          "mlp_ratio": v.intermediate_size / v.hidden_size},
           "text_cfg": {"context_length": t.max_position_embeddings, "vocab_size": t.vocab_size,
                        "width": t.hidden_size, "heads": t.num_attention_heads, "layers": t.num_hidden_layers,
                        "mlp_ratio": t.intermediate_size / t.hidden_size}}
    name = "hf-clip-" + hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:12]
    if name not in open_clip.list_models():
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mergecal-archs-") as tmp:
            (Path(tmp) / f"{name}.json").write_text(json.dumps(cfg))
            open_clip.add_model_config(Path(tmp) / f"{name}.json")
    return name


class VisualView:
    """The image-encoder keys of a checkpoint in float32 (the merge's compute dtype, so that a float16
    pretrained and float32 fine-tuned checkpoints compare); ``fill`` gives the keys it lacks
    (``visual.proj`` of a CLIPVisionModel: the pretrained one)."""

    def __init__(self, source, keys: list[str], fill=None):
        self.source, self.name, self._keys, self.fill = source, source.name, keys, fill
        self._own = set(source.keys())
        self._shape = {k: tuple((source if k in self._own else fill).shape(k)) for k in keys}

    def keys(self) -> list[str]:
        return list(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._shape[key]

    def dtype(self, key: str) -> torch.dtype:
        return torch.float32

    def get(self, key: str) -> torch.Tensor:
        return (self.source if key in self._own else self.fill).get(key).float()


def visual_keys(source) -> list[str]:
    return [k for k in source.keys() if k.startswith(VISUAL) and source.dtype(k).is_floating_point]


def pretrained_visual(pre) -> VisualView:
    keys = visual_keys(pre)
    if not keys:
        raise CheckpointError(f"{pre.name}: no image-encoder keys (visual.* / vision_model.*)")
    return VisualView(pre, keys)


def finetuned_visual(pre, path: Path, *, allow_unsafe_pickle: bool = False) -> VisualView:
    """A fine-tuned checkpoint's image encoder over the pretrained one's keys, checked from headers: the same
    keys (a missing projection excepted) and shapes, else one line naming the file and the first key."""
    ft = open_checkpoint(path, allow_unsafe_pickle=allow_unsafe_pickle)
    wanted, own = visual_keys(pre), set(visual_keys(ft))
    if not own:
        raise CheckpointError(f"{path}: no image-encoder keys (visual.* / vision_model.*): not a CLIP image encoder")
    extra = sorted(own - set(wanted))
    missing = [k for k in wanted if k not in own and k != PROJECTION]
    if extra or missing:
        key, where = (extra[0], "is not in") if extra else (missing[0], "is missing, though it is in")
        raise CheckpointError(f"{path}: architecture differs from the pretrained model: key {key!r} {where} "
                              f"{pre.name}")
    for key in sorted(own):
        if tuple(ft.shape(key)) != tuple(pre.shape(key)):
            raise CheckpointError(f"{path}: architecture differs from the pretrained model: key {key!r} has shape "
                                  f"{tuple(ft.shape(key))}, {tuple(pre.shape(key))} in {pre.name}")
    return VisualView(ft, wanted, fill=pre)


def build_model(arch: str, pre) -> torch.nn.Module:
    """``arch`` with the pretrained weights, copied key by key into the model (no second copy in memory)."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .open_clip_vit import create_clip

    try:
        model = create_clip(arch, seed=0)
    except MergecalError as err:
        raise CheckpointError(f"model.arch: {err}") from None
    state = model.state_dict()
    missing = [k for k in state if k not in set(pre.keys())]
    unexpected = [k for k in pre.keys() if k not in state]
    if missing or unexpected:
        key = missing[0] if missing else unexpected[0]
        raise CheckpointError(f"{pre.name}: not a {arch} checkpoint: key {key!r} is "
                              f"{'missing' if missing else 'not in the architecture'}")
    with torch.no_grad():
        for key, tensor in state.items():
            if tuple(pre.shape(key)) != tuple(tensor.shape):
                raise CheckpointError(f"{pre.name}: not a {arch} checkpoint: key {key!r} has shape "
                                      f"{tuple(pre.shape(key))}, the architecture {tuple(tensor.shape)}")
            tensor.copy_(pre.get(key))
    return model.eval()


def load_visual(model: torch.nn.Module, items) -> None:
    """Copy ``(key, tensor)`` pairs into the model's own tensors, one key at a time."""
    state = model.state_dict()
    with torch.no_grad():
        for key, tensor in items:
            state[key].copy_(tensor)


CHECKPOINT_FILES = ("checkpoint files (expected a .safetensors file or index, a pickled .pt/.pth/.bin/.ckpt file, "
                    "or a directory with config.json and model.safetensors or *.safetensors.index.json)")


def checkpoint_files(path: Path, *, with_config: bool = False) -> list[Path]:
    """The files ``open_checkpoint`` reads for ``path`` (and ``register_hf_arch``: config.json, when
    ``with_config``): a pickled file; a safetensors file, or an index and its shards (``safetensors_files``);
    a directory's safetensors. Empty when the path holds none of them."""
    if path.is_file():
        if path.suffix in PICKLE_SUFFIXES:
            return [path]
        return safetensors_files(path) if path.suffix == ".safetensors" or path.name.endswith(INDEX_SUFFIX) else []
    if not path.is_dir():
        return []
    config = [path / "config.json"] if with_config and (path / "config.json").is_file() else []
    return config + (safetensors_files(path) if weights_candidates(path) else [])

