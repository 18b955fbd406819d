"""Per-channel FP8 family: one scale per output row; a row-wise Triton amax kernel."""

import torch

from kernels.fp8_tiles import dequantize_triton, quantize_triton
from kernels.triton_common import (abs_nan_to_inf, as_kernel_input, build, check_input, load_f32, max_all, tile,
                                   tl, triton)


def _amax_rows_kernel(x_ptr, out_ptr, n_rows, n_cols, IS_BF16: tl.constexpr, TILE_N: tl.constexpr,
                      TILE_K: tl.constexpr):
    rows = (tl.program_id(0) * TILE_N + tl.arange(0, TILE_N))[:, None]
    acc = tl.full([TILE_N, TILE_K], 0.0, tl.float32)  # tl.zeros is a jit function: not callable here
    for k0 in range(0, n_cols, TILE_K):
        cols = (k0 + tl.arange(0, TILE_K))[None, :]
        mask = (rows < n_rows) & (cols < n_cols)
        acc = tl.maximum(acc, abs_nan_to_inf(load_f32(x_ptr + rows * n_cols + cols, mask, IS_BF16)))
    row_ids = tl.program_id(0) * TILE_N + tl.arange(0, TILE_N)
    tl.store(out_ptr + row_ids, max_all(acc, 1), mask=row_ids < n_rows)


def amax_per_channel_triton(w: torch.Tensor) -> torch.Tensor:
    """max(|w[i, :]|) per row: float32 [N, 1]; +Inf for a row holding NaN or Inf.

    Args:
        w: contiguous 2-D bf16/fp16/fp32 tensor [N, K] on cuda or cpu (interpreted).
    Raises:
        TypeError / ValueError: wrong dtype, rank, layout or device.
    """
    check_input(w, "amax_per_channel_triton")
    n, k = w.shape
    out = torch.zeros(n, 1, dtype=torch.float32, device=w.device)
    if w.numel() == 0:
        return out
    tn, tk = tile(w.device)
    x, is_bf16 = as_kernel_input(w)
    build(_amax_rows_kernel, w.device.type == "cpu")[(triton.cdiv(n, tn),)](x, out, n, k, IS_BF16=is_bf16,
                                                                           TILE_N=tn, TILE_K=tk)
    return out


__all__ = ["amax_per_channel_triton", "dequantize_triton", "quantize_triton"]
