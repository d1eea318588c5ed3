"""The merge-method interface, typed hyperparameters and the registry.

A method turns K task vectors into one merged task vector, key by key:

    merged_tau[key] = params.scaling * method.combine(key, [tau_1[key], ..., tau_K[key]])

``scaling`` is the paper's lambda (TA, TIES, DARE, Consensus) or alpha (TSV-M, Iso-C, Iso-CTS), and
this line in ``mergecal.merge`` is the one place it is applied. Calibrations wrap the result, so
they work with any method. Methods that need a statistic over the whole model (TIES' global top-k)
compute it in ``fit``, a streaming pass over the keys, before ``combine`` is called.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator

from ..errors import ParameterError, UnknownNameError

if TYPE_CHECKING:
    from ..task_vectors import TaskVectorSet


FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def _accepts_bool(annotation: Any) -> bool:
    return annotation is bool or bool in getattr(annotation, "__args__", ())


class HyperParams(BaseModel):
    """Base of every method's and calibration's hyperparameters: unknown names are rejected, floats must be finite
    and within float32's range (the merges compute in float32, so 1e39 is an infinity there), and a boolean is
    accepted only where the parameter is a flag (pydantic would read ``top_k=True`` as 1.0)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        items = value if isinstance(value, (list, tuple)) else [value]
        if not _accepts_bool(cls.model_fields[info.field_name].annotation) and any(isinstance(v, bool) for v in items):
            raise ValueError("expected a number, not a boolean")
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _within_float32(cls, value: Any) -> Any:  # after parsing: "1e39" from a recipe string is a float by now
        items = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, float) and abs(v) > FLOAT32_MAX for v in items):
            raise ValueError(f"magnitude beyond float32's range ({FLOAT32_MAX:.3g})")
        return value


class MergeParams(HyperParams):
    """Hyperparameters of a merge method. Unknown names are rejected; values are validated."""

    scaling: float = 1.0


def format_params(params: BaseModel) -> str:
    """Stable ``k=v,k=v`` form (sorted names, repr of values) used in method IDs."""
    items = []
    for field, value in sorted(params.model_dump().items()):
        if isinstance(value, (list, tuple)):
            value = "[" + ",".join(repr(v) for v in value) + "]"
        else:
            value = repr(value)
        items.append(f"{field}={value}")
    return ",".join(items)


def build_params(params_cls: type[BaseModel], owner: str, values: dict[str, Any]) -> BaseModel:
    """Validate ``values`` into ``params_cls`` with a one-line error naming the parameter."""
    try:
        return params_cls(**values)
    except ValidationError as err:
        first = err.errors()[0]
        name = ".".join(str(p) for p in first["loc"])
        allowed = ", ".join(params_cls.model_fields)
        if not name:  # a model-level validator: its message says what is wrong
            raise ParameterError(f"{owner}: {first['msg'].removeprefix('Value error, ')}") from None
        if first["type"] == "extra_forbidden":
            raise ParameterError(f"{owner}: unknown parameter {name!r}; allowed: {allowed}") from None
        raise ParameterError(f"{owner}: parameter {name!r}: {first['msg']} (got {first.get('input')!r})") from None


