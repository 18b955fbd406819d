"""What the Triton FP8 kernels share: building, tile coordinates, exact bf16 loads, e4m3 bits.

Each kernel is built lazily in two forms: compiled (``triton.jit``) for CUDA tensors, and
interpreted (Triton's CPU interpreter, the same source run through NumPy) for CPU tensors, so
``kernel="triton"`` works on CPU without setting ``TRITON_INTERPRET`` before import.

Portability rules, each learned from a failure (see tests/test_kernels_compile.py):

* No fp8 type inside a kernel. sm_80/sm_86 have no ``float8e4nv`` (Triton refuses to compile it),
  and the Triton interpreter's fp32 -> float8e4nv cast mis-rounds values whose rounding carries
  into the next power of two (125.07 -> 64.0). So e4m3 is written and read as its uint8 bit
  pattern: :func:`e4m3_bits` rounds onto the e4m3 grid in fp32 and assembles the byte with integer
  ops, :func:`e4m3_value` decodes it. Both are exact on every target and in the interpreter.
* bf16 -> fp32 in the interpreter flushes subnormals (NumPy has no bf16), so bf16 tensors are
  passed as their int16 bits and :func:`load_f32` widens them with a shift, exact everywhere.
* A helper's branches return values of one type and shape (Triton unifies them; the interpreter
  does not check).
* No Python ``range`` over a runtime integer in the load-time kernels (fp8_tiles): older interpreters
  (Triton 3.4-3.6) pass integer arguments as 1-element arrays that ``range`` cannot take; a reduction
  that spans tiles writes per-tile partials and finishes in torch. The forward kernels (fp8_act,
  fp8_gemm) loop over K, so interpreting them (CPU tests, ``kernel="triton"`` on CPU) needs Triton 3.7+;
  compiled, they run on 3.6 (the H100's CUDA tests passed).
* One launch axis: the grid is 1-D (axis 0 allows 2^31 - 1 programs; axes 1 and 2 only 65535),
  and element offsets are int64, so tensors of 2^31 elements or more (a 131072 x 16384
  embedding, a fused-expert weight) work.
"""

import functools

import torch

from layerwise.optional import install_hint

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


