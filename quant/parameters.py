"""Typed parameters: a parameter carries its weight_loader and its shard layout from construction.

Follows vLLM's ``BasevLLMParameter`` idea (the loader and output_dim/input_dim are constructor
arguments), so no attribute is ever set on a plain ``nn.Parameter``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import nn

from layerwise.errors import WeightDtypeError, WeightShapeError

WeightLoader = Callable[..., None]

# Whether load_shard's host-to-device copies may return before the copy is done (see async_host_copies).
_ASYNC_HOST_COPIES: ContextVar[bool] = ContextVar("layerwise_async_host_copies", default=False)


@contextlib.contextmanager
def async_host_copies() -> Iterator[None]:
    """Within the block, :meth:`ModelWeightParameter.load_shard` copies pinned CPU tensors to the device in their
    own dtype with ``non_blocking=True`` (:func:`_may_return_early`): the call returns at once and the copy
    overlaps what the host does next. Other copies block as before.

    Only for a caller that keeps every source tensor unchanged until it synchronizes the device (a reload from
    a sequence the caller holds, ``layerwise.reload.deferred`` Limitations 12): a producer that refills a pinned
    buffer after handing out a view of it would otherwise race the copy.
    """
    token = _ASYNC_HOST_COPIES.set(True)
    try:
        yield
    finally:
        _ASYNC_HOST_COPIES.reset(token)


class ModelWeightParameter(nn.Parameter):
    """A parameter in checkpoint format (before ``process_weights_after_loading``).

    Args:
        data: the storage, usually an empty tensor on the meta device, shape [out, in] for a
            Linear weight, [out] for a bias or norm weight, [vocab, hidden] for an embedding.
        weight_loader: ``loader(param, loaded_weight, shard_id=None)`` that writes a checkpoint
            tensor into this parameter (wrapped by ``online_process_loader`` during layerwise loads).
        output_dim: dimension split across tensor-parallel ranks for column-parallel layers, or None.
        input_dim: dimension split across ranks for row-parallel layers, or None.
    """

    def __new__(
        cls,
        data: torch.Tensor,
        weight_loader: WeightLoader,
        output_dim: int | None = None,
        input_dim: int | None = None,
    ):
        return super().__new__(cls, data, requires_grad=False)

    def __init__(
        self,
        data: torch.Tensor,
        weight_loader: WeightLoader,
        output_dim: int | None = None,
        input_dim: int | None = None,
    ):
        self.weight_loader = weight_loader
        self.output_dim = output_dim
        self.input_dim = input_dim

    def with_data(self, data: torch.Tensor, weight_loader: WeightLoader | None = None) -> ModelWeightParameter:
        """A new parameter of the same type and layout holding ``data`` (same shape required)."""
        if data.shape != self.shape:
            raise ValueError(f"with_data: shape {tuple(data.shape)} != {tuple(self.shape)}")
        return type(self)(data, weight_loader or self.weight_loader, self.output_dim, self.input_dim, **self._layout())

    def _layout(self) -> dict:
        """The constructor's keyword arguments beyond the base's (a subclass's layout), for :meth:`with_data`."""
        return {}

    def load_shard(
        self,
        loaded_weight,
        shard_offset: int = 0,
        shard_size: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        dim: str | None = None,
        source_start: int | None = None,
        source_size: int | None = None,
    ) -> None:
        """Copy this rank's slice of a checkpoint tensor into a region of the parameter.

        Along the sharded dimension d the parameter region is ``[shard_offset, shard_offset + shard_size)``
        and the checkpoint slice is ``[source_start, source_start + shard_size)`` (default
        ``tp_rank * shard_size``) of a checkpoint dimension of ``source_size`` (default
        ``shard_size * tp_size``); other dimensions must match. Only that slice is materialized: a lazy
        checkpoint slice (``layerwise.checkpoint.LazyTensor``) is narrowed first, then read.

        Args:
            loaded_weight: checkpoint tensor (CPU, any float dtype; cast on copy), or a lazy slice with
                ``.shape``, ``.narrow(dim, start, length)`` and ``.materialize()``.
            dim: "output" (column-parallel rows: ``output_dim``), "input" (row-parallel columns:
                ``input_dim``), or None: ``output_dim``, else ``input_dim``, else the whole tensor.
        Raises:
            WeightShapeError: the checkpoint tensor's shape is not the full (unsharded) shape of the region,
                or the slice lies outside it (the message gives both shapes); or a tensor that is not floating
                point (an integer or bool dtype) for a floating-point parameter, which a copy would cast.
        """
        check_loaded_dtype(loaded_weight, self.dtype)
        if dim is None:
            d = self.output_dim if self.output_dim is not None else self.input_dim
        elif dim in ("output", "input"):
            d = self.output_dim if dim == "output" else self.input_dim
            if d is None:
                raise ValueError(f"load_shard: the parameter has no {dim}_dim")
        else:
            raise ValueError(f"load_shard: dim must be 'output', 'input' or None, got {dim!r}")
        target = self.data
        source = loaded_weight
        if d is not None:
            size = self.shape[d] - shard_offset if shard_size is None else shard_size
            start = tp_rank * size if source_start is None else source_start
            full = size * tp_size if source_size is None else source_size
            target = target.narrow(d, shard_offset, size)
            expected = list(target.shape)
            expected[d] = full
            if list(loaded_weight.shape) != expected or start + size > full:
                raise WeightShapeError(
                    f"checkpoint shape {tuple(loaded_weight.shape)} does not match expected {tuple(expected)}"
                    + ("" if start + size <= full else f" (slice [{start}, {start + size}) of dim {d})")
                )
            if (start, size) != (0, full):
                source = loaded_weight.narrow(d, start, size)
        elif tuple(loaded_weight.shape) != tuple(target.shape):
            raise WeightShapeError(
                f"checkpoint shape {tuple(loaded_weight.shape)} does not match expected {tuple(target.shape)}"
            )
        copy_loaded(source, target)


def check_loaded_dtype(loaded_weight, param_dtype: torch.dtype) -> None:
    """Refuse a tensor whose copy into a ``param_dtype`` parameter would cast it silently into other values: one that
    is not floating point (an integer or bool dtype) for a floating-point parameter, a float8 tensor for a parameter
    that is not float8 (its e4m3 values are not the weight: they need their scale), a tensor that is not float8 for a
    float8 parameter (the weight of an FP8 checkpoint's module, whose scale comes with it), or another float8 variant.
    Float widths otherwise convert (float32 into a BF16 parameter, BF16 into a float32 scale).

    Args:
        loaded_weight: a tensor or a lazy checkpoint slice (anything with ``.dtype``).
    Raises:
        WeightDtypeError: the message names both dtypes and what to do (the router adds key and file).
    """
    got = loaded_weight.dtype
    if got == param_dtype:
        return
    if param_dtype in FLOAT8_DTYPES:
        raise WeightDtypeError(
            f"checkpoint dtype {_name(got)} for a {_name(param_dtype)} parameter: this model was loaded from an FP8 "
            f"checkpoint, so its linear weights arrive as {_name(param_dtype)} with their scales; send FP8 weights "
            f"with scales, or load the model from a BF16 checkpoint to reload BF16 weights"
        )
    if got in FLOAT8_DTYPES:
        raise WeightDtypeError(
            f"checkpoint dtype {_name(got)} for a {_name(param_dtype)} parameter: a float8 tensor needs its scale and "
            f"cannot be cast as if it were {_name(param_dtype)}. This parameter takes no float8 values: a scale, a "
            f"norm or embedding, or a weight of a model loaded from a checkpoint whose weights are not float8 (load "
            f"the model from the FP8 checkpoint itself, or dequantize the weights first)"
        )
    if param_dtype.is_floating_point and not (got.is_floating_point and not got.is_complex):
        raise WeightDtypeError(
            f"checkpoint dtype {_name(got)} for a {_name(param_dtype)} parameter: an integer, bool or complex tensor "
            f"would be cast into other values; write the weights as floating point (bfloat16, float16 or float32)"
        )


#: the float8 dtypes torch has; weights of FP8 checkpoints are float8_e4m3fn
_FLOAT8_NAMES = ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
FLOAT8_DTYPES = frozenset(getattr(torch, n) for n in _FLOAT8_NAMES if hasattr(torch, n))


def _name(dtype: torch.dtype) -> str:
    return str(dtype)  # "torch.int32": as torch names it in its own errors


def copy_loaded(source, target: torch.Tensor) -> None:
    """``target.copy_(source)`` of a weight loader: a lazy checkpoint slice is read first; inside
    :func:`async_host_copies` a pinned host tensor in target's dtype is copied without waiting
    (:func:`_may_return_early`). No autograd."""
    if not isinstance(source, torch.Tensor):
        source = source.materialize()
    with torch.no_grad():
        target.copy_(source, non_blocking=_ASYNC_HOST_COPIES.get() and _may_return_early(source, target))


def _may_return_early(source: torch.Tensor, target: torch.Tensor) -> bool:
    """Whether ``target.copy_(source, non_blocking=True)`` gains anything and costs nothing: a pinned host tensor
    copied into device memory in its own dtype. Never into host memory (a copy that returns early would be read
    before it is done); not across dtypes (the conversion would then run on the device, on a temporary of the
    source's size in device memory); not from pageable memory (CUDA stages it before returning anyway)."""
    return (
        source.device.type == "cpu"
        and target.device.type != "cpu"
        and source.dtype == target.dtype
        and source.is_pinned()
    )


def default_weight_loader(param: ModelWeightParameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Loader for unsharded parameters (norm weights): whole-tensor copy with a shape check."""
    if shard_id is not None:
        raise ValueError(f"default_weight_loader takes no shard_id, got {shard_id!r}")
    param.load_shard(loaded_weight)


def _full_tensor(loaded_weight) -> torch.Tensor:
    """A scale tensor as a CPU tensor (a lazy checkpoint slice is read: scales are small)."""
    return loaded_weight if isinstance(loaded_weight, torch.Tensor) else loaded_weight.materialize()


class RowScaleParameter(ModelWeightParameter):
    """The float32 [out, 1] dequantization multipliers of an FP8 checkpoint weight's rows (w = weight * scale).

    A per-tensor checkpoint scale (one element: [1] or []) fills every row of the region it is loaded into (the
    whole weight, or one fused shard: q_proj's scale fills qkv_proj's q rows); a per-channel one ([out, 1] or [out])
    is loaded like the weight's rows (sharded with them, replicated for a row-parallel layer). Created with
    ``output_dim=0`` and no ``input_dim``.
    """

    def load_shard(self, loaded_weight, shard_offset: int = 0, shard_size: int | None = None, *args, **kwargs) -> None:
        """As :meth:`ModelWeightParameter.load_shard`; a one-element scale is broadcast over the region's rows.

        Raises:
            WeightDtypeError: a float8 or integer scale. WeightShapeError: a scale of more than one element whose
                shape is not the rows' ([out, 1] or [out]).
        """
        check_loaded_dtype(loaded_weight, self.dtype)
        if math.prod(loaded_weight.shape) == 1:
            size = self.shape[0] - shard_offset if shard_size is None else shard_size
            copy_loaded(_full_tensor(loaded_weight).reshape(1, 1), self.data.narrow(0, shard_offset, size))
            return
        if len(loaded_weight.shape) == 1:
            loaded_weight = _full_tensor(loaded_weight).reshape(-1, 1)
        super().load_shard(loaded_weight, shard_offset, shard_size, *args, **kwargs)


class BlockScaleParameter(ModelWeightParameter):
    """The float32 dequantization multipliers of an FP8 checkpoint weight's ``block`` = (rows, columns) blocks
    (``weight_scale_inv`` of the Hugging Face / DeepSeek-V3 layout): [sum(ceil(O_i / rows)), ceil(in / columns)]
    for fused shards of O_i rows each, every shard with its own block rows (as each shard's checkpoint tensor has).

    Loads are given in the weight's element coordinates (the layer's weight_loader does not know it is loading a
    scale) and mapped here to block coordinates; along the input dimension (a row-parallel layer's columns) the
    whole-parameter load is already in blocks.

    Args:
        row_sizes: this rank's output rows of each fused shard (the layer's ``output_sizes``).
        block: (rows, columns) of a block, (128, 128) in every published checkpoint.
    """

    def __new__(cls, data, weight_loader, output_dim=None, input_dim=None, *, row_sizes=(), block=(128, 128)):
        return super().__new__(cls, data, weight_loader, output_dim, input_dim)

    def __init__(self, data, weight_loader, output_dim=None, input_dim=None, *, row_sizes=(), block=(128, 128)):
        super().__init__(data, weight_loader, output_dim, input_dim)
        self.row_sizes = tuple(row_sizes)
        self.block = tuple(block)

    def _layout(self) -> dict:
        return {"row_sizes": self.row_sizes, "block": self.block}

    def load_shard(
        self,
        loaded_weight,
        shard_offset: int = 0,
        shard_size: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        *,
        dim: str | None = None,
        source_start: int | None = None,
        source_size: int | None = None,
    ) -> None:
        """As :meth:`ModelWeightParameter.load_shard`, with ``shard_offset`` / ``shard_size`` / ``source_start`` /
        ``source_size`` in the weight's rows when ``shard_size`` is given (a column-parallel layer's shard).

        Raises:
            WeightShapeError: the region starts inside a block of the checkpoint's scale, or ends inside one that
                rows outside the region share (a shard that cannot be cut out of the scale tensor), or the scale's
                shape does not fit.
            WeightDtypeError: a float8 or integer scale.
        """
        if shard_size is None or dim == "input":
            super().load_shard(loaded_weight, shard_offset, shard_size, tp_rank, tp_size, dim=dim)
            return
        rows = self.block[0]
        starts = [sum(self.row_sizes[:i]) for i in range(len(self.row_sizes))]
        if shard_offset not in starts or self.row_sizes[starts.index(shard_offset)] != shard_size:
            raise ValueError(f"block scale: rows [{shard_offset}, {shard_offset + shard_size}) are not one shard")
        i = starts.index(shard_offset)
        start = tp_rank * shard_size if source_start is None else source_start
        full = shard_size * tp_size if source_size is None else source_size
        if start % rows or (shard_size % rows and start + shard_size != full):
            raise WeightShapeError(
                f"rows [{start}, {start + shard_size}) of a {full}-row FP8 weight do not fall on whole {rows}-row "
                f"blocks of its scale, so their scales cannot be taken apart from the neighbouring rows'"
            )
        super().load_shard(
            loaded_weight,
            sum(-(-n // rows) for n in self.row_sizes[:i]),
            -(-shard_size // rows),
            dim="output",
            source_start=start // rows,
            source_size=-(-full // rows),
        )
