"""FP8 kernels: Triton implementations and their bit-exact torch reference.

``kernel`` selects the implementation: ``"torch"`` (the reference; on CPU, contiguous bfloat16 and float32
tensors take its fused native C version, ``cpu_native``, when built), ``"triton"`` (compiled on CUDA,
interpreted on CPU), or ``None`` for the device default (triton on CUDA, torch elsewhere).
``granularity`` is "tensor", "channel" (one scale per output row) or "block" (128 x 128).

The forward's kernels live beside these (imported on demand, CUDA only in the library's use):
``fp8_act`` (fused dynamic activation quantization: per token, per token group of 128, per tensor) and
``fp8_gemm`` (W8A16 GEMM over FP8 weight bytes; block-scaled W8A8 GEMM). ``ops`` wraps the weight
kernels as torch.library custom ops for torch.compile; eager calls skip the op (no torch._dynamo import).
This package imports torch and, of the project, only the leaves ``layerwise.errors`` and ``layerwise.optional``
(never ``quant``); Triton is imported by the modules that hold Triton kernels, on first use.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from layerwise.errors import NonFiniteWeightError
from layerwise.kernels import cpu_native, finite, reference
from layerwise.kernels.reference import (
    BLOCK_SIZE,
    FP8_DTYPE,
    FP8_E4M3_MAX,
    GRANULARITIES,
    scale_layout,
    scale_shape,
)
from layerwise.optional import require

KERNELS = ("torch", "triton")
# Whether Triton is installed (nothing imported). It is imported (about 0.75 s) only where a Triton kernel may run: a
# CPU load never imports it, a CUDA load when it picks its kernel (triton_importable).
HAS_TRITON = importlib.util.find_spec("triton") is not None


@functools.cache
def triton_importable() -> bool:
    """Whether Triton is installed and imports (``kernels.triton_common.HAS_TRITON``); imports it where it is."""
    if not HAS_TRITON:
        return False
    from layerwise.kernels.triton_common import HAS_TRITON as importable

    return importable


def resolve_kernel(kernel: str | None, device: torch.device | str) -> str:
    """Pick the kernel name for ``device``.

    Raises:
        ValueError: an unknown name.
        MissingDependencyError: "triton" asked for where Triton is not installed or does not import (names the
            [gpu] extra).
    """
    if kernel is None:
        return "triton" if torch.device(device).type == "cuda" and triton_importable() else "torch"
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNELS}")
    if kernel == "triton" and not triton_importable():
        require(["triton"], extra="gpu", purpose="kernel='triton'")  # raises: not installed, or fails to import
    return kernel


def scale_from_amax(amax_value: torch.Tensor) -> torch.Tensor:
    """:func:`reference.scale_from_amax` (amax / 448, at least float32's tiny, 1.0 for 0), computed natively for a
    float32 CPU tensor. Raises NonFiniteWeightError when any amax is NaN or Inf (inside
    :func:`finite.deferred_finite_checks`: records the check instead, see :func:`require_finite`)."""
    if finite.deferred_sink() is not None:
        require_finite(amax_value, "tensor holds NaN or Inf (non-finite amax)")
        return reference.scale_from_amax(amax_value, check=False)
    if amax_value.dtype == torch.float32 and cpu_native.supports(amax_value):
        return cpu_native.scale_from_amax(amax_value)
    return reference.scale_from_amax(amax_value)


def has_non_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds NaN or +-Inf (:func:`reference.has_non_finite`; one native amax pass on CPU)."""
    if cpu_native.supports(t):  # a bfloat16 or float32 CPU tensor
        return not bool(torch.isfinite(cpu_native.amax(t, "tensor")))
    return reference.has_non_finite(t)


def require_finite(t: torch.Tensor, message: str) -> None:
    """Raise NonFiniteWeightError(``message``) when ``t`` holds NaN or Inf. Inside
    :func:`finite.deferred_finite_checks`, append :func:`reference.non_finite_flag` of ``t`` to its list instead:
    no host read, nothing raised here."""
    sink = finite.deferred_sink()
    if sink is not None:
        sink.append(reference.non_finite_flag(t))
    elif has_non_finite(t):
        raise NonFiniteWeightError(message)


def fp8_amax(w: torch.Tensor, granularity: str = "tensor", kernel: str = "torch") -> torch.Tensor:
    """max(|w|) per group as float32 of :func:`scale_shape` (non-finite where w is): :func:`reference.amax`,
    natively on CPU where :func:`cpu_native.supports` ``w``, or Triton.

    Args:
        w: bf16 / fp16 / fp32 tensor; 2-D [N, K] for "channel" and "block".
        granularity: "tensor", "channel" or "block".
    Raises:
        ValueError: an unknown granularity, or a per-channel / per-block ``w`` that is not 2-D.
    """
    if kernel == "triton":
        from layerwise.kernels.ops import fp8_amax_triton

        return fp8_amax_triton(w, granularity)
    if cpu_native.supports(w):
        return cpu_native.amax(w, granularity)
    return reference.amax(w, granularity)


def fp8_scale(w: torch.Tensor, granularity: str = "tensor", kernel: str = "torch") -> torch.Tensor:
    """The e4m3 scale(s) of ``w``: :func:`scale_from_amax` of :func:`fp8_amax` (float32, :func:`scale_shape`).

    Raises:
        NonFiniteWeightError: ``w`` holds NaN or Inf.
    """
    if kernel != "triton" and cpu_native.supports(w) and finite.deferred_sink() is None:
        return cpu_native.scale(w, granularity)  # amax, check and scale in one native call
    return scale_from_amax(fp8_amax(w, granularity, kernel))


def fp8_quantize(
    w: torch.Tensor,
    scale: torch.Tensor,
    kernel: str = "torch",
    *,
    within_range: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Quantize ``w`` (bf16 / fp16 / fp32) with ``scale`` (float32; layout read off its shape: 1 element,
    [N, 1] or [ceil(N/128), ceil(K/128)]) to float8_e4m3fn of w's shape.

    ``within_range``: as in :func:`reference.quantize` (the torch reference then skips its clamp; the Triton
    kernel clamps either way, with the same bytes).
    ``out``: a contiguous float8_e4m3fn tensor of w's shape on w's device, written in place and returned.

    Raises:
        ValueError: a scale shape that fits no layout for ``w`` (:func:`reference.scale_layout`).
    """
    if kernel == "triton":
        from layerwise.kernels.ops import fp8_quantize_triton

        return fp8_quantize_triton(w, scale, out)
    if scale.device.type == "cpu" and cpu_native.supports(w, out):
        return cpu_native.quantize(w, scale, scale_layout(w, scale), out, within_range=within_range)
    return reference.quantize(w, scale, out, within_range=within_range)


def pieces_fit(shape: torch.Size | tuple, spans: list[tuple[int, int]], granularity: str) -> bool:
    """Whether a weight of ``shape`` given as pieces at flat element ``spans`` [(offset, numel)] can be quantized
    piece by piece at ``granularity`` (:func:`fp8_quantize_pieces`): per tensor always; per channel and per block
    when every piece is whole rows (per block a piece may start or end inside a 128-row block)."""
    if granularity == "tensor":
        return True
    if len(shape) != 2:
        return False
    k = shape[1]
    return all(off % k == 0 and numel % k == 0 for off, numel in spans)


def fp8_quantize_pieces(
    pieces: list[tuple[int, torch.Tensor]],
    shape: torch.Size | tuple,
    granularity: str,
    out: torch.Tensor,
    kernel: str,
    *,
    out_fresh: bool = False,
) -> torch.Tensor:
    """Quantize a weight that is given as contiguous pieces, without assembling it: the scale(s) from every
    piece's amax, then each piece straight into its region of ``out``. Bytes and scales equal
    :func:`fp8_quantize_weight` of the assembled weight (amax is a max, so it composes exactly).

    Args:
        pieces: (flat element offset, contiguous tensor) covering ``shape`` exactly once, each on out's device;
            they must fit the granularity (:func:`pieces_fit`).
        shape: the weight's shape ([N, K] for "channel" and "block").
        out: contiguous float8_e4m3fn tensor of ``shape``, written only after every piece's amax is known, unless
            ``out_fresh``.
        out_fresh: ``out`` is a new tensor nothing reads yet (a first load), so it may be written before every
            amax is known: per channel on the CPU, each piece is then quantized in the same native pass as its amax
            (:func:`cpu_native.scale_quantize`), reading it from memory once instead of twice.
    Returns:
        the float32 scale, shaped as :func:`scale_shape`.
    Raises:
        NonFiniteWeightError: a piece holds NaN or Inf (nothing is written; with ``out_fresh``, ``out`` may hold
            a partial result).
    """
    if out_fresh and cpu_native.supports_out(out) and _one_pass(pieces, granularity, kernel):
        scale = torch.empty(scale_shape(shape, granularity), dtype=torch.float32)
        flat, k = out.view(-1), shape[1]
        for off, t in pieces:
            rows, r0 = t.numel() // k, off // k
            cpu_native.scale_quantize(t.view(rows, k), flat[off : off + t.numel()].view(rows, k), scale[r0 : r0 + rows])
        return scale
    scale = _pieces_scale(pieces, shape, granularity, kernel)
    _quantize_pieces_with(pieces, scale, shape, granularity, out, kernel)
    return scale


def _one_pass(pieces: list[tuple[int, torch.Tensor]], granularity: str, kernel: str) -> bool:
    """Whether ``pieces`` of a weight with a fresh output are quantized each in one native pass with its amax
    (:func:`cpu_native.scale_quantize`): per channel, the CPU's native kernels for every piece, no deferred finite
    checks."""
    return (
        granularity == "channel"
        and kernel != "triton"
        and finite.deferred_sink() is None
        and all(cpu_native.supports(t) for _, t in pieces)
    )


def fp8_scale_pieces_batch(
    weights: list[list[tuple[int, torch.Tensor]]], shape: torch.Size | tuple, granularity: str, kernel: str
) -> torch.Tensor:
    """The scales of several weights of one ``shape`` (an MoE layer's experts), each given as pieces as in
    :func:`fp8_quantize_pieces`: on CPU one native amax call over all their pieces, run in parallel
    (:func:`cpu_native.amax_batch`), else weight by weight. Reads only; :func:`fp8_quantize_pieces_batch` writes.

    Returns:
        float32 [len(weights), *scale_shape(shape)].
    Raises:
        NonFiniteWeightError: a weight holds NaN or Inf; the message names its index in ``weights``.
    """
    if kernel != "triton" and cpu_native.supports_batch(weights) and finite.deferred_sink() is None:
        amax = cpu_native.amax_batch(weights, shape, granularity)
        try:
            return cpu_native.scale_from_amax_(amax)  # in place: the batch's scales are its only float32 memory
        except NonFiniteWeightError:  # non-finite entries are left as they were
            bad = int((~torch.isfinite(amax.view(len(weights), -1))).any(1).nonzero()[0])
            raise NonFiniteWeightError(f"weight {bad} of the batch holds NaN or Inf (non-finite amax)") from None
    return torch.stack([_pieces_scale(pieces, shape, granularity, kernel) for pieces in weights])


def fp8_quantize_pieces_batch(
    weights: list[list[tuple[int, torch.Tensor]]],
    scales: torch.Tensor,
    shape: torch.Size | tuple,
    granularity: str,
    outs: list[torch.Tensor],
    kernel: str,
) -> None:
    """Each weight's pieces quantized with its ``scales`` (:func:`fp8_scale_pieces_batch`) into its output: on CPU
    one native call over all the pieces, run in parallel (:func:`cpu_native.quantize_batch`), else weight by weight.
    Bytes equal :func:`fp8_quantize_weight` of each assembled weight.

    Args:
        weights: per weight, its pieces as in :func:`fp8_quantize_pieces`.
        scales: float32 [len(weights), *scale_shape(shape)].
        outs: per weight, its contiguous float8_e4m3fn output of ``shape``.
    """
    if kernel != "triton" and cpu_native.supports_batch(weights, outs):
        cpu_native.quantize_batch(weights, scales, shape, granularity, outs)
        return
    for pieces, scale, out in zip(weights, scales, outs, strict=True):
        _quantize_pieces_with(pieces, scale, shape, granularity, out, kernel)


def _block_rows(pieces: list[tuple[int, torch.Tensor]], k: int, granularity: str):
    """(first scale row, part as [rows, k], flat offset) of each piece of a per-channel or per-block weight. Per
    block a piece that starts inside a 128-row block is cut where the next block starts, so that every part
    starts a block or lies inside one (a block shared by two pieces takes its scale from both)."""
    per = 1 if granularity == "channel" else BLOCK_SIZE[0]  # weight rows per scale row
    for off, t in pieces:
        rows, r0 = t.numel() // k, off // k
        m = t.view(rows, k)
        cut = min(rows, -r0 % per)  # rows before the next block starts: 0 where the piece starts one
        if cut:
            yield r0 // per, m[:cut], off
        if cut < rows:
            yield (r0 + cut) // per, m[cut:], off + cut * k


def _pieces_scale(pieces: list[tuple[int, torch.Tensor]], shape, granularity: str, kernel: str) -> torch.Tensor:
    """The scale(s) of a weight given as pieces (see :func:`fp8_quantize_pieces`); raises NonFiniteWeightError."""
    if granularity == "tensor":
        if len(pieces) == 1:
            return fp8_scale(pieces[0][1].reshape(-1), "tensor", kernel)
        return scale_from_amax(torch.stack([fp8_amax(t.reshape(-1), "tensor", kernel) for _, t in pieces]).amax())
    amax = torch.zeros(scale_shape(shape, granularity), dtype=torch.float32, device=pieces[0][1].device)
    for s0, part, _ in _block_rows(pieces, shape[1], granularity):
        a = fp8_amax(part, granularity, kernel)
        rows = amax[s0 : s0 + a.shape[0]]
        torch.maximum(rows, a, out=rows)  # a block row shared by two pieces takes the max of both; NaN stays
    return scale_from_amax(amax)


def _quantize_pieces_with(
    pieces: list[tuple[int, torch.Tensor]], scale: torch.Tensor, shape, granularity: str, out: torch.Tensor, kernel: str
) -> None:
    """Each piece quantized with ``scale`` into its region of ``out`` (see :func:`fp8_quantize_pieces`)."""
    flat = out.view(-1)
    if granularity == "tensor":
        for off, t in pieces:
            fp8_quantize(t.reshape(-1), scale, kernel, within_range=True, out=flat[off : off + t.numel()])
        return
    per = 1 if granularity == "channel" else BLOCK_SIZE[0]
    for s0, part, off in _block_rows(pieces, shape[1], granularity):
        rows = part.shape[0]
        dst = flat[off : off + part.numel()].view(part.shape)
        fp8_quantize(part, scale[s0 : s0 + -(-rows // per)], kernel, within_range=True, out=dst)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, kernel: str = "torch") -> torch.Tensor:
    """float32(q) * scale cast to ``dtype``, shape of ``q`` (float8_e4m3fn); ``scale`` float32 of 1 element, [N, 1] or
    [ceil(N/128), ceil(K/128)]. Raises ValueError for a scale shape that fits no layout for ``q``."""
    if kernel == "triton":
        from layerwise.kernels.ops import fp8_dequantize_triton

        return fp8_dequantize_triton(q, scale, dtype)
    return reference.dequantize(q, scale, dtype)


def fp8_quantize_weight(
    w: torch.Tensor, granularity: str = "tensor", kernel: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """amax -> scale -> quantize.

    Args:
        w: bf16/fp16/fp32 tensor; 2-D [N, K] for "channel" and "block".
        granularity: "tensor", "channel" or "block".
        kernel: "torch" or "triton".
    Returns:
        (q, scale): float8_e4m3fn tensor of w's shape; float32 scale of shape [] / [N, 1] /
        [ceil(N/128), ceil(K/128)].
    Raises:
        NonFiniteWeightError: ``w`` holds NaN or Inf.
    """
    if _one_pass([(0, w)], granularity, kernel):
        q = torch.empty(w.shape, dtype=FP8_DTYPE)
        return q, cpu_native.scale_quantize(w, q)  # one pass over w's memory instead of two
    scale = fp8_scale(w, granularity, kernel)
    # the scale comes from w's own amax, so |w| / scale < 464: the reference may skip its clamp
    return fp8_quantize(w, scale, kernel, within_range=True), scale


__all__ = [
    "BLOCK_SIZE",
    "FP8_DTYPE",
    "FP8_E4M3_MAX",
    "GRANULARITIES",
    "KERNELS",
    "fp8_amax",
    "has_non_finite",
    "require_finite",
    "fp8_quantize_pieces",
    "fp8_quantize_pieces_batch",
    "fp8_scale_pieces_batch",
    "pieces_fit",
    "fp8_dequantize",
    "fp8_quantize",
    "fp8_quantize_weight",
    "fp8_scale",
    "resolve_kernel",
    "scale_from_amax",
    "scale_layout",
    "scale_shape",
]
