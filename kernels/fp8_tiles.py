"""Triton quantize and dequantize over 2-D tiles, for any scale layout.

One scale per tensor, per row (channel), or per 128 x 128 block: the kernels look up each
element's scale by its row and column (SCALE_MODE 0, 1, 2), so all three granularities share the
same two kernels and the same e4m3 rounding.
"""

import torch

from kernels.triton_common import (as_kernel_input, build, check_input, helper, load_f32, round_to_e4m3, tile,
                                   tl, triton)
from kernels.reference import BLOCK_SIZE, FP8_DTYPE, scale_layout

_MODES = {"tensor": 0, "channel": 1, "block": 2}


@helper
def load_scale(ptr, rows, cols, mask, n_rows, scale_cols, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """The scale of each element of a [TILE_N, TILE_K] tile: one for the tensor (SCALE_MODE 0),
    one per row (1), or one per BLOCK_N x BLOCK_K block of a [*, scale_cols] scale grid (2)."""
    if SCALE_MODE == 0:
        return tl.load(ptr)
    if SCALE_MODE == 1:
        return tl.load(ptr + rows, mask=rows < n_rows, other=1.0)
    return tl.load(ptr + (rows // BLOCK_N) * scale_cols + cols // BLOCK_K, mask=mask, other=1.0)


def _quantize_kernel(x_ptr, out_ptr, inv_ptr, n_rows, n_cols, scale_cols, IS_BF16: tl.constexpr,
                     SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TILE_N: tl.constexpr, TILE_K: tl.constexpr):
    rows = (tl.program_id(0) * TILE_N + tl.arange(0, TILE_N))[:, None]
    cols = (tl.program_id(1) * TILE_K + tl.arange(0, TILE_K))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    x = load_f32(x_ptr + rows * n_cols + cols, mask, IS_BF16)
    inv = load_scale(inv_ptr, rows, cols, mask, n_rows, scale_cols, SCALE_MODE, BLOCK_N, BLOCK_K)
    y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    tl.store(out_ptr + rows * n_cols + cols, round_to_e4m3(y).to(tl.float8e4nv), mask=mask)


def _dequantize_kernel(q_ptr, out_ptr, scale_ptr, n_rows, n_cols, scale_cols, OUT_BF16: tl.constexpr,
                       SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_N: tl.constexpr,
                       TILE_K: tl.constexpr):
    rows = (tl.program_id(0) * TILE_N + tl.arange(0, TILE_N))[:, None]
    cols = (tl.program_id(1) * TILE_K + tl.arange(0, TILE_K))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    q = tl.load(q_ptr + rows * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = q * load_scale(scale_ptr, rows, cols, mask, n_rows, scale_cols, SCALE_MODE, BLOCK_N, BLOCK_K)
    if OUT_BF16:  # out_ptr holds int16 bits: round half to even by hand (the interpreter truncates)
        bits = y.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(out_ptr + rows * n_cols + cols, (bits >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + rows * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _as_2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() != 2 else t


def _launch(fn, x: torch.Tensor, out: torch.Tensor, scale_arg: torch.Tensor, granularity: str, **meta) -> None:
    n_rows, n_cols = _as_2d(x).shape
    tn, tk = tile(x.device)
    grid = (triton.cdiv(n_rows, tn), triton.cdiv(n_cols, tk))
    scale_cols = scale_arg.shape[-1] if scale_arg.dim() == 2 else 1
    build(fn, x.device.type == "cpu")[grid](x, out, scale_arg, n_rows, n_cols, scale_cols,
                                            SCALE_MODE=_MODES[granularity], BLOCK_N=BLOCK_SIZE[0],
                                            BLOCK_K=BLOCK_SIZE[1], TILE_N=tn, TILE_K=tk, **meta)


def quantize_triton(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3fn(clamp(float32(w) * (1 / scale))) with the scale looked up per element.

    Args:
        w: contiguous bf16/fp16/fp32 tensor, 2-D [N, K] (any shape for a per-tensor scale), on
            cuda (compiled) or cpu (interpreted).
        scale: float32 scale: 1 element (per tensor), [N, 1] (per channel) or
            [ceil(N/128), ceil(K/128)] (per block), on w's device.
        out: optional contiguous float8_e4m3fn tensor of w's shape.
    Returns:
        float8_e4m3fn tensor of w's shape, bit-identical to ``kernels.reference.quantize``.
    Raises:
        TypeError / ValueError: wrong dtype, layout, scale shape or device.
    """
    granularity = scale_layout(w, scale)
    check_input(w, "quantize_triton", ndim=None if granularity == "tensor" else 2)
    if out is None:
        out = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    if out.shape != w.shape or out.dtype != FP8_DTYPE or not out.is_contiguous():
        raise ValueError(f"quantize_triton: out must be contiguous {FP8_DTYPE} of shape {tuple(w.shape)}")
    if w.numel() == 0:
        return out
    inv = torch.reciprocal(scale.to(device=w.device, dtype=torch.float32)).contiguous()
    x, is_bf16 = as_kernel_input(w)
    _launch(_quantize_kernel, x, out, inv, granularity, IS_BF16=is_bf16)
    return out


def dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(q) * scale, cast to ``dtype`` (bf16, fp16 or fp32); same scale layouts as quantize.

    Raises:
        TypeError / ValueError: q not contiguous float8_e4m3fn, bad scale shape, unsupported dtype.
    """
    if q.dtype != FP8_DTYPE or not q.is_contiguous():
        raise TypeError(f"dequantize_triton: expected a contiguous {FP8_DTYPE} tensor, got {q.dtype}")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"dequantize_triton: unsupported output dtype {dtype}")
    granularity = scale_layout(q, scale)
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if q.numel():
        is_bf16 = dtype == torch.bfloat16
        _launch(_dequantize_kernel, q, out.view(torch.int16) if is_bf16 else out,
                scale.to(torch.float32).contiguous(), granularity, OUT_BF16=is_bf16)
    return out
