"""Weight pieces (Limitations 10): a weight quantized from its loaded tensors themselves, never materialized.

When every load of a weight is a verbatim copy (``counting.record_loader``: the whole loaded tensor, same dtype, one
contiguous region) of a tensor already on the session's device, and the quant method accepts them
(``accepts_weight_pieces``), processing skips the materialize-and-replay of that weight and hands these pieces,
[(flat element offset, tensor)], to the quant method instead: a module's ``weight`` (``processing``) or one unit of
a unit-wise module (``units``, which also uses :func:`_piece_spans` to decide whether a unit may wait in its
module's queue). Nothing here writes; a None answer means the loads are materialized and replayed as before.
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.reload.types import BufferedLoad, LayerReloadingInfo


def _weight_pieces(module: nn.Module, info: LayerReloadingInfo) -> list[tuple[int, torch.Tensor]] | None:
    """The module's ``weight`` as its loaded tensors (:func:`_loaded_pieces`), else None."""
    quant_method = getattr(module, "quant_method", None)
    meta = info.restore_metadata.get("weight")
    if quant_method is None or meta is None:
        return None
    loads = [b for b in info.loaded_weights if b.param_name == "weight"]
    return _loaded_pieces(quant_method, meta.shape, loads, info.session.device)


def _piece_spans(
    quant_method, shape: torch.Size, loads: list[BufferedLoad], device: torch.device, first: int = 0
) -> list[tuple[int, int]] | None:
    """The (flat element offset, numel) of each of ``loads`` in a weight of ``shape``, when every one is a
    verbatim copy of a tensor already on ``device`` and the quant method takes them as pieces
    (``accepts_weight_pieces``); else None. Reads nothing. ``first``: the flat offset of the weight in the
    parameter the loads were recorded against (a unit's, in its module's)."""
    if not loads or any(b.verbatim_at is None for b in loads):
        return None
    spans = [(b.verbatim_at - first, b.loaded_weight.numel()) for b in loads]
    if not quant_method.accepts_weight_pieces(shape, spans):
        return None
    if any(b.loaded_weight.device != device for b in loads):  # before reading a lazy checkpoint tensor
        return None
    return spans


def _loaded_pieces(
    quant_method, shape: torch.Size, loads: list[BufferedLoad], device: torch.device, first: int = 0
) -> list[tuple[int, torch.Tensor]] | None:
    """A weight of ``shape`` as the loaded tensors themselves, [(flat element offset, tensor)], when
    :func:`_piece_spans` takes the loads and each is contiguous: the copy into the staging buffer is then
    skipped (on a CPU load, a memory-mapped checkpoint tensor is quantized where the page cache holds it).
    Else None (Limitations 10)."""
    spans = _piece_spans(quant_method, shape, loads, device, first)
    if spans is None:
        return None
    pieces = []
    for (offset, _), b in zip(spans, loads, strict=True):
        t = b.loaded_weight if isinstance(b.loaded_weight, torch.Tensor) else b.loaded_weight.materialize()
        if not t.is_contiguous():
            return None
        pieces.append((offset, t))
    return pieces
