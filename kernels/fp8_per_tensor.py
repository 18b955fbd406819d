"""Per-tensor FP8 family: a flat Triton amax kernel; quantize/dequantize from fp8_tiles."""

import torch

from kernels.fp8_tiles import dequantize_triton, quantize_triton
from kernels.triton_common import (abs_nan_to_inf, as_kernel_input, build, check_input, load_f32, max_all, tile,
                                   tl, triton)


def _amax_flat_kernel(x_ptr, partial_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = abs_nan_to_inf(load_f32(x_ptr + offs, offs < n, IS_BF16))
    tl.store(partial_ptr + tl.program_id(0), max_all(a, 0))


def amax_per_tensor_triton(w: torch.Tensor) -> torch.Tensor:
    """max(|w|) over the whole tensor: 0-d float32; +Inf when w holds NaN or Inf.

    Args:
        w: contiguous bf16/fp16/fp32 tensor of any shape, on cuda or cpu (interpreted).
    Raises:
        TypeError / ValueError: wrong dtype, non-contiguous, unsupported device.
    """
    check_input(w, "amax_per_tensor_triton", ndim=None)
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=w.device)
    tn, tk = tile(w.device)
    block = tn * tk
    partial = torch.empty(triton.cdiv(w.numel(), block), dtype=torch.float32, device=w.device)
    x, is_bf16 = as_kernel_input(w)
    build(_amax_flat_kernel, w.device.type == "cpu")[(partial.numel(),)](x, partial, w.numel(), IS_BF16=is_bf16,
                                                                         BLOCK=block)
    return partial.amax()


__all__ = ["amax_per_tensor_triton", "dequantize_triton", "quantize_triton"]
