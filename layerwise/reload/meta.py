"""Moving a layer between its kernel format and its checkpoint format on the meta device."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

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


class StagingBuffer:
    """One byte buffer on the CPU, reused to materialize module after module in checkpoint format.

    A fresh allocation per module costs its page faults on first write: a copy into new memory runs several
    times slower than one into touched memory, and slower still when the kernel must first reclaim page
    cache. The buffer grows to the largest module staged. A first load stages the
    modules whose quant method replaces the weight (``QuantMethod.replaces_weight``) and frees the buffer
    with its session; a non-atomic reload stages every module and keeps the buffer on the model for the
    next reload (``layerwise.reload.release_staging`` frees it). Whatever of a processed module still
    aliases the buffer (a bias) is copied out by :meth:`release`.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._bytes = torch.empty(0, dtype=torch.uint8, device=device)

    @property
    def nbytes(self) -> int:
        """Bytes the buffer holds now."""
        return self._bytes.numel()

    def tensors(self, metas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Uninitialized tensors of the metas' shapes and dtypes, packed in the buffer (64-byte aligned)."""
        offsets, total = {}, 0
        for name, meta in metas.items():
            offsets[name] = total
            total += -(-(meta.numel() * meta.element_size()) // 64) * 64
        if self._bytes.numel() < total:
            self._bytes = torch.empty(0, dtype=torch.uint8, device=self.device)  # the old one is freed first
            self._bytes = torch.empty(total, dtype=torch.uint8, device=self.device)
        return {
            name: self._bytes[offsets[name] : offsets[name] + meta.numel() * meta.element_size()]
            .view(meta.dtype)
            .view(meta.shape)
            for name, meta in metas.items()
        }

    def release(self, layer: nn.Module) -> None:
        """Copy out every tensor of ``layer`` that still lives in the buffer, before the next module reuses it."""
        if self._bytes.numel() == 0:
            return
        lo = self._bytes.data_ptr()
        hi = lo + self._bytes.numel()
        kept = layer_tensors(layer)
        moved = {}
        for name, t in kept.items():
            if t.device != self.device or t.numel() == 0 or is_traceable_wrapper_subclass(t.data):
                continue  # a tensor subclass (torchao's) has no storage of its own: its method built it afresh
            if not lo <= t.untyped_storage().data_ptr() < hi:
                continue
            data = t.detach().clone()
            if hasattr(t, "with_data"):  # a typed parameter (ModelWeightParameter) keeps its type and loader
                moved[name] = t.with_data(data)
            elif isinstance(t, nn.Parameter):
                moved[name] = nn.Parameter(data, requires_grad=t.requires_grad)
            else:
                moved[name] = data
        if moved:
            set_layer_tensors(layer, {**kept, **moved})


def empty_like_metas(
    metas: dict[str, torch.Tensor], device: torch.device, staging: StagingBuffer | None = None
) -> dict[str, torch.Tensor]:
    """Uninitialized tensors of the metas' shapes and dtypes: in ``staging`` when given, else fresh on ``device``."""
    if staging is not None:
        return staging.tensors(metas)
    return {name: torch.empty(meta.shape, dtype=meta.dtype, device=device) for name, meta in metas.items()}


def materialize_layer(
    layer: nn.Module,
    info: LayerReloadingInfo,
    device: torch.device,
    staging: StagingBuffer | None = None,
    into: dict[str, torch.Tensor] | None = None,
    keep_on_meta: tuple[str, ...] = (),
) -> None:
    """Give the layer uninitialized checkpoint-format parameters on ``device``.

    Each new parameter has the type, shape, dtype and layout of its meta counterpart and the
    original (unwrapped) weight loader, so replayed loads write real memory. With ``staging`` the
    memory is the staging buffer's (reused by the next module); with ``into`` (tensors of the metas'
    names, shapes and dtypes: the live kernel tensors) it is theirs; else fresh. Parameters named in
    ``keep_on_meta`` stay the meta parameters (nothing will be loaded into them: their loads are quantized
    from the loaded tensors).
    """
    metas = {n: m for n, m in info.restore_metadata.items() if n not in keep_on_meta}
    data = {n: into[n].data for n in metas} if into is not None else empty_like_metas(metas, device, staging)
    fresh = {name: meta.with_data(data[name], weight_loader=info.weight_loaders[name]) for name, meta in metas.items()}
    fresh.update({n: info.restore_metadata[n] for n in keep_on_meta})
    set_layer_tensors(layer, fresh)
