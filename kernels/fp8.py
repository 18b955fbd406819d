"""Triton kernels for FP8 (e4m3fn) per-tensor quantization: an amax kernel and a quantize kernel.

They reproduce :mod:`kernels.reference` bit for bit. Each kernel is built lazily in two forms:
compiled (``triton.jit``) for CUDA tensors and interpreted (Triton's CPU interpreter, the same
source run through NumPy) for CPU tensors, so ``kernel="triton"`` works on CPU without setting
``TRITON_INTERPRET`` before import.

Rounding: Triton 3.9's interpreter mis-rounds a direct fp32 -> float8e4nv cast when the rounding
carries into the next power of two (125.07 -> 64.0, measured here). The quantize kernel therefore
rounds onto the e4m3 grid in fp32 first (round half to even on a step of 2^(e-3), e = max(exponent,
-6)) using the 1.5 * 2^23 magic-number trick, and then casts a value that is exactly representable.
The exponent is read from the bits, so no log2 is involved. The sign is taken from the sign bit so
that -0.0 and negative values that round to zero keep their sign, as torch's cast does.
BF16 input is read as int16 bits and widened by a shift: the interpreter's own bf16 -> fp32
conversion flushes subnormals (measured here: 1e-38-scale weights quantized wrongly).
"""

import functools
from typing import Optional

import torch

from kernels.reference import FP8_DTYPE, FP8_E4M3_MAX

try:  # triton is optional at import time (macOS, Windows)
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class tl:  # noqa: N801 - stand-in so the kernel annotations below still evaluate
        constexpr = int

# Elements per program. The interpreter pays per program, so it gets much larger blocks.
_BLOCK_CUDA = 4096
_BLOCK_INTERPRET = 1 << 16


def _amax_kernel(x_ptr, partial_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    if IS_BF16:  # x_ptr holds the bf16 bits as int16; widening the bits is exact
        x = (tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    a = tl.abs(x)
    # NaN -> +inf so that a NaN anywhere makes the amax non-finite (tl.max may drop NaN).
    a = tl.where(a == a, a, float("inf"))
    # tl.reduce with the standard max combine rather than tl.max: tl.max is itself a jit function,
    # which an InterpretedFunction built without TRITON_INTERPRET=1 cannot call.
    tl.store(partial_ptr + pid, tl.reduce(a, 0, tl.standard._elementwise_max))


def _quantize_kernel(x_ptr, out_ptr, inv_scale_ptr, n, IS_BF16: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    inv_scale = tl.load(inv_scale_ptr)
    if IS_BF16:
        x = (tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2**23: adding and subtracting it rounds half to even to an integer
    r = ((a / step + magic) - magic) * step  # a / step is exact: step is a power of two
    r = tl.where(bits < 0, -r, r)
    tl.store(out_ptr + offs, r.to(tl.float8e4nv), mask=mask)


@functools.lru_cache(maxsize=None)
def _build(fn, interpret: bool):
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


def _check(w: torch.Tensor, name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError("kernel='triton' requested but triton is not installed")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected a bf16/fp16/fp32 tensor, got {w.dtype}")
    if not w.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (shape {tuple(w.shape)}, stride {w.stride()})")
    if w.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: triton kernels run on cuda (or cpu, interpreted); got {w.device}")


def _launch(fn, w: torch.Tensor, *args) -> int:
    """Run ``fn`` over w's elements; ``w`` is passed first (as int16 bits when it is bf16)."""
    interpret = w.device.type == "cpu"
    block = _BLOCK_INTERPRET if interpret else _BLOCK_CUDA
    grid = (triton.cdiv(w.numel(), block),)
    is_bf16 = w.dtype == torch.bfloat16
    # bf16 goes in as its int16 bits: the interpreter (NumPy has no bf16) flushes bf16 subnormals
    # when converting to fp32, while shifting the bits into the high half of an fp32 is exact.
    x = w.view(torch.int16) if is_bf16 else w
    _build(fn, interpret)[grid](x, *args, w.numel(), IS_BF16=is_bf16, BLOCK=block)
    return grid[0]


def amax_triton(w: torch.Tensor) -> torch.Tensor:
    """Triton amax: max(|w|) over the whole tensor.

    Args:
        w: contiguous bf16/fp16/fp32 tensor on cuda (compiled) or cpu (interpreted).
    Returns:
        0-d float32 tensor; +Inf when ``w`` holds NaN or Inf (the reference returns NaN or Inf:
        both are non-finite and rejected by ``scale_from_amax``).
    Raises:
        TypeError / ValueError: wrong dtype, non-contiguous, unsupported device.
    """
    _check(w, "amax_triton")
    if w.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=w.device)
    block = _BLOCK_INTERPRET if w.device.type == "cpu" else _BLOCK_CUDA
    partial = torch.empty(triton.cdiv(w.numel(), block), dtype=torch.float32, device=w.device)
    _launch(_amax_kernel, w, partial)
    return partial.amax()


def quantize_triton(w: torch.Tensor, scale: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Triton quantize: e4m3fn(clamp(float32(w) * (1 / scale))), bit-exact with the reference.

    Args:
        w: contiguous bf16/fp16/fp32 tensor on cuda or cpu (interpreted).
        scale: 0-d or 1-element float32 tensor on ``w.device``.
        out: optional contiguous float8_e4m3fn tensor of ``w``'s shape.
    Returns:
        float8_e4m3fn tensor of ``w``'s shape.
    Raises:
        TypeError / ValueError: wrong dtype, non-contiguous, shape mismatch, unsupported device.
    """
    _check(w, "quantize_triton")
    if out is None:
        out = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    if out.shape != w.shape or out.dtype != FP8_DTYPE or not out.is_contiguous():
        raise ValueError(f"quantize_triton: out must be contiguous {FP8_DTYPE} of shape {tuple(w.shape)}")
    if scale.numel() != 1:
        raise ValueError(f"quantize_triton: expected one scale, got shape {tuple(scale.shape)}")
    if w.numel() == 0:
        return out
    inv_scale = torch.reciprocal(scale.reshape(1).to(device=w.device, dtype=torch.float32))
    _launch(_quantize_kernel, w, out, inv_scale)
    return out


__all__ = ["amax_triton", "quantize_triton", "HAS_TRITON", "FP8_E4M3_MAX"]
