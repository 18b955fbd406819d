"""The fused native CPU FP8 kernels (``_cpu_fp8.c``): amax and quantize in one vectorized pass each, and the W8A16
linear (:func:`linear_fp8`: FP8 weight tiles dequantized into a cache-resident float32 buffer, never a whole
dequantized weight).

Bit-exact with :mod:`layerwise.kernels.reference` (tested over every bfloat16 bit pattern), and what the
``"torch"`` kernel runs on CPU for contiguous bfloat16 and float32 tensors when the extension is built.
torch's CPU cast to float8 is a scalar loop and the reference makes four passes (widen, divide, clamp,
cast). The native kernels make one vectorized pass each (the quantize a table lookup where a scale from the
weight's own amax allows it, :func:`table_path`); ``python -m layerwise.benchmarks.quant_kernels`` measures
them against a ``clone`` of the weight (benchmarks/results/quant_kernels_cpu.json). The linear is not bit-exact
with dequantize + ``F.linear`` (its sums are float32 in its own order, and the weight is never rounded to x's dtype);
``python -m layerwise.benchmarks.cpu_gemm`` times it against both BF16 ``F.linear`` and that path.

The extension is compiled by ``pip install`` (a C compiler and the Python headers; no torch headers, so
it builds in about a second) and is optional: where it could not be built, :func:`available` is False and
the torch reference runs instead. Work is split over ``torch.get_num_threads()`` OpenMP threads, the GIL
released: the extension links libgomp.so.1, which resolves to the copy torch loaded, so it runs on torch's
own intra-op threads (threads of its own would compete with those, which spin after every torch op).
"""

from __future__ import annotations

import logging

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from layerwise.errors import NonFiniteWeightError
from layerwise.kernels.reference import BLOCK_SIZE, FP8_DTYPE, GRANULARITY_CODES, scale_shape

ABI_VERSION = 7  # _cpu_fp8.ABI_VERSION of the C source this module calls

try:
    from layerwise.kernels import _cpu_fp8
except ImportError:  # not built (no C compiler at install time): the reference runs instead
    _cpu_fp8 = None
if _cpu_fp8 is not None and getattr(_cpu_fp8, "ABI_VERSION", 0) != ABI_VERSION:
    # a stale build of an editable install (the C source changed since): not used until rebuilt
    logging.getLogger(__name__).warning(
        "%s is a stale build of kernels/_cpu_fp8.c; the torch reference runs instead (reinstall: pip install -e .)",
        _cpu_fp8.__file__,
    )
    _cpu_fp8 = None

DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1}
LINEAR_DTYPE_CODES = {torch.bfloat16: 0, torch.float32: 1, torch.float16: 2}  # x, y and bias of linear_fp8
LINEAR_FP8_PROFILE_NAME = "layerwise::linear_fp8"  # the operator torch.profiler shows for linear_fp8
PIECE_COLUMNS = 5  # a piece's row of the batch table: src, dst, numel, its weight's first scale, its first row


def available() -> bool:
    """Whether the extension was built and imported."""
    return _cpu_fp8 is not None


def table_path() -> bool:
    """Whether the in-range bfloat16 quantize (a scale from the weight's own amax: every load and reload) runs as a
    table lookup here (x86-64 with AVX-512 VBMI), about twice as fast as the exact conversion it equals bit for bit;
    False where the extension is not built or the CPU lacks VBMI (the exact conversion runs)."""
    return _cpu_fp8 is not None and _cpu_fp8.table_path()


def gemm_path() -> str | None:
    """Which kernels :func:`linear_fp8` runs here: "avx2" (x86-64 with AVX2, FMA and F16C), "portable" (plain C),
    or None where the extension is not built."""
    return _cpu_fp8.gemm_path() if _cpu_fp8 is not None else None


