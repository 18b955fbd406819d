"""The Triton FP8 kernels as torch.library custom ops, with fake (meta) implementations, so
torch.compile can trace through them and fake-tensor dispatch sees one op each.

Eager calls skip the custom op and run the launch wrapper directly: calling a custom op the first
time imports torch._dynamo (its backend implementation is wrapped in ``torch._disable_dynamo``), and
with it sympy, Inductor and torch.distributed.fsdp: seconds of a cold load
(``benchmarks/first_load_profile.py``). The op is taken only while torch.compile / torch.export traces
(``torch.compiler.is_compiling()``, a flag read) or for tensor subclasses (FakeTensor, functional
tensors), so the load path never imports the compiler stack.
"""

from __future__ import annotations

import torch

from layerwise.kernels.fp8_tiles import amax_triton, dequantize_triton, quantize_triton
from layerwise.kernels.reference import FP8_DTYPE, scale_shape


def _use_op(*tensors: torch.Tensor) -> bool:
    """Whether to go through the registered custom op: while compiling, or for tensor subclasses."""
    # an nn.Parameter is a plain tensor here (the forward passes layer.weight); other subclasses take the op
    return torch.compiler.is_compiling() or any(type(t) not in (torch.Tensor, torch.nn.Parameter) for t in tensors)


@torch.library.custom_op("layerwise::fp8_amax_triton", mutates_args=())
def _amax_op(w: torch.Tensor, granularity: str) -> torch.Tensor:
    return amax_triton(w.contiguous(), granularity)


@_amax_op.register_fake
def _(w, granularity):
    return w.new_empty(scale_shape(w.shape, granularity), dtype=torch.float32)


@torch.library.custom_op("layerwise::fp8_quantize_triton", mutates_args=())
def _quantize_op(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quantize_triton(w.contiguous(), scale)


@_quantize_op.register_fake
def _(w, scale):
    return torch.empty_like(w, dtype=FP8_DTYPE)


@torch.library.custom_op("layerwise::fp8_dequantize_triton", mutates_args=())
def _dequantize_op(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_triton(q.contiguous(), scale, dtype)


@_dequantize_op.register_fake
def _(q, scale, dtype):
    return torch.empty_like(q, dtype=dtype)


def fp8_amax_triton(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """Triton amax at ``granularity`` ("tensor", "channel", "block"); float32, scale-shaped
    (see :func:`kernels.fp8_tiles.amax_triton`; op ``layerwise::fp8_amax_triton``)."""
    if _use_op(w):
        return _amax_op(w, granularity)
    return amax_triton(w.contiguous(), granularity)


def fp8_quantize_triton(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton quantize; the granularity is read off the scale's shape (see
    :func:`kernels.fp8_tiles.quantize_triton`; op ``layerwise::fp8_quantize_triton``). ``out``: written in
    place and returned; eagerly the kernel writes it directly when it is contiguous (no FP8 temporary)."""
    if _use_op(w, scale, *(() if out is None else (out,))):
        q = _quantize_op(w, scale)
        return q if out is None else out.copy_(q)
    if out is not None and not out.is_contiguous():
        return out.copy_(quantize_triton(w.contiguous(), scale))
    return quantize_triton(w.contiguous(), scale, out)


def fp8_dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Triton dequantize to ``dtype`` (see :func:`kernels.fp8_tiles.dequantize_triton`; op
    ``layerwise::fp8_dequantize_triton``)."""
    if _use_op(q, scale):
        return _dequantize_op(q, scale, dtype)
    return dequantize_triton(q.contiguous(), scale, dtype)
