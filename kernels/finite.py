"""Finiteness checks that a reload reads once, at its end, instead of once per module.

Every NaN/Inf check reads its answer on the host (``bool(tensor)``): on CUDA that is a synchronization,
and one per module leaves the GPU idle while Python routes the next module's tensors. (The H100 reload
figures in benchmarks/results/reload_latency_cuda_8b.json predate this; that these waits explain their gap to
the copy floor is our reading, not yet measured.) Inside
:func:`deferred_finite_checks` a check appends a 0-d bool device tensor (True: the tensor holds NaN or Inf,
:func:`layerwise.kernels.reference.non_finite_flag`) to the caller's list instead of raising; the caller
reads the list later, in one synchronization. What the checked tensor was used for in the meantime has
happened: an FP8 weight with a NaN was quantized (with a scale of 1.0 or Inf) and written. Only a
caller that can report such a write uses this (``layerwise.reload.deferred``, Limitations 12).

The state is a context variable: a plain list of flags per ``with`` block, nothing that holds a model.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

_SINK: ContextVar[list[torch.Tensor] | None] = ContextVar("layerwise_deferred_finite_checks", default=None)


@contextlib.contextmanager
def deferred_finite_checks(sink: list[torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Within the block, :func:`layerwise.kernels.require_finite` appends a 0-d bool flag to ``sink``
    (True: NaN or Inf) instead of reading it and raising. Yields ``sink``."""
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def deferred_sink() -> list[torch.Tensor] | None:
    """The list that checks are deferred to, or None when they raise at once."""
    return _SINK.get()
