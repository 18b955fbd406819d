"""FP8 kernels: Triton implementations and their bit-exact torch reference.

``kernel`` selects the implementation: ``"torch"`` (the reference), ``"triton"`` (compiled on CUDA,
interpreted on CPU), or ``None`` for the device default (triton on CUDA, torch elsewhere).
This package imports only torch and triton.
"""

from __future__ import annotations

import torch

from kernels import reference
from kernels.fp8 import HAS_TRITON, amax_triton, quantize_triton
from kernels.reference import FP8_DTYPE, FP8_E4M3_MAX, NonFiniteError, dequantize, scale_from_amax

KERNELS = ("torch", "triton")


def resolve_kernel(kernel: str | None, device: torch.device | str) -> str:
    """Pick the kernel name for ``device``.

    Raises:
        ValueError: unknown kernel name.
    """
    if kernel is None:
        return "triton" if torch.device(device).type == "cuda" and HAS_TRITON else "torch"
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNELS}")
    return kernel


def fp8_amax(w: torch.Tensor, kernel: str = "torch") -> torch.Tensor:
    """max(|w|) as a 0-d float32 tensor (non-finite when ``w`` is)."""
    return amax_triton(w.contiguous()) if kernel == "triton" else reference.amax(w)


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor, kernel: str = "torch", out=None) -> torch.Tensor:
    """Quantize ``w`` with one float32 scale to float8_e4m3fn of the same shape."""
    if kernel == "triton":
        return quantize_triton(w.contiguous(), scale, out)
    return reference.quantize(w, scale, out)


def fp8_quantize_per_tensor(w: torch.Tensor, kernel: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """amax -> scale -> quantize for one tensor.

    Args:
        w: floating tensor [*], bf16/fp16/fp32.
        kernel: "torch" or "triton".
    Returns:
        (q, scale): float8_e4m3fn tensor of ``w``'s shape, 0-d float32 scale.
    Raises:
        NonFiniteError: ``w`` holds NaN or Inf.
    """
    scale = scale_from_amax(fp8_amax(w, kernel))
    return fp8_quantize(w, scale, kernel), scale


__all__ = [
    "FP8_DTYPE", "FP8_E4M3_MAX", "KERNELS", "NonFiniteError", "dequantize", "fp8_amax",
    "fp8_quantize", "fp8_quantize_per_tensor", "resolve_kernel", "scale_from_amax",
]
