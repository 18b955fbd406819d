"""Triton FP8 kernels over 2-D tiles: amax, quantize and dequantize for every scale layout.

A weight is seen as an [N, K] matrix (a per-tensor weight of any shape as rows of its last dim).
One scale per tensor, per row (channel), or per 128 x 128 block: the quantize and dequantize
kernels look up each element's scale by its row and column (SCALE_MODE 0, 1, 2), so the three
granularities share two kernels and one e4m3 encoding. The amax kernel reduces each tile and
writes per-tile partials (one per tile, or one per row of a tile); torch finishes the reduction,
which for per-block tiles of 128 x 128 is no work at all.

FP8 data crosses the kernel boundary as uint8 bytes (see ``kernels.triton_common``), so the same
kernels run on sm_80 and newer, and under the interpreter on CPU.
"""

import torch

from layerwise.kernels.reference import (
    BLOCK_SIZE,
    FP8_DTYPE,
    GRANULARITIES,
    GRANULARITY_CODES,
    scale_layout,
    scale_shape,
)
from layerwise.kernels.triton_common import (
    abs_nan_to_inf,
    as_kernel_input,
    as_matrix,
    check_input,
    e4m3_bits,
    e4m3_value,
    grid_1d,
    helper,
    launch,
    load_f32,
    max_all,
    tile,
    tile_index,
    tile_rows_cols,
    tl,
    triton,
)


def _amax_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    n_cols,
    IS_BF16: tl.constexpr,
    PER_ROW: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_K: tl.constexpr,
):
    row_tile, col_tile = tile_index(n_cols, TILE_K)
    rows = row_tile * TILE_N + tl.arange(0, TILE_N)
    cols = col_tile * TILE_K + tl.arange(0, TILE_K)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    a = abs_nan_to_inf(load_f32(x_ptr + rows[:, None] * n_cols + cols[None, :], mask, IS_BF16))
    if PER_ROW:  # out [col_tiles, n_rows]: this column tile's max of each of its rows
        tl.store(out_ptr + col_tile * n_rows + rows, max_all(a, 1), mask=rows < n_rows)
    else:  # out [row_tiles * col_tiles]: one max per tile
        tl.store(out_ptr + tl.program_id(0), max_all(max_all(a, 1), 0))


@helper
def load_scale(
    ptr, rows, cols, mask, scale_cols, SCALE_MODE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """The scale of each element of a [TILE_N, TILE_K] tile (rows [TILE_N, 1], cols [1, TILE_K]):
    one for the tensor (SCALE_MODE 0), one per row (1), or one per BLOCK_N x BLOCK_K block of a
    [*, scale_cols] scale grid (2). Every mode loads a full tile, so the branches agree in shape."""
    if SCALE_MODE == 0:
        offs = rows * 0 + cols * 0
    elif SCALE_MODE == 1:
        offs = rows + cols * 0
    else:
        offs = (rows // BLOCK_N) * scale_cols + cols // BLOCK_K
    return tl.load(ptr + offs, mask=mask, other=1.0)


def _quantize_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    scale_cols,
    IS_BF16: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_K: tl.constexpr,
):
    rows, cols, mask = tile_rows_cols(n_rows, n_cols, TILE_N, TILE_K)
    x = load_f32(x_ptr + rows * n_cols + cols, mask, IS_BF16)
    scale = load_scale(scale_ptr, rows, cols, mask, scale_cols, SCALE_MODE, BLOCK_N, BLOCK_K)
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0)
    tl.store(out_ptr + rows * n_cols + cols, e4m3_bits(y).to(tl.uint8), mask=mask)


