"""The Triton FP8 kernels as torch.library custom ops, with fake (meta) implementations, so
torch.compile can trace through them and dispatch modes see one op each."""

from __future__ import annotations

import torch

from layerwise.kernels.fp8_tiles import amax_triton, dequantize_triton, quantize_triton
from layerwise.kernels.reference import FP8_DTYPE, scale_shape


@torch.library.custom_op("layerwise::fp8_amax_triton", mutates_args=())
def fp8_amax_triton(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """Triton amax at ``granularity`` ("tensor", "channel", "block"); float32, scale-shaped."""
    return amax_triton(w.contiguous(), granularity)


@fp8_amax_triton.register_fake
def _(w, granularity):
    return w.new_empty(scale_shape(w.shape, granularity), dtype=torch.float32)


@torch.library.custom_op("layerwise::fp8_quantize_triton", mutates_args=())
def fp8_quantize_triton(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Triton quantize; the granularity is read off the scale's shape."""
    return quantize_triton(w.contiguous(), scale)


@fp8_quantize_triton.register_fake
def _(w, scale):
    return torch.empty_like(w, dtype=FP8_DTYPE)


@torch.library.custom_op("layerwise::fp8_dequantize_triton", mutates_args=())
def fp8_dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton dequantize to ``dtype``."""
    return dequantize_triton(q.contiguous(), scale, dtype)


@fp8_dequantize_triton.register_fake
def _(q, scale, dtype):
    return torch.empty_like(q, dtype=dtype)
