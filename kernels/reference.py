"""Torch reference for FP8 (e4m3fn) per-tensor quantization.

This is the definition every other kernel is tested against, bit for bit, and the default path on
CPU. The arithmetic is fixed so that any implementation can reproduce it exactly:

    amax  = max(|w|) over the whole tensor, in float32 (exact: max involves no rounding)
    scale = amax / 448 (float32), or 1.0 when amax == 0, and at least float32's smallest normal
    q     = e4m3fn(round_to_nearest_even(clamp(float32(w) * (1 / scale), -448, 448)))

Multiplying by the float32 reciprocal (rather than dividing) keeps the per-element work a single
correctly-rounded multiply, which Triton reproduces exactly; a Triton fp32 division is not IEEE
division on every backend. The recipe (scale = amax / finfo(e4m3).max) is the one vLLM's
``scaled_fp8_quant`` and torchao's ``Float8WeightOnlyConfig`` use for per-tensor scales.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
# Elements handled per step of the chunked quantize: bounds the float32 temporary to 4 MiB.
CHUNK_NUMEL = 1 << 20


class NonFiniteError(ValueError):
    """A tensor to be quantized holds NaN or +-Inf, which would poison its scale."""


def amax(w: torch.Tensor) -> torch.Tensor:
    """Largest absolute value of ``w``.

    Args:
        w: tensor of any shape, floating dtype (bf16, fp16, fp32), any device.
    Returns:
        0-d float32 tensor on ``w.device``; NaN or Inf when ``w`` holds any non-finite value.
    Uses ``aminmax`` (one pass, no temporary the size of ``w``).
    """
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=w.device)
    lo, hi = torch.aminmax(w)
    return torch.maximum(hi.float(), -lo.float())


def scale_from_amax(amax_value: torch.Tensor) -> torch.Tensor:
    """Per-tensor e4m3 scale from an amax.

    Args:
        amax_value: float32 tensor of any shape (one amax per scale), finite, >= 0.
    Returns:
        float32 tensor of the same shape: amax / 448; 1.0 where amax == 0 (an all-zero tensor);
        never below ``torch.finfo(float32).tiny`` so that 1 / scale stays finite.
    Raises:
        NonFiniteError: when any amax is NaN or Inf.
    """
    amax_value = amax_value.float()
    if not bool(torch.isfinite(amax_value).all()):
        raise NonFiniteError(f"non-finite amax {amax_value.flatten()[:4].tolist()}")
    scale = torch.clamp(amax_value / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny)
    return torch.where(amax_value > 0, scale, torch.ones_like(scale))


def quantize(w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize ``w`` to float8_e4m3fn with one float32 scale.

    Args:
        w: floating tensor of any shape, contiguous or not.
        scale: 0-d or 1-element float32 tensor (from :func:`scale_from_amax`).
        out: optional float8_e4m3fn tensor of ``w``'s shape, contiguous, written in place.
    Returns:
        float8_e4m3fn tensor of ``w``'s shape (``out`` when given).
    Work is done in chunks of ``CHUNK_NUMEL`` elements so the float32 temporary stays <= 4 MiB.
    """
    if out is None:
        out = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    inv_scale = torch.reciprocal(scale.reshape(()).float())
    src = w.reshape(-1)
    dst = out.view(-1)
    # A separate float32 buffer: the input is never written, even when it is float32 already.
    buf = torch.empty(min(CHUNK_NUMEL, src.numel()), dtype=torch.float32, device=w.device)
    for start in range(0, src.numel(), CHUNK_NUMEL):
        stop = min(start + CHUNK_NUMEL, src.numel())
        tmp = buf[: stop - start]
        tmp.copy_(src[start:stop])
        tmp.mul_(inv_scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        dst[start:stop].copy_(tmp)
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``float32(q) * scale`` cast to ``dtype`` (same shape as q)."""
    return (q.to(torch.float32) * scale.reshape(()).float()).to(dtype)


def quantize_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """amax -> scale -> quantize for one tensor.

    Returns:
        (q, scale): float8_e4m3fn tensor of ``w``'s shape and a 0-d float32 scale.
    Raises:
        NonFiniteError: when ``w`` holds NaN or Inf.
    """
    scale = scale_from_amax(amax(w))
    return quantize(w, scale), scale
