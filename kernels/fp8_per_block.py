"""Per-block FP8 family: one scale per 128 x 128 block (DeepSeek-V3 / DeepGEMM layout)."""

import torch

from kernels.fp8_tiles import dequantize_triton, quantize_triton
from kernels.reference import BLOCK_SIZE, scale_shape
from kernels.triton_common import (abs_nan_to_inf, as_kernel_input, build, check_input, load_f32, max_all, tl)


def _amax_blocks_kernel(x_ptr, out_ptr, n_rows, n_cols, IS_BF16: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]
    cols = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    a = abs_nan_to_inf(load_f32(x_ptr + rows * n_cols + cols, mask, IS_BF16))
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), max_all(max_all(a, 1), 0))


def amax_per_block_triton(w: torch.Tensor) -> torch.Tensor:
    """max(|w|) per 128 x 128 block: float32 [ceil(N/128), ceil(K/128)]; +Inf where NaN/Inf.

    Args:
        w: contiguous 2-D bf16/fp16/fp32 tensor [N, K] on cuda or cpu (interpreted).
    Raises:
        TypeError / ValueError: wrong dtype, rank, layout or device.
    """
    check_input(w, "amax_per_block_triton")
    out = torch.zeros(scale_shape(w.shape, "block"), dtype=torch.float32, device=w.device)
    if w.numel() == 0:
        return out
    x, is_bf16 = as_kernel_input(w)
    build(_amax_blocks_kernel, w.device.type == "cpu")[tuple(out.shape)](
        x, out, w.shape[0], w.shape[1], IS_BF16=is_bf16, BLOCK_N=BLOCK_SIZE[0], BLOCK_K=BLOCK_SIZE[1])
    return out


__all__ = ["amax_per_block_triton", "dequantize_triton", "quantize_triton"]
