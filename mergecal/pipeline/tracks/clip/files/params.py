"""The params.yaml section of CLIP tracks from local files (``local_clip:``, a list)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from .....config_types import ConfigValueError, Count
from .....errors import MergecalError
from .....regimes import DISTAC_PRESETS
from ....params_base import MIN_TEST_EXAMPLES, Strict


WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")  # a file; anything else is a directory


class LocalClipEvaluation(Strict):
    """Images per task of a local CLIP track: a seeded subset of validation (choosing the scaling) and of test
    (``max_test: null``: the whole test split), and the evaluation batch size."""

    batch_size: Count = 128
    max_validation: Count = 512
    max_test: Count | None = None
    # where an odd margin puts the centre crop: torchvision's rounding (open_clip, task_vectors) or Hugging Face's
    # floor (CLIPImageProcessor: FusionBench); real_vision.clip_resize
    center_crop: Literal["round", "floor"] = "round"

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # the default is left out of dumps, so that the cell ids of tracks written before the option are unchanged
        out = handler(self)
        if self.center_crop == "round":
            out.pop("center_crop", None)
        return out


class LocalClipModel(Strict):
    """The pretrained CLIP of a local track: an open_clip weights file with its architecture (``arch``, e.g.
    ViT-B-32-quickgelu for OpenAI's weights), or a Hugging Face CLIP directory (``arch`` unset: read from its
    config.json)."""

    pretrained: str = Field(min_length=1)
    arch: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _arch(self) -> "LocalClipModel":
        is_file = self.pretrained.endswith(WEIGHT_SUFFIXES)
        if is_file and self.arch is None:
            raise ConfigValueError("arch", "required with a weights file: its open_clip architecture, e.g. "
                                           "ViT-B-32-quickgelu")
        if not is_file and self.arch is not None:
            raise ConfigValueError("arch", "only with a weights file (a Hugging Face directory names its own)")
        return self


class LocalClipTrack(Strict):
    """A lab's own CLIP checkpoints and datasets: the pretrained model, one fine-tuned checkpoint per task (an
    open_clip state dict in safetensors, a Hugging Face CLIP(Vision)Model directory, a PEFT adapter directory
    (LoRA or IA³ on the pretrained model's image tower, applied as peft's ``merge_and_unload`` applies it:
    ``stages.adapter_source``) or, with ``allow_unsafe_pickle``, a pickled file such as task_vectors'
    finetuned.pt) and one local dataset per task
    (the data location holding it in any layout ``mergecal.data.real_vision`` reads). Tasks are the eight
    standard vision tasks and the twelve of the TALL-mask sets (their names as ``real_vision`` spells them,
    case ignored); ``class_names`` and
    ``templates`` replace a task's standard ones in its zero-shot head (as many names as the task's classes).
    Relative paths are relative to the repository root. Nothing is copied or downloaded. A task with fewer
    than ``min_test`` test images is refused (``MIN_TEST_EXAMPLES``)."""

    enabled: bool = True
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the backbone label of the leaderboard
    task_set: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: LocalClipModel
    finetuned: dict[str, str]
    datasets: dict[str, str]
    class_names: dict[str, list[str]] = Field(default_factory=dict)
    templates: dict[str, list[str]] = Field(default_factory=dict)
    evaluation: LocalClipEvaluation = Field(default_factory=LocalClipEvaluation)
    # DisTaC of the track's `distac>` chains: the paper's norm_mismatch preset (500 steps, batch 128, lr 1e-5),
    # these values overriding it (not the shared `distac:` section, which is the embedded testbed's)
    distac: dict[str, Any] = Field(default_factory=dict)
    allow_unsafe_pickle: bool = False
    min_test: Count = MIN_TEST_EXAMPLES
    # the preset it was built from (mergecal.presets); not in model_dump, so not in cell ids (its values are)
    preset: str | None = Field(None, exclude=True)

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, values: Any) -> Any:
        """``preset: <name>`` (and ``preset_tasks``): a published pool's settings, the track's own keys winning
        (``mergecal.presets``)."""
        from .....presets import expand

        return expand(values, "local_clip")

    @field_validator("distac")
    @classmethod
    def _distac(cls, values: dict[str, Any]) -> dict[str, Any]:
        from .....calibrations.distac import DistacStepParams
        from .....methods.base import build_params

        try:
            build_params(DistacStepParams, "distac", {"preset": "norm_mismatch", **values})
        except MergecalError as err:
            raise ValueError(str(err)) from None
        return values

    def distac_step(self):
        """The track's DisTaC step: the paper's preset for models without a known failure mode (the vision
        track's standard regime: norm matching, ``mergecal.regimes.DISTAC_PRESETS``), then ``distac``."""
        from .....calibrations.distac import DistacStepParams
        from .....methods.base import build_params

        return build_params(DistacStepParams, "distac", {"preset": DISTAC_PRESETS["standard"], **self.distac})

    @field_validator("finetuned")
    @classmethod
    def _finetuned(cls, finetuned: dict[str, str]) -> dict[str, str]:
        from .....data.real_vision import canonical_task
        from .....data.real_vision_metadata import VISION_TASKS

        if len(finetuned) < 2:
            raise ValueError(f"expected at least 2 fine-tuned checkpoints (task: path), got {len(finetuned)}")
        for task, path in finetuned.items():
            try:
                canonical_task(task)
            except MergecalError:
                raise ConfigValueError(task, f"not one of the vision tasks ({', '.join(VISION_TASKS)})") from None
            if not path:
                raise ConfigValueError(task, "expected a checkpoint file or directory")
        return finetuned

    @model_validator(mode="after")
    def _check(self) -> "LocalClipTrack":
        from .....data.real_vision import canonical_task
        from .....data.real_vision_metadata import CLASSNAMES

        for task in self.finetuned:
            if not self.datasets.get(task):
                raise ConfigValueError(f"datasets.{task}", "missing: the data location holding this task's dataset")
        for section in ("datasets", "class_names", "templates"):
            extra = [t for t in getattr(self, section) if t not in self.finetuned]
            if extra:
                raise ConfigValueError(f"{section}.{extra[0]}", "no fine-tuned checkpoint for this task")
        canonical = [canonical_task(t) for t in self.finetuned]
        if len(set(canonical)) != len(canonical):
            raise ConfigValueError("finetuned", "two entries name the same task")
        if self.evaluation.max_test is not None and self.evaluation.max_test < self.min_test:
            raise ConfigValueError("evaluation.max_test", f"{self.evaluation.max_test} images, fewer than min_test "
                                                          f"{self.min_test}")
        for task, names in self.class_names.items():
            expected = len(CLASSNAMES[canonical_task(task)])
            if len(names) != expected or not all(names):
                raise ConfigValueError(f"class_names.{task}", f"{len(names)} names, but {canonical_task(task)} has "
                                                              f"{expected} classes (labels of its dataset)")
        for task, templates in self.templates.items():
            bad = next((t for t in templates if t.count("{}") != 1), None) if templates else "(none)"
            if bad is not None:
                raise ConfigValueError(f"templates.{task}", f"each template needs one '{{}}' for the class name, "
                                                            f"got {bad!r}")
        return self

    @property
    def task_names(self) -> list[str]:
        return list(self.finetuned)



#: its section of ``Params`` (``mergecal.pipeline.config``, key: the track's name): (type, default)
SECTION = (list[LocalClipTrack], Field(default_factory=list))  # CLIP checkpoints and datasets from local files
