"""Counting what a weight loader writes, by running it against the meta parameter.

A loader may narrow, transpose or shard; trusting tensor sizes would miss that. Instead the
loader is run on the meta device (no data, no memory) under a TorchDispatchMode that records the
destination view (storage offset, sizes, strides) of every in-place write. vLLM counts copied
elements the same way (reload/meta.py); recording the regions as well lets finalize tell a double
write from a missing one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from layerwise.checkpoint import LazyTensor
from layerwise.dispatch import EagerDispatchMode
from layerwise.reload.types import intervals_of_view

aten = torch.ops.aten
_WRITE_OPS = {aten.copy_.default, aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default}


class WriteRecorder(EagerDispatchMode):
    """Records the destination region of every copy_/fill_/zero_ executed inside the mode, and which of them
    copy ``source`` verbatim (the whole tensor, same dtype, both contiguous) into one contiguous region."""

    def __init__(self, source: torch.Tensor | None = None):
        super().__init__()
        self.source = source
        self.writes: list = []
        self.verbatim: list[int] = []  # flat element offsets of the verbatim copies
        self.other_mutations = 0  # in-place ops other than the recorded writes (a scale_, an index_put_)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func not in _WRITE_OPS and func._schema.is_mutable:
            self.other_mutations += 1
        if func in _WRITE_OPS:
            dst = args[0]
            self.writes.append(intervals_of_view(dst.storage_offset(), tuple(dst.shape), tuple(dst.stride())))
            src = args[1] if func is aten.copy_.default else None
            if (
                self.source is not None
                and src is self.source
                and (src.dtype, src.numel()) == (dst.dtype, dst.numel())
                and src.is_contiguous()
                and dst.is_contiguous()
            ):
                self.verbatim.append(dst.storage_offset())
        return func(*args, **(kwargs or {}))


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, (torch.Tensor, LazyTensor)) else x  # a LazyTensor: nothing is read


def record_loader(
    loader: Callable, meta_param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: Any
) -> tuple[list, int | None]:
    """Run ``loader(meta_param, loaded_weight on meta, shard_id)`` and return its writes.

    Returns:
        (writes, verbatim_at): the (starts, length) element intervals into ``meta_param``'s storage; and, when
        the loader's one write is a verbatim copy of ``loaded_weight`` (whole, same dtype, into a contiguous
        region: no slicing, cast or transpose) and it runs no other in-place op, the flat element offset of
        that region, else None.
    Raises:
        whatever the loader raises (e.g. a shape mismatch), before any real memory is touched.
    """
    source = _to_meta(loaded_weight)
    recorder = WriteRecorder(source)
    with recorder:
        loader(meta_param, source, shard_id)
    verbatim = len(recorder.writes) == 1 and recorder.verbatim and not recorder.other_mutations
    verbatim_at = recorder.verbatim[0] if verbatim else None
    return recorder.writes, verbatim_at


def written_numel(writes: list) -> int:
    """Total elements written (duplicates counted twice), as vLLM's load_numel."""
    return sum(len(starts) * length for starts, length in writes)
