"""Typed parameters: a parameter carries its weight_loader and its shard layout from construction.

Follows vLLM's ``BasevLLMParameter`` idea (the loader and output_dim/input_dim are constructor
arguments), so no attribute is ever set on a plain ``nn.Parameter``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import nn

from layerwise.errors import WeightShapeError

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
        return type(self)(data, weight_loader or self.weight_loader, self.output_dim, self.input_dim)

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
    """Raise WeightShapeError for a tensor that is not floating point (an integer or bool dtype) loaded into a
    floating-point parameter: a copy would cast it silently. ``loaded_weight``: a tensor or a lazy slice."""
    if param_dtype.is_floating_point and not loaded_weight.dtype.is_floating_point:
        raise WeightShapeError(f"checkpoint dtype {loaded_weight.dtype} for a {param_dtype} parameter")


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
