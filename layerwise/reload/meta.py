"""Moving a layer between its kernel format and its checkpoint format on the meta device."""

from __future__ import annotations

import torch
from torch import nn

from layerwise.reload.types import LayerReloadingInfo


def layer_tensors(layer: nn.Module) -> dict[str, torch.Tensor]:
    """The layer's own (non-recursive) parameters and buffers, by name, None entries skipped."""
    out = {n: p for n, p in layer._parameters.items() if p is not None}
    out.update({n: b for n, b in layer._buffers.items() if b is not None})
    return out


def set_layer_tensors(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Replace the layer's parameters and buffers by ``tensors`` (the same objects, not copies).

    Names present now but absent from ``tensors`` are removed; ``None`` entries (bias=False) stay.
    """
    for name in [n for n, p in layer._parameters.items() if p is not None]:
        del layer._parameters[name]
    for name in [n for n, b in layer._buffers.items() if b is not None]:
        del layer._buffers[name]
    for name, t in tensors.items():
        if isinstance(t, nn.Parameter):
            layer.register_parameter(name, t)
        else:
            layer.register_buffer(name, t)


def restore_layer_on_meta(layer: nn.Module, info: LayerReloadingInfo) -> None:
    """Put the checkpoint-format meta parameters back on the layer (kernel tensors are kept in info)."""
    set_layer_tensors(layer, dict(info.restore_metadata))


def materialize_layer(layer: nn.Module, info: LayerReloadingInfo, device: torch.device) -> None:
    """Give the layer fresh, uninitialized checkpoint-format parameters on ``device``.

    Each new parameter has the type, shape, dtype and layout of its meta counterpart and the
    original (unwrapped) weight loader, so replayed loads write real memory.
    """
    fresh = {
        name: meta.with_data(
            torch.empty(meta.shape, dtype=meta.dtype, device=device), weight_loader=info.weight_loaders[name]
        )
        for name, meta in info.restore_metadata.items()
    }
    set_layer_tensors(layer, fresh)