# (rows, cols) per program: the interpreter pays per program, so it gets much larger tiles.
TILE_CUDA = (16, 256)
TILE_INTERPRET = (64, 2048)
MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0
# Compile options of every launch: no fused multiply-add, so the arithmetic is the same on every
# Triton version (3.9 warns that its default changes in 3.10). The kernels' results do not depend
# on it (see e4m3_bits), but the choice is made here, once, rather than by the Triton version.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


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
def tile_index(n_cols, TILE_K: tl.constexpr):
    """(row tile, column tile), both int64, of this program: programs run over the tiles of an
    [n_rows, n_cols] matrix in row-major order on grid axis 0."""
    pid = tl.program_id(0)
    col_tiles = (n_cols + TILE_K - 1) // TILE_K
    return (pid // col_tiles).to(tl.int64), (pid % col_tiles).to(tl.int64)


@helper
def tile_rows_cols(n_rows, n_cols, TILE_N: tl.constexpr, TILE_K: tl.constexpr):
    """(rows int64 [TILE_N, 1], cols int64 [1, TILE_K], in-bounds mask [TILE_N, TILE_K]) of this
    program's tile of an [n_rows, n_cols] matrix (see :func:`tile_index`)."""
    row_tile, col_tile = tile_index(n_cols, TILE_K)
    rows = (row_tile * TILE_N + tl.arange(0, TILE_N))[:, None]
    cols = (col_tile * TILE_K + tl.arange(0, TILE_K))[None, :]
    return rows, cols, (rows < n_rows) & (cols < n_cols)


@helper
def load_f32(ptr, mask, IS_BF16: tl.constexpr):
    """Load as float32; ``ptr`` points at int16 bits when IS_BF16 (widened exactly by a shift)."""
    if IS_BF16:
        x = (tl.load(ptr, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    return x


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
def e4m3_bits(y):
    """The float8_e4m3fn byte (int32 in [0, 255]) of float32 ``y``, already clamped to [-448, 448],
    rounded half to even as torch's cast rounds.

    The grid step is 2^(e - 3), e = max(exponent(y), -6), read from the bits; adding and removing
    1.5 * 2^23 rounds |y| / step to an integer (|y| / step < 16; every product here is by a power of
    two, so exact, and a fused multiply-add gives the same result). The rounded value r is then on
    the e4m3 grid: a normal r (>= 2^-6) keeps its fp32 exponent and top 3 mantissa bits, so its
    byte is (bits(r) >> 20) - (120 << 3); a subnormal r is m * 2^-9 with m = r * 512. The sign is
    the sign bit of y, so -0.0 and tiny negatives stay negative zero, as in torch.
    """
    a = tl.abs(y)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((3 - exponent + 127) << 23).to(tl.float32, bitcast=True)
    r = ((a * inv_step + 12582912.0) - 12582912.0) * step
    normal = (r.to(tl.int32, bitcast=True) >> 20) - 960
    subnormal = (r * 512.0).to(tl.int32)
    magnitude = tl.where(r >= 0.015625, normal, subnormal)
    return magnitude | ((y.to(tl.int32, bitcast=True) >> 24) & 0x80)


@helper
def e4m3_value(bits):
    """float32 value of float8_e4m3fn bytes ``bits`` (int32 in [0, 255]); 0x7F / 0xFF are NaN."""
    magnitude = bits & 0x7F
    normal = ((magnitude + 960) << 20).to(tl.float32, bitcast=True)  # exponent e - 7 + 127, mantissa
    subnormal = (magnitude & 7).to(tl.float32) * 0.001953125  # m * 2^-9
    v = tl.where(magnitude >= 8, normal, subnormal)
    v = tl.where(magnitude == 0x7F, float("nan"), v)
    # the sign as a bit: Triton's unary minus is 0 - v, which turns -0.0 into +0.0
    return (v.to(tl.int32, bitcast=True) | ((bits & 0x80) << 24)).to(tl.float32, bitcast=True)


@functools.cache
def build(fn, interpret: bool):
    """The compiled (CUDA) or interpreted (CPU) form of kernel function ``fn``."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


def launch(fn, device: torch.device, grid: tuple, *args, **constexprs) -> None:
    """Run kernel ``fn`` over ``grid``: compiled on CUDA, interpreted on CPU, with LAUNCH_OPTIONS.

    The interpreter computes in NumPy, which warns where a cast overflows to inf (a dequantized
    value beyond fp16's range) or an operation gives NaN (inf / inf on non-finite activations); the
    compiled kernel and torch give the same values silently.
    """
    kernel = build(fn, device.type == "cpu")[grid]
    if device.type != "cpu":
        kernel(*args, **constexprs, **LAUNCH_OPTIONS)
        return
    import numpy as np

    with np.errstate(over="ignore", invalid="ignore"):
        kernel(*args, **constexprs, **LAUNCH_OPTIONS)


def tile(device: torch.device) -> tuple[int, int]:
    """(rows, cols) handled by one program on ``device``."""
    return TILE_INTERPRET if device.type == "cpu" else TILE_CUDA


def grid_1d(n_rows: int, n_cols: int, tile_rows: int, tile_cols: int) -> tuple[int]:
    """The 1-D launch grid covering an [n_rows, n_cols] matrix with tiles of tile_rows x tile_cols.

    Raises:
        ValueError: more than MAX_PROGRAMS tiles (over 8.7e12 elements with CUDA tiles).
    """
    programs = triton.cdiv(n_rows, tile_rows) * triton.cdiv(n_cols, tile_cols)
    if programs > MAX_PROGRAMS:
        raise ValueError(f"[{n_rows}, {n_cols}] needs {programs} programs, over the {MAX_PROGRAMS} a grid allows")
    return (programs,)


def as_kernel_input(w: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(tensor to pass, is_bf16): bf16 goes in as its int16 bits (see module docstring)."""
    return (w.view(torch.int16), True) if w.dtype == torch.bfloat16 else (w, False)


def as_matrix(w: torch.Tensor) -> torch.Tensor:
    """``w`` viewed as rows: [N, K] stays, [..., K] becomes [prod(...), K], a scalar [1, 1]."""
    if w.dim() == 2:
        return w
    return w.reshape(1, 1) if w.dim() == 0 else w.reshape(-1, w.shape[-1])


def check_input(w: torch.Tensor, name: str, ndim: int | None = 2) -> None:
    """Raise TypeError/ValueError/RuntimeError for inputs the kernels do not take."""
    if not HAS_TRITON:
        raise RuntimeError(f"kernel='triton' needs Triton, which is not installed: {install_hint('gpu', ['triton'])}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name}: expected a bf16/fp16/fp32 tensor, got {w.dtype}")
    if ndim is not None and w.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(w.shape)}")
    if not w.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (shape {tuple(w.shape)}, stride {w.stride()})")
    if w.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: triton kernels run on cuda (or cpu, interpreted); got {w.device}")
