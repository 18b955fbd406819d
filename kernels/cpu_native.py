"""The fused native CPU FP8 kernels (``_cpu_fp8.c``): amax and quantize in one vectorized pass each.

Bit-exact with :mod:`layerwise.kernels.reference` (tested over every bfloat16 bit pattern), and what the
``"torch"`` kernel runs on CPU for contiguous bfloat16 and float32 tensors when the extension is built.
torch's CPU cast to float8 is a scalar loop and the reference makes four passes (widen, divide, clamp,
cast): on an 8192 x 4096 BF16 weight here (AMD EPYC, 2 threads) the reference quantizes in 19-21 ms and
its per-channel amax takes 8.7 ms; the native kernels take 5.2-5.8 ms and 1.8-2.2 ms, against a 4.0 ms
``copy_`` of the weight (``python -m layerwise.benchmarks.quant_kernels``).

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
from layerwise.kernels.reference import FP8_DTYPE, scale_shape

ABI_VERSION = 2  # _cpu_fp8.ABI_VERSION of the C source this module calls

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
GRANULARITY_CODES = {"tensor": 0, "channel": 1, "block": 2}


def available() -> bool:
    """Whether the extension was built and imported."""
    return _cpu_fp8 is not None


def supports(w: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether the native kernels can take ``w`` (and write ``out``): built; a plain (not a subclass, not
    fake) contiguous non-empty bfloat16 or float32 CPU tensor; ``out`` None or a contiguous float8_e4m3fn
    CPU tensor of w's shape."""
    return (
        _cpu_fp8 is not None
        and not torch.compiler.is_compiling()
        and _plain(w)
        and w.device.type == "cpu"
        and w.dtype in DTYPE_CODES
        and w.numel() > 0
        and w.is_contiguous()
        and (
            out is None
            or (
                _plain(out)
                and out.device.type == "cpu"
                and out.dtype == FP8_DTYPE
                and out.shape == w.shape
                and out.is_contiguous()
            )
        )
    )


def _plain(t: torch.Tensor) -> bool:
    """A tensor whose data_ptr is its elements: a plain tensor or parameter (typed parameters included), not a
    fake tensor or a subclass that wraps inner tensors."""
    # issubclass, not isinstance: nn.Parameter(fake) is a FakeTensor that isinstance(., Parameter) accepts
    return type(t) is torch.Tensor or (issubclass(type(t), torch.nn.Parameter) and not is_traceable_wrapper_subclass(t))


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
    instead of six small torch ops: about 140 us an expert of an MoE layer, 128 experts a layer).

    Raises:
        NonFiniteWeightError: ``w`` holds NaN or Inf.
    """
    return _to_scale(amax(w, granularity))


def scale_from_amax(amax_value: torch.Tensor) -> torch.Tensor:
    """:func:`reference.scale_from_amax` of a float32 CPU tensor (a new tensor; one call instead of six small
    torch ops). Raises NonFiniteWeightError when any amax is NaN or Inf."""
    return _to_scale(amax_value.contiguous().clone())


def _to_scale(out: torch.Tensor) -> torch.Tensor:
    if _cpu_fp8.scale_from_amax(out.data_ptr(), out.numel()):
        raise NonFiniteWeightError("tensor holds NaN or Inf (non-finite amax)")
    return out


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
            w's own amax, see :func:`reference.quantize`): the conversion then skips its clamp and NaN selects,
            about 1.7x faster here, with the same bytes.
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