def supports(w: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether the native kernels can take ``w`` (and write ``out``): built; a plain (not a subclass, not
    fake) contiguous non-empty bfloat16 or float32 CPU tensor; ``out`` None or a contiguous float8_e4m3fn
    CPU tensor of w's shape."""
    return (
        _cpu_fp8 is not None
        and not torch.compiler.is_compiling()
        and _takes(w)
        and (out is None or (supports_out(out) and out.shape == w.shape))
    )


def supports_out(out: torch.Tensor) -> bool:
    """Whether the native kernels can write ``out``: a plain contiguous float8_e4m3fn CPU tensor."""
    return _plain(out) and out.device.type == "cpu" and out.dtype == FP8_DTYPE and out.is_contiguous()


def _takes(t: torch.Tensor) -> bool:
    """The per-tensor part of :func:`supports`: a plain contiguous non-empty bfloat16 or float32 CPU tensor."""
    return _plain(t) and t.device.type == "cpu" and t.dtype in DTYPE_CODES and t.numel() > 0 and t.is_contiguous()


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose data_ptr is its elements: a plain tensor or parameter (typed parameters included), not a
    fake tensor or a subclass that wraps inner tensors."""
    # issubclass, not isinstance: nn.Parameter(fake) is a FakeTensor that isinstance(., Parameter) accepts
    kind = type(t)
    if kind is torch.Tensor or kind is torch.nn.Parameter:  # the common cases, without the subclass check
        return True
    return issubclass(kind, torch.nn.Parameter) and not is_traceable_wrapper_subclass(t)


def _rows(w: torch.Tensor, granularity: str) -> tuple[int, int]:
    """The [n_rows, k] the kernel walks: one row of every element per tensor, else w's own 2-D shape."""
    if granularity == "tensor":
        return 1, w.numel()
    n, k = w.shape
    return n, k


def amax(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """max(|w|) per group, float32 of :func:`reference.scale_shape`; NaN where a group holds NaN, Inf where
    it holds Inf (and no NaN). ``w``: a tensor :func:`supports` takes; 2-D for "channel" and "block".
    Raises ValueError (from ``scale_shape``) for an unknown granularity or a per-channel/per-block ``w`` that is
    not 2-D."""
    out = torch.empty(scale_shape(w.shape, granularity), dtype=torch.float32)
    n, k = _rows(w, granularity)
    code = GRANULARITY_CODES[granularity]
    _cpu_fp8.amax(w.data_ptr(), DTYPE_CODES[w.dtype], code, n, k, out.data_ptr(), torch.get_num_threads())
    return out


def scale(w: torch.Tensor, granularity: str) -> torch.Tensor:
    """:func:`reference.scale_from_amax` of :func:`amax`, the scale computed in the extension (one call
    instead of six small torch ops, which an MoE layer would pay once per expert).

    Raises:
        NonFiniteWeightError: ``w`` holds NaN or Inf.
    """
    return scale_from_amax_(amax(w, granularity))


def scale_from_amax(amax_value: torch.Tensor) -> torch.Tensor:
    """:func:`reference.scale_from_amax` of a float32 CPU tensor (a new tensor; one call instead of six small
    torch ops). Raises NonFiniteWeightError when any amax is NaN or Inf."""
    return scale_from_amax_(amax_value.contiguous().clone())


def scale_from_amax_(amax_value: torch.Tensor) -> torch.Tensor:
    """:func:`scale_from_amax` in place, for a contiguous float32 CPU tensor of amaxes nothing else holds.
    Raises NonFiniteWeightError when any amax is NaN or Inf."""
    if _cpu_fp8.scale_from_amax(amax_value.data_ptr(), amax_value.numel()):
        raise NonFiniteWeightError("tensor holds NaN or Inf (non-finite amax)")
    return amax_value


def quantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    granularity: str,
    out: torch.Tensor | None = None,
    *,
    within_range: bool = False,
) -> torch.Tensor:
    """e4m3fn(clamp(float32(w) / scale, -448, 448)), bytes equal to :func:`reference.quantize`.

    Args:
        w: a tensor :func:`supports` takes; 2-D [N, K] for "channel" and "block".
        scale: float32 CPU tensor, 1 element / [N, 1] / [ceil(N/128), ceil(K/128)] (made contiguous here).
        granularity: the scale's layout.
        out: optional contiguous float8_e4m3fn CPU tensor of w's shape, written in place.
        within_range: the caller guarantees every |w / scale| is finite and below 464 (true for a scale from
            w's own amax, see :func:`reference.quantize`): the conversion then skips its clamp and NaN selects
            (faster, with the same bytes).
    Returns:
        ``out``, or a new float8_e4m3fn tensor of w's shape.
    """
    if out is None:
        out = torch.empty(w.shape, dtype=FP8_DTYPE)
    scale = scale.to(torch.float32).contiguous()
    n, k = _rows(w, granularity)
    code = GRANULARITY_CODES[granularity]
    threads = torch.get_num_threads()
    _cpu_fp8.quantize(
        w.data_ptr(), DTYPE_CODES[w.dtype], code, n, k, scale.data_ptr(), out.data_ptr(), threads, within_range
    )
    return out


def scale_quantize(w: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`scale` and :func:`quantize` of a per-channel weight in one native pass over its memory: each row is
    quantized right after its amax, while it is still in cache, so the weight is read from memory once instead of
    twice. Bytes and scales equal the two calls'. (Per block the same fusion measured no faster here: see
    ``scale_quantize_worker`` in _cpu_fp8.c.)

    Args:
        w: a 2-D [N, K] tensor :func:`supports` takes.
        out: a contiguous float8_e4m3fn CPU tensor of w's shape that nothing else reads yet (a fresh tensor): it
            is written row by row, before every row's amax is known.
        scale_out: optional contiguous float32 CPU tensor of shape [N, 1] (e.g. a slice of a larger weight's
            scales), written in place and returned.
    Returns:
        the float32 scales [N, 1] (``scale_out``, or a new tensor).
    Raises:
        ValueError: a ``w`` that is not 2-D, or a ``scale_out`` of another shape.
        NonFiniteWeightError: ``w`` holds NaN or Inf; ``out`` and the scales then hold a partial result.
    """
    shape = scale_shape(w.shape, "channel")
    if scale_out is None:
        scale_out = torch.empty(shape, dtype=torch.float32)
    elif tuple(scale_out.shape) != tuple(shape) or scale_out.dtype != torch.float32 or not scale_out.is_contiguous():
        raise ValueError(
            f"scale_out: contiguous float32 {tuple(shape)}, got {scale_out.dtype} {tuple(scale_out.shape)}"
        )
    n, k = w.shape
    code = GRANULARITY_CODES["channel"]
    threads = torch.get_num_threads()
    bad = _cpu_fp8.scale_quantize(
        w.data_ptr(), DTYPE_CODES[w.dtype], code, n, k, scale_out.data_ptr(), out.data_ptr(), threads
    )
    if bad:
        raise NonFiniteWeightError("tensor holds NaN or Inf (non-finite amax)")
    return scale_out


def supports_batch(weights: list[list[tuple[int, torch.Tensor]]], outs: list[torch.Tensor] | None = None) -> bool:
    """Whether :func:`amax_batch` (``outs`` None) or :func:`quantize_batch` can take these pieces and outputs: every
    piece a tensor :func:`supports` takes, all of one dtype, every output a plain contiguous float8_e4m3fn CPU
    tensor."""
    if _cpu_fp8 is None or torch.compiler.is_compiling() or not weights or not weights[0]:
        return False
    if outs is not None and (len(outs) != len(weights) or not all(supports_out(o) for o in outs)):
        return False
    dtype = weights[0][0][1].dtype
    # supports() per piece without its once-per-call checks: an MoE layer passes hundreds of pieces
    return all(pieces and all(t.dtype == dtype and _takes(t) for _, t in pieces) for pieces in weights)


def _batch_table(
    weights: list[list[tuple[int, torch.Tensor]]], shape, granularity: str, outs: list[torch.Tensor] | None
) -> tuple[torch.Tensor, int]:
    """(int64 [n_pieces * PIECE_COLUMNS] table of ``_cpu_fp8.amax_pieces`` / ``quantize_pieces``, k), after the
    checks the raw-pointer kernels need (:func:`supports_batch`; every piece whole rows inside its weight; every
    output of the weight's size)."""
    if not supports_batch(weights, outs):
        raise ValueError("a batch of pieces: one bfloat16 or float32 dtype, contiguous float8 outputs only")
    total = torch.Size(shape).numel()
    k = shape[-1] if granularity != "tensor" else 1
    per_weight = torch.Size(scale_shape(shape, granularity)).numel()
    table = []
    for u, pieces in enumerate(weights):
        base = 0
        if outs is not None:
            if outs[u].numel() != total:
                raise ValueError(
                    f"weight {u}: output of {outs[u].numel()} elements for a weight of shape {tuple(shape)}"
                )
            base = outs[u].data_ptr()
        for off, t in pieces:
            n = t.numel()
            if off < 0 or off + n > total or off % k or n % k:
                raise ValueError(f"weight {u}: a piece at [{off}, {off + n}) is not whole rows of {tuple(shape)}")
            table += (t.data_ptr(), base + off if base else 0, n, u * per_weight, off // k)
    return torch.tensor(table, dtype=torch.int64), k


def amax_batch(
    weights: list[list[tuple[int, torch.Tensor]]], shape: torch.Size | tuple, granularity: str
) -> torch.Tensor:
    """max|w| per scale group of several weights of one ``shape``, each given as contiguous pieces, in one native
    call over all their pieces (run in parallel on torch's threads): the first half of what
    ``kernels.fp8_quantize_pieces`` does, for a whole MoE layer's experts at once.

    Args:
        weights: per weight, [(flat element offset, tensor)] covering ``shape`` exactly once; per channel and
            per block whole rows (``kernels.pieces_fit``), which may start inside a 128-row block. Checked here:
            offsets inside the weight and whole rows (the kernels read through raw pointers).
        shape: the weights' shape; [N, K] for "channel" and "block".
    Returns:
        float32 [len(weights), *scale_shape(shape)], NaN or Inf where a group holds one.
    Raises:
        ValueError: a batch :func:`supports_batch` refuses, or a piece outside its weight or not whole rows.
    """
    table, k = _batch_table(weights, shape, granularity, None)
    amax = torch.zeros(len(weights), *scale_shape(shape, granularity), dtype=torch.float32)
    dtype, code = DTYPE_CODES[weights[0][0][1].dtype], GRANULARITY_CODES[granularity]
    n_pieces = table.numel() // PIECE_COLUMNS
    _cpu_fp8.amax_pieces(table.data_ptr(), n_pieces, dtype, code, k, amax.data_ptr(), torch.get_num_threads())
    return amax


def quantize_batch(
    weights: list[list[tuple[int, torch.Tensor]]],
    scales: torch.Tensor,
    shape: torch.Size | tuple,
    granularity: str,
    outs: list[torch.Tensor],
) -> None:
    """Each piece of several weights quantized with its weight's ``scales`` (from its own amax: the unclamped
    conversion) into its region of the weight's output, in one native call over all the pieces.

    Args:
        weights: as :func:`amax_batch`.
        scales: float32 [len(weights), *scale_shape(shape)], finite (``kernels.scale_from_amax`` of :func:`amax_batch`).
        outs: per weight, its contiguous float8_e4m3fn CPU tensor of ``shape``.
    Raises:
        ValueError: a batch :func:`supports_batch` refuses, a piece outside its weight or not whole rows, an output
            of another size, or scales of another shape.
    """
    table, k = _batch_table(weights, shape, granularity, outs)
    want = (len(weights), *scale_shape(shape, granularity))
    if tuple(scales.shape) != want or scales.dtype != torch.float32 or scales.device.type != "cpu":
        raise ValueError(f"scales: float32 {want} on the CPU, got {scales.dtype} {tuple(scales.shape)}")
    scales = scales.contiguous()
    dtype, code = DTYPE_CODES[weights[0][0][1].dtype], GRANULARITY_CODES[granularity]
    n_pieces = table.numel() // PIECE_COLUMNS
    _cpu_fp8.quantize_pieces(
        table.data_ptr(), n_pieces, dtype, code, k, scales.data_ptr(), torch.get_num_threads(), True
    )


def supports_copy(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """Whether :func:`copy_checked` takes the pair: ``src`` a tensor :func:`supports` takes, ``dst`` a plain
    contiguous CPU tensor of its dtype and number of elements."""
    return (
        supports(src)
        and _plain(dst)
        and dst.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.is_contiguous()
        and dst.numel() == src.numel()
    )


def copy_checked(src: torch.Tensor, dst: torch.Tensor) -> bool:
    """``dst.copy_(src)`` in one native pass that also tells whether ``src`` is finite: for a reload that writes a
    BF16 module's live tensors and must then check them, the check costs no second pass over the memory.

    Args:
        src, dst: a pair :func:`supports_copy` takes.
    Returns:
        False where ``src`` holds NaN or Inf (copied all the same).
    Raises:
        ValueError: a pair :func:`supports_copy` refuses.
    """
    if not supports_copy(src, dst):
        raise ValueError(f"copy_checked: cannot copy {src.dtype}{tuple(src.shape)} into {dst.dtype}{tuple(dst.shape)}")
    amax = _cpu_fp8.copy_amax(
        src.data_ptr(), dst.data_ptr(), src.numel(), DTYPE_CODES[src.dtype], torch.get_num_threads()
    )
    return amax <= 3.4028234663852886e38  # False for NaN and Inf


def supports_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """Whether :func:`linear_fp8` takes these tensors: the extension built and not under torch.compile; ``weight`` a
    plain contiguous non-empty 2-D float8_e4m3fn CPU tensor [N, K]; ``scale`` a plain float32 CPU tensor of a layout
    that fits it (as :func:`reference.scale_layout`: 1 element, [N, 1] or [ceil(N/128), ceil(K/128)]); ``x`` a plain
    bfloat16, float16 or float32 CPU tensor [..., K] (any strides); ``bias`` None or a plain CPU tensor of N elements
    in one of those dtypes; and no gradient to record (the kernel is not differentiable). Cheap (a few attribute
    reads: it runs before every CPU FP8 forward)."""
    if _cpu_fp8 is None or torch.compiler.is_compiling():
        return False
    # is_cpu and ndim, not device.type and dim(): a few times cheaper, and this runs once per linear per step
    if not (x.is_cpu and weight.is_cpu and scale.is_cpu and weight.ndim == 2 and x.ndim >= 1):
        return False
    if not (weight.dtype == FP8_DTYPE and x.dtype in LINEAR_DTYPE_CODES and scale.dtype == torch.float32):
        return False
    n, k = weight.shape
    if x.shape[-1] != k or n * k == 0 or not weight.is_contiguous() or _layout_code(n, k, scale) is None:
        return False
    if bias is not None and not (bias.is_cpu and bias.dtype in LINEAR_DTYPE_CODES and bias.numel() == n):
        return False
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return False
    return _plain(x) and _plain(weight) and _plain(scale) and (bias is None or _plain(bias))


def _layout_code(n: int, k: int, scale: torch.Tensor) -> int | None:
    """GRANULARITY_CODES of :func:`reference.scale_layout` for a weight [n, k], None where the scale fits no layout."""
    if scale.numel() == 1:
        return GRANULARITY_CODES["tensor"]
    shape = scale.shape
    if shape == (n, 1):
        return GRANULARITY_CODES["channel"]
    if shape == (-(-n // BLOCK_SIZE[0]), -(-k // BLOCK_SIZE[1])):
        return GRANULARITY_CODES["block"]
    return None


def linear_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    checked: bool = False,
    portable: bool = False,
) -> torch.Tensor:
    """y = x @ dequantize(weight, scale)^T + bias without a dequantized copy of the weight (W8A16 on CPU).

    The FP8 bytes are dequantized a cache-sized tile at a time into float32 (``float32(w) * scale``, rounded once, as
    :func:`reference.dequantize` computes it before its cast) and multiplied there with x widened to float32; the
    sums are float32 and y is rounded once to x's dtype. Each output element is the same sum in the same order
    whatever the other rows of x and the thread count (batch invariant). Work is split by output features over
    ``torch.get_num_threads()`` OpenMP threads, the GIL released.

    Args:
        x: bfloat16, float16 or float32 CPU tensor [..., K] (any strides: rows whose elements are not adjacent are
            copied first).
        weight: contiguous float8_e4m3fn CPU tensor [N, K].
        scale: float32, 1 element (per tensor), [N, 1] (per channel) or [ceil(N/128), ceil(K/128)] (per 128 x 128
            block).
        bias: optional CPU tensor of N elements, bfloat16, float16 or float32.
        checked: the caller has just had :func:`supports_linear` accept these tensors (the check is skipped).
        portable: run the plain C kernels even where the AVX2 ones run (:func:`gemm_path`; for tests).
    Returns:
        y: [..., N] in x's dtype.
    Raises:
        ValueError: tensors :func:`supports_linear` refuses (check it first to fall back to dequantize + F.linear).
    """
    if not checked and not supports_linear(x, weight, scale, bias):
        raise ValueError(
            f"linear_fp8: cannot take x {x.dtype}{tuple(x.shape)} on {x.device}, weight {weight.dtype}"
            f"{tuple(weight.shape)}, scale {scale.dtype}{tuple(scale.shape)}"
            + (f", bias {bias.dtype}{tuple(bias.shape)}" if bias is not None else "")
        )
    n, k = weight.shape
    x2 = x if x.ndim == 2 else x.reshape(-1, k)
    m = x2.shape[0]
    row_stride, column_stride = x2.stride()
    if column_stride != 1 or (m > 1 and row_stride < k):  # elements not adjacent, or rows that overlap
        x2, row_stride = x2.contiguous(), k
    scale = scale.contiguous()
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty((m, n) if x.ndim == 2 else (*x.shape[:-1], n), dtype=x.dtype)  # contiguous: [m, n] for the kernel
    call = (
        x2.data_ptr(),
        LINEAR_DTYPE_CODES[x.dtype],
        m,
        k,
        row_stride if m > 1 else k,
        weight.data_ptr(),
        n,
        scale.data_ptr(),
        _layout_code(n, k, scale),
        bias.data_ptr() if bias is not None else 0,
        LINEAR_DTYPE_CODES[bias.dtype] if bias is not None else 0,
        y.data_ptr(),
        torch.get_num_threads(),
        portable,
    )
    if torch.autograd._profiler_enabled():  # a profile shows the kernel as an operator of its own (not otherwise:
        with torch.profiler.record_function(LINEAR_FP8_PROFILE_NAME):  # a dispatcher call, a few microseconds)
            _cpu_fp8.linear_fp8(*call)
    else:
        _cpu_fp8.linear_fp8(*call)
    return y