class MergeMethod(ABC):
    """Base class: subclasses set ``name``, ``Params``, ``key_rule`` and implement ``combine``."""

    name: ClassVar[str]
    Params: ClassVar[type[MergeParams]] = MergeParams
    #: which keys get the method's specific treatment (see mergecal.keys); the others are stated per method
    key_rule: ClassVar[str] = "all_float"
    summary: ClassVar[str] = ""
    #: the method learns on a model and unlabelled inputs of each task (AdaMerging): it cannot merge task vectors
    #: alone, so the data-free path (``iter_merge`` on plain task vectors, ``mergecal merge``) refuses it in ``fit``
    #: and the benchmark runs it only where a track's session gives it a model and data (the vision track)
    needs_data: ClassVar[bool] = False

    def __init__(self, params: MergeParams | None = None, **values: Any):
        if params is not None and values:
            raise ParameterError(f"{self.name}: pass either a Params object or keyword parameters, not both")
        self.params = params if params is not None else build_params(self.Params, self.name, values)

    #: ``combine`` is elementwise (each output entry reads the same entry of every task vector, no statistic
    #: of a key or of the model): a key can then be merged in row blocks (``combine_blocks``), holding K blocks
    #: instead of K whole keys (a 32000 x 4096 embedding is 524 MB a task in float32)
    blockwise: ClassVar[bool] = False

    def fit(self, task_vectors: "TaskVectorSet", keys: Sequence[str]) -> None:
        """Streaming statistics pass over ``keys`` (default: nothing to compute)."""

    def combine_blocks(self, key: str, blocks: Callable[[], Iterator[list[torch.Tensor]]]) -> Iterator[torch.Tensor]:
        """A ``blockwise`` method's unscaled merge of one key, block by block: ``blocks()`` iterates the K
        task-vector slices of each row block in order (callable again for a second pass); yields each block's
        merge, equal to the same rows of ``combine`` over the whole key."""
        for taus in blocks():
            yield self.combine(key, taus)

    @abstractmethod
    def combine(self, key: str, taus: list[torch.Tensor]) -> torch.Tensor:
        """The unscaled merged task vector for one key, from its K task-vector slices (float32).

        ``taus`` may share memory with the caller's inputs: never modify them in place.
        """

    @property
    def id(self) -> str:
        """Stable string form ``name(param=value,...)``, usable as an identifier."""
        return f"{self.name}({format_params(self.params)})"

    def __repr__(self) -> str:
        return self.id


MERGE_METHODS: dict[str, type[MergeMethod]] = {}


def register(cls: type[MergeMethod]) -> type[MergeMethod]:
    if cls.name in MERGE_METHODS:
        raise ValueError(f"merge method {cls.name!r} registered twice")
    MERGE_METHODS[cls.name] = cls
    return cls


def get_merge_method(name: str | MergeMethod, **params: Any) -> MergeMethod:
    """A configured method by registry name (a ``MergeMethod`` instance passes through)."""
    if isinstance(name, MergeMethod):
        if params:
            raise ParameterError(f"{name.name}: parameters given twice (instance and keywords)")
        return name
    try:
        cls = MERGE_METHODS[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown merge method {name!r}; choose one of: {', '.join(sorted(MERGE_METHODS))}"
        ) from None
    return cls(**params)


class MatrixMergeMethod(MergeMethod):
    """A method defined on matrices (TSV-M, Iso-C, Iso-CTS): ``merge_matrix`` on the keys that
    ``params.key_rule`` selects, the mean of the task vectors on every other float key."""

    key_rule = "matrices_except_text_projection"

    def __init__(self, params: MergeParams | None = None, **values: Any):
        super().__init__(params, **values)
        from ..keys import get_key_rule

        self._rule = get_key_rule(self.params.key_rule)

    @abstractmethod
    def merge_matrix(self, taus: list[torch.Tensor]) -> torch.Tensor | None:
        """The merged matrix, or None to fall back to the mean for this key."""

    def combine(self, key: str, taus: list[torch.Tensor]) -> torch.Tensor:
        if self._rule.matches(key, taus[0].shape, taus[0].dtype):
            merged = self.merge_matrix(taus)
            if merged is not None:
                return merged
        return mean_of(taus)


def sum_of(taus: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """sum_t tau_t without stacking (one output buffer instead of K + 1), accumulated in ``dtype`` if given.

    Accumulating a wider ``dtype`` on the CPU goes through blocks of rows that stay in cache (each element
    still receives the same additions in the same order, so the result is bitwise the same): a whole-tensor
    mixed-dtype add_ per task is memory-bound, ~4x slower on a 3072 x 768 float64 sum of K = 8 (measured)."""
    first = taus[0]
    if dtype is None or dtype == first.dtype or first.device.type != "cpu" or first.dim() == 0:
        total = first.to(dtype, copy=True) if dtype is not None else first.clone()
        for tau in taus[1:]:
            total.add_(tau)
        return total
    total = torch.empty(first.shape, dtype=dtype)
    rows = max(1, (1 << 18) // max(1, first[0].numel()))  # ~2 MiB of float64 per block
    for start in range(0, first.shape[0], rows):
        block = total[start:start + rows]
        block.copy_(first[start:start + rows])
        for tau in taus[1:]:
            block.add_(tau[start:start + rows])
    return total


def mean_of(taus: list[torch.Tensor]) -> torch.Tensor:
    return sum_of(taus).div_(len(taus))