def _dequantize_kernel(
    q_ptr,
    out_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    scale_cols,
    OUT_BF16: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILE_N: tl.constexpr,
    TILE_K: tl.constexpr,
):
    rows, cols, mask = tile_rows_cols(n_rows, n_cols, TILE_N, TILE_K)
    q = e4m3_value(tl.load(q_ptr + rows * n_cols + cols, mask=mask, other=0).to(tl.int32))
    y = q * load_scale(scale_ptr, rows, cols, mask, scale_cols, SCALE_MODE, BLOCK_N, BLOCK_K)
    if OUT_BF16:  # out_ptr holds int16 bits: round half to even by hand (the interpreter truncates)
        bits = y.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(out_ptr + rows * n_cols + cols, (bits >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + rows * n_cols + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def amax_triton(w: torch.Tensor, granularity: str = "tensor") -> torch.Tensor:
    """max(|w|) per scale group, float32 of :func:`kernels.reference.scale_shape`; +Inf for a group
    holding NaN or Inf.

    Args:
        w: contiguous bf16/fp16/fp32 tensor on cuda (compiled) or cpu (interpreted); 2-D [N, K]
            for "channel" and "block", any shape for "tensor".
        granularity: "tensor", "channel" or "block".
    Raises:
        TypeError / ValueError: wrong dtype, rank, layout, device or granularity.
    """
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; choose one of {GRANULARITIES}")
    check_input(w, "amax_triton", ndim=None if granularity == "tensor" else 2)
    shape = scale_shape(w.shape, granularity)
    if w.numel() == 0:
        return torch.zeros(shape, dtype=torch.float32, device=w.device)
    x, is_bf16 = as_kernel_input(as_matrix(w))
    n_rows, n_cols = x.shape
    tile_n, tile_k = BLOCK_SIZE if granularity == "block" else tile(w.device)
    grid = grid_1d(n_rows, n_cols, tile_n, tile_k)
    per_row = granularity == "channel"
    partial = torch.empty(
        (triton.cdiv(n_cols, tile_k), n_rows) if per_row else grid, dtype=torch.float32, device=w.device
    )
    launch(
        _amax_kernel,
        w.device,
        grid,
        x,
        partial,
        n_rows,
        n_cols,
        IS_BF16=is_bf16,
        PER_ROW=per_row,
        TILE_N=tile_n,
        TILE_K=tile_k,
    )
    if granularity == "tensor":
        return partial.amax()
    if per_row:
        return partial.amax(dim=0).unsqueeze(1)
    return partial.view(shape)


def _launch(fn, x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, granularity: str, **meta) -> None:
    n_rows, n_cols = x.shape
    tile_n, tile_k = tile(x.device)
    scale_cols = scale.shape[-1] if granularity == "block" else 1
    launch(
        fn,
        x.device,
        grid_1d(n_rows, n_cols, tile_n, tile_k),
        x,
        out,
        scale,
        n_rows,
        n_cols,
        scale_cols,
        SCALE_MODE=GRANULARITY_CODES[granularity],
        BLOCK_N=BLOCK_SIZE[0],
        BLOCK_K=BLOCK_SIZE[1],
        TILE_N=tile_n,
        TILE_K=tile_k,
        **meta,
    )


def quantize_triton(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """e4m3fn(clamp(float32(w) / scale, -448, 448)) with the scale looked up per element.

    Args:
        w: contiguous bf16/fp16/fp32 tensor, 2-D [N, K] (any shape for a per-tensor scale), on
            cuda (compiled) or cpu (interpreted).
        scale: float32 scale: 1 element (per tensor), [N, 1] (per channel) or
            [ceil(N/128), ceil(K/128)] (per block), on w's device.
        out: optional contiguous float8_e4m3fn tensor of w's shape on w's device, not sharing w's storage.
    Returns:
        float8_e4m3fn tensor of w's shape, bit-identical to ``kernels.reference.quantize``.
    Raises:
        TypeError / ValueError: wrong dtype, layout, scale shape or device.
    """
    granularity = scale_layout(w, scale)
    check_input(w, "quantize_triton", ndim=None if granularity == "tensor" else 2)
    if out is None:
        out = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    if out.shape != w.shape or out.dtype != FP8_DTYPE or not out.is_contiguous() or out.device != w.device:
        raise ValueError(f"quantize_triton: out must be contiguous {FP8_DTYPE} of shape {tuple(w.shape)} on {w.device}")
    if out.numel() and out.untyped_storage().data_ptr() == w.untyped_storage().data_ptr():
        raise ValueError("quantize_triton: out shares memory with w (the kernel reads w while it writes out)")
    if w.numel() == 0:
        return out
    x, is_bf16 = as_kernel_input(as_matrix(w))
    scale = scale.to(device=w.device, dtype=torch.float32).contiguous()
    _launch(_quantize_kernel, x, as_matrix(out).view(torch.uint8), scale, granularity, IS_BF16=is_bf16)
    return out


def dequantize_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32(q) * scale, cast to ``dtype`` (bf16, fp16 or fp32); same scale layouts as quantize.

    Args:
        q: contiguous float8_e4m3fn tensor, 2-D [N, K] (any shape for a per-tensor scale).
        scale: float32, 1 element, [N, 1] or [ceil(N/128), ceil(K/128)].
    Returns:
        tensor of q's shape in ``dtype``, bit-identical to ``kernels.reference.dequantize``.
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
        dst = as_matrix(out)
        _launch(
            _dequantize_kernel,
            as_matrix(q).view(torch.uint8),
            dst.view(torch.int16) if is_bf16 else dst,
            scale.to(torch.float32).contiguous(),
            granularity,
            OUT_BF16=is_bf16,
        )
    return out


__all__ = ["amax_triton", "dequantize_triton", "quantize_triton"]
