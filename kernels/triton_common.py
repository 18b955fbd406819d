"""What the Triton FP8 kernels share: building, launching, exact bf16 loads, e4m3 rounding.

Each kernel is built lazily in two forms: compiled (``triton.jit``) for CUDA tensors, and
interpreted (Triton's CPU interpreter, the same source run through NumPy) for CPU tensors, so
``kernel="triton"`` works on CPU without setting ``TRITON_INTERPRET`` before import.

Two measured interpreter pitfalls (Triton 3.9) shape the helpers:
* a direct fp32 -> float8e4nv cast mis-rounds values whose rounding carries into the next power
  of two (125.07 -> 64.0), so ``round_to_e4m3`` rounds onto the e4m3 grid in fp32 first and the
  final cast only sees exactly representable values;
* bf16 -> fp32 conversion flushes bf16 subnormals (NumPy has no bf16), so bf16 tensors are passed
  as their int16 bits and ``load_f32`` widens them with a shift, which is exact everywhere.
"""

import functools

import torch

try:  # triton is optional at import time (macOS, Windows)
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is absent
    HAS_TRITON = False

    class tl:  # noqa: N801 - stand-in so kernel annotations still evaluate
        constexpr = int

    class JITFunction:  # noqa: D101
        def __init__(self, fn):
            self.fn = fn

# Elements per program: the interpreter pays per program, so it gets much larger tiles.
TILE_CUDA = (16, 256)
TILE_INTERPRET = (64, 2048)


class _Helper(JITFunction):
    """A device function usable from both kernel forms: compiled kernels see a JITFunction and
    inline it; the interpreter calls it as the plain Python function it wraps (a JITFunction
    refuses to be called outside a compiled kernel)."""

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def helper(fn):
    """Decorator for device functions called from the kernels (see :class:`_Helper`)."""
    return _Helper(fn) if HAS_TRITON else fn


@helper
def load_f32(ptr, mask, IS_BF16: tl.constexpr):
    """Load as float32; ``ptr`` points at int16 bits when IS_BF16 (widened exactly by a shift)."""
    if IS_BF16:
        return (tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return tl.load(ptr, mask=mask, other=0.0).to(tl.float32)


@helper
def abs_nan_to_inf(x):
    """|x| with NaN mapped to +inf, so a max over it is non-finite whenever x holds NaN or Inf."""
    a = tl.abs(x)
    return tl.where(a == a, a, float("inf"))


@helper
def max_all(a, AXIS: tl.constexpr):
    """tl.max along AXIS, spelled as tl.reduce with the standard max combine (tl.max itself is a
    JITFunction, which an interpreted kernel cannot call)."""
    return tl.reduce(a, AXIS, tl.standard._elementwise_max)


@helper
def round_to_e4m3(y):
    """Round float32 y (already clamped to [-448, 448]) half-to-even onto the e4m3 grid, in fp32.

    The grid step is 2^(e - 3), e = max(exponent(y), -6), read from the bits; adding and removing
    1.5 * 2^23 rounds |y| / step to an integer (|y| / step < 16, exact: step is a power of two).
    The sign comes from the sign bit so -0.0 and tiny negatives keep it, as torch's cast does.
    """
    a = tl.abs(y)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a / step + 12582912.0) - 12582912.0) * step
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -r, r)


@functools.lru_cache(maxsize=None)
def build(fn, interpret: bool):
    """The compiled (CUDA) or interpreted (CPU) form of kernel function ``fn``."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


def tile(device: torch.device) -> tuple[int, int]:
    """(rows, cols) handled by one program on ``device``."""
    return TILE_INTERPRET if device.type == "cpu" else TILE_CUDA


def as_kernel_input(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor to pass, is_bf16): bf16 goes in as its int16 bits (see module docstring)."""
    return (w.view(torch.int16), True) if w.dtype == torch.bfloat16 else (w, False)


def check_input(w: torch.Tensor, name: str, ndim: int | None = 2) -> None:
    """Raise TypeError/ValueError/RuntimeError for inputs the kernels do not take."""
    if not HAS_TRITON:
        raise RuntimeError("kernel='triton' requested but triton is not installed")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected a bf16/fp16/fp32 tensor, got {w.dtype}")
    if ndim is not None and w.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(w.shape)}")
    if not w.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (shape {tuple(w.shape)}, stride {w.stride()})")
    if w.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: triton kernels run on cuda (or cpu, interpreted); got {w.device}")
