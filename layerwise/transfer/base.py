"""The weight-transfer engine interface: typed init/update infos, request wrappers, transport errors.

Design after vLLM's ``vllm/distributed/weight_transfer/base.py``: a backend is a
``WeightTransferEngine[TInitInfo, TUpdateInfo]`` whose two dataclasses describe, as plain dicts on the
wire, how to connect (init info, once) and what one update carries (update info: names, dtypes,
shapes, backend fields). The engine side only *moves bytes*: ``receive_weights(update_info,
load_weights)`` hands ``load_weights`` a few (name, tensor) pairs at a time; what happens to them
(re-quantization layer by layer, staging, rollback) is ``layerwise.transfer.update``'s job. The trainer
side is the static ``trainer_send_weights(iterator, trainer_args)``.

Contract of ``load_weights`` (Limitations 2 in ``layerwise/transfer/__init__.py``): once a call
returns, the receiver keeps no reference to the tensors it was given, so a backend may overwrite the
memory behind them (a packed bucket, a shared-memory segment) right away.
"""

from __future__ import annotations

import dataclasses
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

import torch

from layerwise.errors import WeightTransferError, WeightTransferTimeoutError  # noqa: F401 (re-exported)

TInitInfo = TypeVar("TInitInfo", bound="WeightTransferInitInfo")
TUpdateInfo = TypeVar("TUpdateInfo", bound="WeightTransferUpdateInfo")

LoadWeights = Callable[[list[tuple[str, torch.Tensor]]], None]


@dataclass
class WeightTransferInitInfo:
    """Base of the backend-specific connection info, sent once (``init_transfer_engine``)."""


@dataclass(kw_only=True)
class WeightTransferUpdateInfo:
    """Base of the backend-specific info of one update.

    Attributes:
        is_checkpoint_format: True: Hugging Face names and dtypes (e.g. BF16 ``...q_proj.weight``),
            re-quantized module by module on the engine. False: the model's own kernel-format names
            and dtypes (``model.named_parameters()``: float8_e4m3fn weights and float32 scales), copied
            in place after a name/dtype/shape/finiteness check.
    """

    is_checkpoint_format: bool = True


@dataclass(kw_only=True)
class TensorListUpdateInfo(WeightTransferUpdateInfo):
    """Update info that lists every tensor of the update, in the order they are sent.

    Attributes:
        names: tensor names (checkpoint or kernel format, see ``is_checkpoint_format``).
        dtype_names: torch dtype names without the ``torch.`` prefix ("bfloat16", "float8_e4m3fn").
        shapes: one list of ints per tensor ([] for a 0-d tensor).
    Raises (on construction):
        ValueError: lists of different lengths, an unknown dtype name, a negative or non-integer size;
            the message names the tensor.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    dtypes: list[torch.dtype] = field(init=False, repr=False, compare=False)  # parsed from dtype_names

    def __post_init__(self):
        if not isinstance(self.is_checkpoint_format, bool):
            raise ValueError(f"update info: is_checkpoint_format must be a bool, got {self.is_checkpoint_format!r}")
        n = len(self.names)
        for field_name in ("dtype_names", "shapes"):
            if len(getattr(self, field_name)) != n:
                raise ValueError(
                    f"update info: {field_name} has {len(getattr(self, field_name))} entries, names has {n}"
                )
        for name, shape in zip(self.names, self.shapes, strict=True):
            if not isinstance(shape, (list, tuple)) or any(
                isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape
            ):
                raise ValueError(
                    f"update info: shape of tensor {name!r} must be a list of non-negative ints, got {shape!r}"
                )
        self.dtypes = [parse_dtype_name(d, name) for d, name in zip(self.dtype_names, self.names, strict=True)]

    def nbytes(self, i: int) -> int:
        """Bytes of tensor ``i``."""
        return math.prod(self.shapes[i]) * self.dtypes[i].itemsize


def parse_dtype_name(dtype_name: str, tensor_name: str) -> torch.dtype:
    """``"bfloat16"`` -> torch.bfloat16. Raises ValueError naming the tensor for an unknown name."""
    dtype = getattr(torch, str(dtype_name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"update info: unknown dtype {dtype_name!r} for tensor {tensor_name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> ``"bfloat16"`` (the form of ``dtype_names``)."""
    return str(dtype).removeprefix("torch.")


