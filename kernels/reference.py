"""Torch reference for FP8 (e4m3fn) weight quantization at three granularities.

This is the definition every other kernel is tested against, bit for bit, and what the CPU runs where the
native kernels (``cpu_native``) are not built or do not apply (float16, non-contiguous tensors).
The arithmetic is fixed so that any implementation can reproduce it exactly:

    amax  = max(|w|) over the scale's group, in float32 (exact: max involves no rounding)
    scale = amax / 448 (float32), or 1.0 where amax == 0, and never below float32's smallest normal
    q     = e4m3fn(round_half_even(clamp(float32(w) / scale, -448, 448)))

Groups: the whole tensor ("tensor", scale shape [] or [1]); each output row ("channel", [N, 1]);
each 128 x 128 block ("block", [ceil(N/128), ceil(K/128)], DeepSeek-V3's weight_scale_inv layout).
The division is IEEE float32 division, as in torch's own ``(w.float() / scale)`` on CPU and in
torchao's ``quantize_affine_float8``, so the bytes equal torchao's Float8WeightOnly per-tensor ones;
the Triton kernels ask for it explicitly with ``tl.div_rn``: Triton's ``/`` is ``div.full.f32`` (approximate,
off by an ulp, which moves round-half-to-even ties: seen on an H100), and Triton 3.6, the version torch 2.11
pins, ignores ``tl.fdiv(..., ieee_rounding=True)``. The recipe scale = amax / finfo(e4m3).max is vLLM's
(scaled_fp8_quant) and torchao's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerwise.errors import NonFiniteWeightError

FP8_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0
BLOCK_SIZE = (128, 128)
GRANULARITIES = ("tensor", "channel", "block")
# a granularity as the kernels take it (a Triton constexpr SCALE_MODE, the C extension's granularity argument)
GRANULARITY_CODES = {g: i for i, g in enumerate(GRANULARITIES)}
# Elements handled per step of the chunked loops: bounds the float32 temporaries to 1 MiB (larger chunks raise
# a load's peak over the model, which the peak-memory tests bound, at no measurable speed gain).
CHUNK_NUMEL = 1 << 18


def non_finite_flag(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on t's device, True where ``t`` holds NaN or +-Inf: the one finiteness test of the
    project, computed without reading anything back to the host (no CUDA synchronization).

    float8_e4m3fn has only NaN, the bytes 0x7F and 0xFF: the largest int8 (127) and the largest uint8 (255)
    of the same bytes, so two max reductions over views find them (no temporary the size of ``t``; 30x
    faster on a CPU than masking every byte); wider floats go through ``aminmax`` in row chunks (one pass,
    no temporary the size of ``t``); other dtypes are finite.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=t.device)
    if t.dtype == FP8_DTYPE:
        return (t.view(torch.int8).max() == 0x7F) | (t.view(torch.uint8).max() == 0xFF)
    return ~torch.isfinite(amax(t))


def has_non_finite(t: torch.Tensor) -> bool:
    """Whether ``t`` holds NaN or +-Inf: :func:`non_finite_flag` read on the host."""
    return bool(non_finite_flag(t))


def _row_chunks(n_rows: int, n_cols: int, align: int = 1):
    """[start, stop) row ranges of about CHUNK_NUMEL elements, starts aligned to ``align`` rows."""
    step = max(align, (CHUNK_NUMEL // max(1, n_cols)) // align * align)
    for start in range(0, n_rows, step):
        yield start, min(start + step, n_rows)


def scale_shape(shape: torch.Size | tuple, granularity: str) -> tuple:
    """Shape of the scale tensor for a weight of ``shape`` [N, K] at ``granularity``.

    Raises:
        ValueError: unknown granularity, or a per-channel/per-block weight that is not 2-D.
    """
    if granularity == "tensor":
        return ()
    if len(shape) != 2:
        raise ValueError(f"{granularity} scales need a 2-D weight, got shape {tuple(shape)}")
    n, k = shape
    if granularity == "channel":
        return (n, 1)
    if granularity == "block":
        return (-(-n // BLOCK_SIZE[0]), -(-k // BLOCK_SIZE[1]))
    raise ValueError(f"unknown granularity {granularity!r}; choose one of {GRANULARITIES}")


def scale_layout(w: torch.Tensor, scale: torch.Tensor) -> str:
    """The granularity a scale tensor's shape implies for weight ``w``.

    Raises:
        ValueError: the shape fits none of the three layouts.
    """
    if scale.numel() == 1:
        return "tensor"
    if w.dim() == 2:
        for g in ("channel", "block"):
            if tuple(scale.shape) == scale_shape(w.shape, g):
                return g
    raise ValueError(f"scale of shape {tuple(scale.shape)} fits no layout for a weight of shape {tuple(w.shape)}")


def amax(w: torch.Tensor, granularity: str = "tensor") -> torch.Tensor:
    """max(|w|) per group, float32, shaped like the scale (see :func:`scale_shape`).

    Args:
        w: floating tensor (bf16, fp16, fp32); 2-D [N, K] for "channel" and "block".
    Returns:
        float32 tensor on w's device; NaN/Inf in a group gives a non-finite entry.
    Per-tensor uses ``aminmax``; per-channel and per-block reduce float32 row chunks of large 16-bit weights
    (<= 1 MiB, but at least 128 rows for per-block: 128 * K * 4 bytes, 7 MiB at K = 14336).
    """
    shape = scale_shape(w.shape, granularity)
    if w.numel() == 0:
        return torch.zeros(shape, dtype=torch.float32, device=w.device)
    if granularity == "tensor":
        lo, hi = torch.aminmax(w)
        return torch.maximum(hi.float(), -lo.float())
    n, k = w.shape
    out = torch.empty(shape, dtype=torch.float32, device=w.device)
    if w.numel() >= CHUNK_NUMEL and w.dtype != torch.float32:
        return _amax_widened(w, granularity, out)
    # small or float32: reduce w itself (no float32 copy, so an MoE expert's tile adds no buffer)
    if granularity == "channel":
        for r0, r1 in _row_chunks(n, k):
            rows = w[r0:r1]  # amax and amin: torch.aminmax along a dim is much slower on CPU
            out[r0:r1, 0] = torch.maximum(rows.amax(dim=1).float(), -rows.amin(dim=1).float())
        return out
    bn = BLOCK_SIZE[0]
    for r0, r1 in _row_chunks(n, k, align=bn):
        _block_amax(w[r0:r1], out[r0 // bn : (r1 + bn - 1) // bn])
    return out


def _block_amax(w: torch.Tensor, out: torch.Tensor) -> None:
    """Per-128x128-block amax of ``w`` [rows, K] (any float dtype) into ``out`` float32 [ceil(rows/128),
    ceil(K/128)], on views of ``w``: the whole blocks as [row blocks, 128, K // 128, 128], the ragged last
    column block and the ragged last row block (if any) apart, so nothing is padded or copied."""
    rows, k = w.shape
    bn, bk = BLOCK_SIZE
    full_rows, full_cols = rows // bn * bn, k // bk * bk
    for ra, rb in ((0, full_rows), (full_rows, rows)):
        if rb == ra:
            continue
        height = bn if rb - ra >= bn else rb - ra  # the ragged last row block is one block of fewer rows
        part, dst = w[ra:rb], out[ra // bn : -(-rb // bn)]
        for ca, cb, width in ((0, full_cols, bk), (full_cols, k, k - full_cols)):
            if cb == ca:
                continue
            blocks = part[:, ca:cb].reshape((rb - ra) // height, height, (cb - ca) // width, width)  # a view
            hi, lo = torch.amax(blocks, dim=(1, 3)), torch.amin(blocks, dim=(1, 3))  # no |w| temporary
            dst[:, ca // bk : -(-cb // bk)] = torch.maximum(hi.float(), -lo.float())


def _amax_widened(w: torch.Tensor, granularity: str, out: torch.Tensor) -> torch.Tensor:
    """Per-channel / per-block amax of a large 16-bit ``w`` into ``out``, each row chunk widened into one
    reused float32 buffer (1 MiB; per-block at least 128 rows) and reduced there: torch's CPU reductions
    along a dim are several times slower on bf16 than on float32. |x| in place; amax keeps NaN (and Inf) in
    its group."""
    n, k = w.shape
    if granularity == "channel":
        buf = torch.empty(min(max(CHUNK_NUMEL, k), w.numel()), dtype=torch.float32, device=w.device)  # >= a row
        for r0, r1 in _row_chunks(n, k):
            tmp = buf[: (r1 - r0) * k].view(r1 - r0, k)
            tmp.copy_(w[r0:r1])
            torch.amax(tmp.abs_(), dim=1, out=out[r0:r1, 0])
        return out
    bn, bk = BLOCK_SIZE
    kb = out.shape[1]
    chunks = list(_row_chunks(n, k, align=bn))
    # rows rounded up to whole blocks, columns to kb * bk: the zero padding never wins a max
    widest = max(-(-(r1 - r0) // bn) * bn for r0, r1 in chunks) * kb * bk
    buf = torch.empty(widest, dtype=torch.float32, device=w.device)
    for r0, r1 in chunks:
        nb = -(-(r1 - r0) // bn)
        tmp = buf[: nb * bn * kb * bk].view(nb * bn, kb * bk)
        if (r1 - r0) % bn or k % bk:
            tmp.zero_()
        tmp[: r1 - r0, :k].copy_(w[r0:r1])
        out[r0 // bn : r0 // bn + nb] = tmp.view(nb, bn, kb, bk).abs_().amax(dim=(1, 3))
    return out


def scale_from_amax(amax_value: torch.Tensor, check: bool = True) -> torch.Tensor:
    """e4m3 scale(s) from amax(es).

    Args:
        amax_value: float32 tensor of any shape, finite, >= 0.
        check: raise for a NaN or Inf amax (a host read); False: the caller checks (a NaN amax then gives
            a scale of 1.0, an Inf one an Inf scale).
    Returns:
        float32 tensor of the same shape: amax / 448; 1.0 where amax == 0 (an all-zero group);
        never below ``torch.finfo(float32).tiny``, so w / scale never divides by zero or a subnormal.
    Raises:
        NonFiniteWeightError: with ``check``, when any amax is NaN or Inf (the tensor it came from holds one).
    """
    amax_value = amax_value.float()
    if check and has_non_finite(amax_value):
        raise NonFiniteWeightError("tensor holds NaN or Inf (non-finite amax)")
    # A tensor divisor, not the Python number: CUDA's div turns division by a CPU scalar into a
    # multiplication by its reciprocal, which is 1 ulp off for some amaxes (seen on an H100).
    divisor = torch.full((), FP8_E4M3_MAX, dtype=torch.float32, device=amax_value.device)
    scale = torch.clamp(amax_value / divisor, min=torch.finfo(torch.float32).tiny)
    return torch.where(amax_value > 0, scale, torch.ones_like(scale))


# The activation granularity the W8A8 forward pairs with each weight scale layout (quant.fp8): one scale over x
# with one over the weight, one per token with one per output channel (torch._scaled_mm row-wise), one per token
# group of 128 with one per 128 x 128 block (DeepSeek-V3)
ACT_GRANULARITY = {"tensor": "tensor", "channel": "token", "block": "group"}


def activation_scale(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Dynamic e4m3 scale(s) of activations x [M, K]: max(amax / 448, float32 tiny) per group.

    Args:
        x: 2-D floating tensor [M, K].
        granularity: "tensor" (scale [1]), "token" (one per row, [M, 1]) or "group" (one per row and
            128 columns, [M, ceil(K / 128)]).
    Returns:
        float32 scales on x's device. No host sync and no finiteness check (a CUDA graph can capture
        it); an all-zero group gets the tiny scale and quantizes to 0; NaN/Inf give a non-finite scale.
    Raises:
        ValueError: unknown granularity.
    IEEE division by a device tensor: CUDA turns division by a Python number into a multiplication by
    its reciprocal, 1 ulp off for some amaxes.
    """
    if granularity == "tensor":
        a = amax(x, "tensor").reshape(1)
    elif granularity == "token":
        a = amax(x, "channel")
    elif granularity == "group":
        m, k = x.shape
        bk = BLOCK_SIZE[1]
        padded = F.pad(x, (0, -k % bk)).reshape(m, -(-k // bk), bk)  # zeros never win a max of |x|
        hi, lo = torch.amax(padded, dim=2), torch.amin(padded, dim=2)
        a = torch.maximum(hi.float(), -lo.float())
    else:
        raise ValueError(f"unknown activation granularity {granularity!r}; choose tensor, token or group")
    divisor = torch.full((), FP8_E4M3_MAX, dtype=torch.float32, device=x.device)
    return torch.clamp(a / divisor, min=torch.finfo(torch.float32).tiny)


def quantize_activation(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [M, K], float32 scales) of activations x [M, K]: :func:`activation_scale`, then
    :func:`quantize` (a "group" scale is expanded to one column per element first). Raises ValueError
    for an unknown granularity."""
    scale = activation_scale(x, granularity)
    if granularity != "group":
        return quantize(x, scale), scale
    expanded = scale.repeat_interleave(BLOCK_SIZE[1], dim=1)[:, : x.shape[1]]
    q = (x.float() / expanded).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_DTYPE)
    return q, scale


def _expand_rows(scale: torch.Tensor, granularity: str, r0: int, r1: int, n_cols: int) -> torch.Tensor:
    """The scale entries for rows [r0, r1), broadcastable to [r1 - r0, n_cols]."""
    if granularity == "tensor":
        return scale.reshape(())
    if granularity == "channel":
        return scale[r0:r1]
    bn, bk = BLOCK_SIZE
    rows = scale[r0 // bn : (r1 - 1) // bn + 1].repeat_interleave(bn, dim=0)[r0 % bn : r0 % bn + r1 - r0]
    if granularity == "block_rows":  # expanded along rows only: [r1 - r0, ceil(K / 128)]
        return rows
    return rows.repeat_interleave(bk, dim=1)[:, :n_cols]


def quantize(
    w: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None, *, within_range: bool = False
) -> torch.Tensor:
    """Quantize ``w`` to float8_e4m3fn with per-tensor, per-channel or per-block scales.

    Args:
        w: floating tensor; any shape with one scale, else 2-D [N, K].
        scale: float32, 1 element, [N, 1], or [ceil(N/128), ceil(K/128)] (layout read off its shape).
        out: optional contiguous float8_e4m3fn tensor of w's shape, written in place.
        within_range: the caller guarantees |w| / scale < 464 everywhere (true for a scale from w's own
            amax: |w| / (amax / 448) <= 448 * (1 + 2^-23)); the clamp is then skipped, which changes no
            byte (torch's e4m3 cast rounds every value below 464 to at most 448, as after the clamp).
    Returns:
        float8_e4m3fn tensor of w's shape (``out`` when given). ``w`` is never modified.
    Raises:
        ValueError: a scale shape that fits no layout for ``w`` (:func:`scale_layout`).
    Work is done in row chunks, so the float32 temporaries stay <= 1 MiB.
    """
    granularity = scale_layout(w, scale)
    if out is None:
        out = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = scale.float()
    src = w.reshape(1, -1) if granularity == "tensor" else w
    dst = out.view(1, -1) if granularity == "tensor" else out
    n, k = src.shape
    # One float32 work buffer, reused: w is never written, even when it is float32 already. It holds at least one
    # row of a per-channel / per-block weight (rows longer than CHUNK_NUMEL are not split).
    row = CHUNK_NUMEL if granularity == "tensor" else k
    buf = torch.empty(min(max(CHUNK_NUMEL, row), src.numel()), dtype=torch.float32, device=w.device)
    if granularity == "tensor":  # one long row: chunk along it
        for c0 in range(0, k, CHUNK_NUMEL):
            c1 = min(c0 + CHUNK_NUMEL, k)
            tmp = buf[: c1 - c0].view(1, -1)
            # widen, then divide in place: a mixed-dtype torch.div(bf16, f32, out=f32) is many times slower on
            # CPU than a widening copy and a float32 division
            tmp.copy_(src[:, c0:c1])
            _quantize_widened(tmp, scale, dst[:, c0:c1], within_range=within_range)
        return out
    for r0, r1 in _row_chunks(n, k):
        tmp = buf[: (r1 - r0) * k].view(r1 - r0, k)
        tmp.copy_(src[r0:r1])
        _quantize_widened(tmp, _scale_rows(scale, granularity, r0, r1), dst[r0:r1], within_range=within_range)
    return out


def _scale_rows(scale: torch.Tensor, granularity: str, r0: int, r1: int) -> torch.Tensor:
    """The rows of a per-channel ([N, 1]) or per-block ([ceil(N/128), ceil(K/128)]) scale that rows [r0, r1)
    of the weight use, in the layout :func:`_quantize_widened` takes; a per-tensor scale unchanged."""
    if granularity == "tensor":
        return scale
    if granularity == "channel":
        return scale[r0:r1]
    return _expand_rows(scale, "block_rows", r0, r1, 0)  # [rows, ceil(K / 128)]


def _quantize_widened(
    tmp: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, *, within_range: bool = False
) -> torch.Tensor:
    """The divide-clamp-cast half of :func:`quantize`, on a weight already widened to float32.

    Args:
        tmp: float32 [rows, K] (or [1, numel] per tensor) holding float32(w); OVERWRITTEN (divided in place).
        scale: float32; 1 element (per tensor), [rows, 1] (per channel), or [rows, ceil(K/128)] (per block,
            one row per weight row: the block scales expanded along rows only).
        out: float8_e4m3fn of tmp's shape, written.
        within_range: as in :func:`quantize` (skip the clamp).
    Returns:
        ``out``. Its bytes equal :func:`quantize` of the unwidened weight with the same scales.
    """
    rows, k = tmp.shape
    if scale.numel() == 1:
        tmp.div_(scale.float().reshape(1))
    elif scale.shape[1] == 1:  # per channel, or per block with a single column of blocks
        tmp.div_(scale[:, :1])
    else:  # [rows, K / 128, 128] blocks divided by a broadcast [rows, K / 128, 1] scale
        bk = BLOCK_SIZE[1]
        full = k // bk
        if full:
            tmp[:, : full * bk].view(rows, full, bk).div_(scale[:, :full, None])
        if k % bk:  # the ragged last block
            tmp[:, full * bk :].div_(scale[:, full:])
    if not within_range:
        tmp.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    out.copy_(tmp)
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: (float32(q) * scale) cast to ``dtype``, shape of q. Raises ValueError for a
    scale shape that fits no layout for ``q`` (:func:`scale_layout`)."""
    granularity = scale_layout(q, scale)
    if granularity == "tensor":
        return (q.to(torch.float32) * scale.float().reshape(())).to(dtype)
    return (q.to(torch.float32) * _expand_rows(scale.float(), granularity, 0, q.shape[0], q.shape[1])).to(dtype)