def tensor_metadata(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list]:
    """``{"names", "dtype_names", "shapes"}`` of (name, tensor) pairs, for a trainer building update info.

    Reads only metadata (no data is copied or gathered); pass the same pairs, in the same order, to
    ``trainer_send_weights``.
    """
    names, dtypes, shapes = [], [], []
    for name, t in named_tensors:
        names.append(name)
        dtypes.append(dtype_name(t.dtype))
        shapes.append(list(t.shape))
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}


@dataclass
class WeightTransferInitRequest:
    """API-level init request: ``init_info`` is the backend's init info as a dict (JSON-able)."""

    init_info: dict[str, Any] = field(default_factory=dict)


@dataclass
class WeightTransferUpdateRequest:
    """API-level update request: ``update_info`` is the backend's update info as a dict."""

    update_info: dict[str, Any] = field(default_factory=dict)


def parse_dataclass(cls: type, values: dict[str, Any], what: str, owner: str):
    """An instance of dataclass ``cls`` from ``values`` (returned as is when it already is one).

    Raises:
        ValueError: not a dict, a field ``cls`` does not know or a required one missing (both named, with the
            fields it has), or a value ``cls`` rejects; ``what`` and ``owner`` name the info and its reader.
    """
    if isinstance(values, cls):
        return values
    if not isinstance(values, dict):
        raise ValueError(f"{what} for {owner} must be a dict, got {type(values).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    missing = sorted(
        n
        for n, f in fields.items()
        if n not in values and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown field(s) {unknown}")
        if missing:
            parts.append(f"missing field(s) {missing}")
        raise ValueError(f"invalid {what} for {owner}: {'; '.join(parts)} (fields: {sorted(fields)})")
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invalid {what} for {owner}: {e}") from e


class WeightTransferEngine(ABC, Generic[TInitInfo, TUpdateInfo]):
    """Receives weights from a trainer and hands them, a few at a time, to a ``load_weights`` callable.

    Design: vLLM's ``vllm/distributed/weight_transfer/base.py`` (same names). Unlike vLLM's, an engine
    holds no model: the engine-side update (``layerwise.transfer.update``) passes the model's loader in.

    Subclasses set the class attributes ``init_info_cls`` / ``update_info_cls`` (dataclasses) and
    implement ``init_transfer_engine``, ``receive_weights``, ``shutdown`` and the static
    ``trainer_send_weights``.

    Args:
        device: where received tensors are placed ("cpu", "cuda:0", torch.device); backends that
            map the trainer's memory (ipc) ignore it for the data itself.
    """

    init_info_cls: ClassVar[type]
    update_info_cls: ClassVar[type]

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def parse_init_info(self, init_dict: dict[str, Any]) -> TInitInfo:
        """Typed init info from a dict.

        Raises:
            ValueError: a field this backend does not know, a required field missing (both named),
                or a value its dataclass rejects.
        """
        return parse_dataclass(self.init_info_cls, init_dict, "init_info", type(self).__name__)

    def parse_update_info(self, update_dict: dict[str, Any]) -> TUpdateInfo:
        """Typed update info from a dict.

        Raises:
            ValueError: a field this backend does not know, a required field missing (both named),
                or a value its dataclass rejects (e.g. lists of different lengths, an unknown dtype).
        """
        return parse_dataclass(self.update_info_cls, update_dict, "update_info", type(self).__name__)

    @abstractmethod
    def init_transfer_engine(self, init_info: TInitInfo) -> None:
        """Connect to the trainer (once, before the first update)."""

    @abstractmethod
    def receive_weights(self, update_info: TUpdateInfo, load_weights: LoadWeights) -> None:
        """Receive the tensors of one update and call ``load_weights(list of (name, tensor))`` with
        a few of them at a time (never the whole model at once).

        The tensors passed may be views into transport memory that is reused as soon as
        ``load_weights`` returns (see the module docstring). If ``load_weights`` raises, the backend
        should still consume the rest of the update from the trainer when its transport requires it
        (to stay in step), then re-raise that error.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Release the transport (process group, mappings). Safe to call twice."""

    @staticmethod
    @abstractmethod
    def trainer_send_weights(iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: Any) -> None:
        """Trainer side: send every (name, tensor) of ``iterator`` (in the order of the update info's
        ``names``) to the engine. ``trainer_args``: a backend-specific dataclass or dict."""
