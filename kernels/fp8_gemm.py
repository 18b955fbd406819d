"""Triton GEMMs over FP8 (e4m3fn) weights that never materialize a dequantized weight.

Both compute y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with a float32 accumulator, reading the
FP8 weight bytes and their float32 scales inside the K loop:

* :func:`w8a16_gemm` (weight-only): x in bf16/fp16, W's scale per tensor ([1]), per output channel
  ([N, 1]) or per 128 x 128 block ([ceil(N/128), ceil(K/128)]). Each weight tile is decoded to
  x's dtype (exact: every e4m3 value is a bf16 and an fp16 value) and multiplied by tensor cores;
  per-tensor / per-channel scales multiply the accumulator once at the end, per-block scales each
  K block's partial product (BLOCK_K = 128 then). For GPUs without FP8 tensor cores (sm_80) the
  bytes are decoded with integer ops (``triton_common.e4m3_value``); sm_89+ convert in hardware.
* :func:`w8a8_gemm` (both operands e4m3, FP8 ``tl.dot`` on sm_89+). Per-block weights (DeepSeek-V3's
  block-scaled GEMM, as vLLM's w8a8_block_fp8_matmul): x quantized per token group of 128
  (``kernels.fp8_act``, scales [M, ceil(K/128)]); each K step of 128 is one ``tl.dot`` whose float32
  result is multiplied by the token-group scales (rows) and the block scales (columns) before it joins
  the accumulator: acc += dot(xq, wq^T) * xs[:, k] * ws[n // 128, k]. Per-channel / per-tensor weights
  with per-token / per-tensor x: acc * xs[:, None] * ws[None, :] once at the end (``torch._scaled_mm``'s
  arithmetic).
* :func:`dynamic_w8a8_gemm`: the same GEMM of bf16/fp16 x, quantized as ``kernels.fp8_act`` quantizes it but
  inside the GEMM for decode batches (each program quantizes the x tiles it reads; per token / per tensor
  after an amax pass over K): one launch per linear instead of two or three, the same bytes and output. Each
  of the N / BLOCK_N column tiles quantizes x again (~40 ALU ops an element, integer e4m3 rounding and IEEE
  division): with 16-wide decode tiles that is ~M_pad / 16 quantizations per weight byte, enough to make a
  memory-bound GEMM ALU-bound, so it pays only with wide column tiles (split K then keeps the GPU busy). The
  forward therefore runs it only where the tuner measured it faster than the quantization kernel and
  ``torch._scaled_mm`` (per-tensor and per-channel weights); per-block weights quantize first.

Tiling (``launch_tiles``): a configuration tuned on this GPU for the shape and M where
``kernels.gemm_configs`` stores one (``python -m layerwise.benchmarks.gemm_tune``), else the
heuristic tables of ``gemm_tiles``. Decode batches (M <= 16) are memory-bound on the weight bytes, so
there one program covers 16 rows of x and only BLOCK_N = 16 output columns and streams K in steps of
256 (128 for per-block): a Llama-3-8B projection (N >= 4096) then runs >= 256 programs, about two
per SM of an H100, each with num_stages = 4 tiles in flight. Larger M gets wider tiles (vLLM's
defaults for the block GEMM: 64 x 128 x 128, 4 warps, 3 stages).

Split-K (``GemmTiles.split_k`` > 1): the K blocks are dealt in equal runs to the splits (``k_span``),
each program of a split writes its float32 partial [M, N] tile, and a second launch
(``_split_k_reduce_kernel``) sums the partials in split order, then applies the per-tensor /
per-channel scale, the bias and the output cast, in that order as the unsplit kernel does. Wider
column tiles then still give enough programs to fill the GPU, and read x fewer times. The built-in
tables never split; a tuned configuration may (whether it pays is measured, not assumed).

The interpreter (CPU, tests) decodes with integer ops and multiplies in float32 with IEEE
products (``DOT_DTYPE``); bf16 output is rounded half to even by hand, as in ``fp8_tiles``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from layerwise.kernels.fp8_act import ACT_GRANULARITIES, GROUP_SIZE, quantize_activation, quantize_bits, scale_of
from layerwise.kernels.gemm_configs import tuned_fields
from layerwise.kernels.reference import BLOCK_SIZE, FP8_DTYPE, GRANULARITY_CODES, scale_layout
from layerwise.kernels.triton_common import (
    HAS_TRITON,
    abs_nan_to_inf,
    as_kernel_input,
    e4m3_value,
    helper,
    launch,
    load_f32,
    max_all,
    tl,
    triton,
)


class GemmTiles(NamedTuple):
    """A GEMM launch configuration: the output tile of one program, the K step, the number of K splits
    (1: no split), and the launch options."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


# (max M, tiles), first row whose max M >= M wins.
# W8A16, per-tensor / per-channel weights (BLOCK_K for per-block is forced to 128).
W8A16_TILES_CUDA = (
    (16, GemmTiles(16, 16, 256, 1, 4, 4)),
    (32, GemmTiles(32, 32, 128, 1, 4, 4)),
    (64, GemmTiles(64, 32, 128, 1, 4, 4)),
    (None, GemmTiles(64, 64, 128, 1, 4, 3)),
)
# W8A8 (per block, BLOCK_K is forced to the 128 of the block)
W8A8_TILES_CUDA = (
    (16, GemmTiles(16, 16, 128, 1, 4, 4)),
    (32, GemmTiles(32, 32, 128, 1, 4, 4)),
    (64, GemmTiles(64, 64, 128, 1, 4, 3)),
    (None, GemmTiles(64, 128, 128, 1, 4, 3)),
)
TILES_INTERPRET = GemmTiles(16, 32, 128, 1, 1, 1)  # the interpreter pays per program: few, mid-sized tiles
REDUCE_BLOCK = 1024  # outputs per program of the split-K reduction
# Rows of x up to which dynamic_w8a8_gemm quantizes x inside the GEMM (decode: a launch less per linear); beyond,
# it quantizes once first (every column tile would re-quantize more rows). A first guess, unmeasured: the tuner
# decides whether the kernel runs at all, at the decode M it tunes.
DYNAMIC_QUANT_MAX_M = 64


def gemm_tiles(m: int, device: torch.device, kind: str) -> GemmTiles:
    """The default tiles for ``m`` rows of x on ``device``; kind "w8a16" or "w8a8" (either scale layout)."""
    if device.type == "cpu":
        return TILES_INTERPRET
    table = W8A16_TILES_CUDA if kind == "w8a16" else W8A8_TILES_CUDA
    for max_m, tiles in table:
        if max_m is None or m <= max_m:
            return tiles
    raise AssertionError("unreachable: the last row takes any M")


def tuned_tiles(kind: str, m: int, n: int, k: int, device: torch.device) -> GemmTiles | None:
    """The configuration tuned on this GPU for a GEMM of ``kind`` (one of ``kernels.gemm_configs.KINDS``) and
    shape, or None where none is stored (and on CPU)."""
    fields = tuned_fields(kind, n, k, m, device)
    return None if fields is None else GemmTiles(*fields)


def launch_tiles(kind: str, m: int, n: int, k: int, device: torch.device) -> GemmTiles:
    """The tiles a GEMM of ``kind`` launches with: :func:`tuned_tiles` where stored, else :func:`gemm_tiles`."""
    tuned = tuned_tiles(kind, m, n, k, device)
    return tuned or gemm_tiles(m, device, "w8a8" if kind.startswith("w8a8") else "w8a16")


def gemm_kind(gemm: str, granularity: str) -> str:
    """The ``kernels.gemm_configs`` kind of GEMM ``gemm`` ("w8a16" or "w8a8") over weights of scale layout
    ``granularity``: per block its own kind ("w8a16-block", "w8a8-block"), per tensor and per channel one."""
    return f"{gemm}-block" if granularity == "block" else gemm


def k_span(k: int, tiles: GemmTiles) -> tuple[int, int]:
    """(K columns per split, number of splits): the K blocks of ``tiles.block_k`` dealt in equal runs to
    at most ``tiles.split_k`` splits; fewer splits where K has fewer blocks (none is empty)."""
    blocks = triton.cdiv(k, tiles.block_k)
    span = triton.cdiv(blocks, max(1, min(tiles.split_k, blocks))) * tiles.block_k
    return span, triton.cdiv(k, span)


@helper
def decode_e4m3(bits, FP8_NATIVE: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """uint8 e4m3 bytes -> DOT_DTYPE values (exact): a hardware conversion on sm_89+ (FP8_NATIVE),
    integer ops elsewhere (sm_80, the interpreter)."""
    if FP8_NATIVE:
        v = bits.to(tl.float8e4nv, bitcast=True).to(DOT_DTYPE)
    else:
        v = e4m3_value(bits.to(tl.int32)).to(DOT_DTYPE)
    return v


@helper
def store_out(out_ptr, offs, y, mask, OUT_BF16: tl.constexpr):
    """Store float32 ``y`` in the output dtype; bf16 as int16 bits rounded half to even by hand."""
    if OUT_BF16:
        bits = y.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        tl.store(out_ptr + offs, (bits >> 16).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@helper
def program_tile(m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(rows int64 [BLOCK_M], cols int64 [BLOCK_N], split int32) of this program: programs run over the
    output tiles of [m, n] with the column tile fastest, then over the K splits, all on grid axis 0."""
    pid = tl.program_id(0)
    n_tiles = (n + BLOCK_N - 1) // BLOCK_N
    tiles = ((m + BLOCK_M - 1) // BLOCK_M) * n_tiles
    tile = pid % tiles
    rm = (tile // n_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tile % n_tiles).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn, pid // tiles


@helper
def store_partial(partial_ptr, split, rm, rn, acc, m, n):
    """Store float32 ``acc`` [BLOCK_M, BLOCK_N] as split ``split``'s slice of the partials [splits, m, n]."""
    mask = (rm[:, None] < m) & (rn[None, :] < n)
    tl.store(partial_ptr + (split.to(tl.int64) * m * n + rm[:, None] * n + rn[None, :]), acc, mask=mask)


@helper
def finish(acc, rm, rn, scale_ptr, bias_ptr, out_ptr, m, n, OUT_BF16: tl.constexpr, HAS_BIAS: tl.constexpr,
           SCALE_MODE: tl.constexpr):  # fmt: skip
    """out[rm, rn] = acc * scale (SCALE_MODE 0: per tensor, 1: per column; 2: already scaled) + bias."""
    if SCALE_MODE == 0:
        acc = acc * tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        acc = acc * tl.load(scale_ptr + rn, mask=rn < n, other=0.0)[None, :]
    mask = (rm[:, None] < m) & (rn[None, :] < n)
    if HAS_BIAS:
        acc = acc + load_f32(bias_ptr + rn, rn < n, OUT_BF16)[None, :]
    store_out(out_ptr, rm[:, None] * n + rn[None, :], acc, mask, OUT_BF16)


def _w8a16_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    m,
    n,
    k,
    scale_cols,
    k_split,
    IS_BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # DOT_DTYPE: x's dtype on CUDA (tensor cores); float32 with IEEE products in the interpreter.
    # SPLIT: K is split (k_split columns a split, a multiple of BLOCK_K); the float32 partial goes to
    # partial_ptr and _split_k_reduce_kernel finishes (scale, bias, cast). Otherwise k_split >= k (one split).
    rm, rn, split = program_tile(m, n, BLOCK_M, BLOCK_N)
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, k)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < m) & (rk[None, :] < k)
        x = load_f32(x_ptr + (rm[:, None] * k + rk[None, :]), x_mask, IS_BF16).to(DOT_DTYPE)
        w_mask = (rk[:, None] < k) & (rn[None, :] < n)  # W^T tile [BLOCK_K, BLOCK_N]
        w = decode_e4m3(tl.load(w_ptr + (rn[None, :] * k + rk[:, None]), mask=w_mask, other=0), FP8_NATIVE, DOT_DTYPE)
        if DOT_DTYPE == tl.float32:
            part = tl.dot(x, w, input_precision="ieee", out_dtype=tl.float32)
        else:
            part = tl.dot(x, w, out_dtype=tl.float32)
        if SCALE_MODE == 2:  # BLOCK_K == 128 and BLOCK_N divides 128: one block column per step
            s = tl.load(scale_ptr + ((rn // 128) * scale_cols + k0 // 128), mask=rn < n, other=0.0)
            acc += part * s[None, :]
        else:
            acc += part
    if SPLIT:
        store_partial(partial_ptr, split, rm, rn, acc, m, n)
    else:
        finish(acc, rm, rn, scale_ptr, bias_ptr, out_ptr, m, n, IS_BF16, HAS_BIAS, SCALE_MODE)


def _split_k_reduce_kernel(
    partial_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    splits,
    OUT_BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # outputs [pid * BLOCK, +BLOCK) of the flattened [m, n]: the splits' partials summed in split order
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    size = tl.cast(m, tl.int64) * n  # not m.to(): m == 1 arrives as a Python int (Triton's specialization)
    mask = offs < size
    acc = tl.load(partial_ptr + offs, mask=mask, other=0.0)
    for s in range(1, splits):
        acc += tl.load(partial_ptr + (s * size + offs), mask=mask, other=0.0)
    rn = offs % n
    if SCALE_MODE == 0:
        acc = acc * tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        acc = acc * tl.load(scale_ptr + rn, mask=mask, other=0.0)
    if HAS_BIAS:
        acc = acc + load_f32(bias_ptr + rn, mask, OUT_BF16)
    store_out(out_ptr, offs, acc, mask, OUT_BF16)


def _w8a8_gemm_kernel(
    xq_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    partial_ptr,
    m,
    n,
    k,
    x_scale_cols,
    w_scale_cols,
    k_split,
    OUT_BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    X_QUANT: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # SCALE_MODE 2 (per block): x per token group [m, x_scale_cols], W per 128 x 128 block [., w_scale_cols],
    # both applied to each K step of 128. Otherwise both scales multiply the finished product once:
    # x_scale_cols / w_scale_cols are then the scales' strides along rows / columns (0: one scale, 1: one each).
    # X_QUANT: xq_ptr holds x itself (out's dtype, bf16/fp16) and the kernel quantizes it as
    # kernels.fp8_act.quantize_activation does (x_scale_ptr unused): per token group, each K step's own tile;
    # per token (x_scale_cols 1) or per tensor (0, every row in this program: m <= BLOCK_M), from an amax
    # over the whole of K first. The bytes and scales equal the unfused ones, so the output does too.
    # SPLIT as in _w8a16_gemm_kernel; the partials are already scaled (the reduction adds the bias).
    rm, rn, split = program_tile(m, n, BLOCK_M, BLOCK_N)
    k_lo = split * k_split
    k_hi = tl.minimum(k_lo + k_split, k)
    if X_QUANT and SCALE_MODE != 2:  # the rows' amax over all of K (not only this split's), then their scales
        amax = tl.full([BLOCK_M], 0.0, tl.float32)
        for k0 in range(0, k, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = load_f32(xq_ptr + (rm[:, None] * k + rk[None, :]), (rm[:, None] < m) & (rk[None, :] < k), OUT_BF16)
            amax = tl.maximum(amax, max_all(abs_nan_to_inf(x), 1))
        amax = tl.where(x_scale_cols == 0, max_all(amax, 0), amax)  # per tensor: rows past m hold 0
        row_scale = scale_of(amax)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x_mask = (rm[:, None] < m) & (rk[None, :] < k)
        if X_QUANT:
            x = load_f32(xq_ptr + (rm[:, None] * k + rk[None, :]), x_mask, OUT_BF16)
            if SCALE_MODE == 2:  # this K step is one token group: its scale from this tile
                xs = scale_of(max_all(abs_nan_to_inf(x), 1))
            else:
                xs = row_scale
            a = quantize_bits(x, xs[:, None])
        else:
            a = tl.load(xq_ptr + (rm[:, None] * k + rk[None, :]), mask=x_mask, other=0)
            if SCALE_MODE == 2:  # BLOCK_K == 128: one token group
                xs = tl.load(x_scale_ptr + (rm * x_scale_cols + k0 // BLOCK_K), mask=rm < m, other=0.0)
        b = tl.load(w_ptr + (rn[None, :] * k + rk[:, None]), mask=(rk[:, None] < k) & (rn[None, :] < n), other=0)
        if FP8_NATIVE:  # e4m3 tensor cores (sm_89+)
            part = tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True), out_dtype=tl.float32)
        else:
            a32 = e4m3_value(a.to(tl.int32))
            b32 = e4m3_value(b.to(tl.int32))
            part = tl.dot(a32, b32, input_precision="ieee", out_dtype=tl.float32)
        if SCALE_MODE == 2:  # BLOCK_K == 128: one token group and one weight block column
            ws = tl.load(w_scale_ptr + ((rn // 128) * w_scale_cols + k0 // 128), mask=rn < n, other=0.0)
            acc += part * xs[:, None] * ws[None, :]
        else:
            acc += part
    if SCALE_MODE != 2:
        if X_QUANT:
            xs = row_scale
        else:
            xs = tl.load(x_scale_ptr + rm * x_scale_cols, mask=rm < m, other=0.0)
        ws = tl.load(w_scale_ptr + rn * w_scale_cols, mask=rn < n, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    if SPLIT:
        store_partial(partial_ptr, split, rm, rn, acc, m, n)
    else:
        finish(acc, rm, rn, w_scale_ptr, bias_ptr, out_ptr, m, n, OUT_BF16, HAS_BIAS, 2)


def fp8_native(device: torch.device) -> bool:
    """Whether ``device`` converts and multiplies e4m3 in hardware (CUDA sm_89+)."""
    return device.type == "cuda" and _capability(device.index) >= (8, 9)


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def dot_dtype(dtype: torch.dtype, device: torch.device):
    """The Triton dtype W8A16 multiplies in: x's dtype on CUDA, float32 (IEEE) in the interpreter."""
    if device.type == "cpu":
        return tl.float32
    return tl.bfloat16 if dtype == torch.bfloat16 else tl.float16


def _check_gemm_inputs(x: torch.Tensor, weight: torch.Tensor, name: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"{name}: triton is not installed")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if weight.dtype != FP8_DTYPE or not weight.is_contiguous():
        raise TypeError(f"{name}: weight must be a contiguous {FP8_DTYPE} tensor, got {weight.dtype}")
    if x.device != weight.device or x.device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: x and weight must share a cuda (or cpu, interpreted) device")


def _run(fn, device, m, n, k, tiles, pointers, sizes, epilogue, **constexprs) -> None:
    """Launch GEMM kernel ``fn`` over the output tiles and K splits of ``tiles``; with more than one split,
    the reduction kernel sums the float32 partials and applies ``epilogue`` (scale, bias, out, SCALE_MODE).

    ``pointers`` are the kernel's arguments before partial_ptr, ``sizes`` those between k and k_split.
    """
    span, splits = k_span(k, tiles)
    scale, bias, out, scale_mode = epilogue
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n) * splits,)
    partial = _empty((splits, m, n), torch.float32, device) if splits > 1 else scale
    options = {} if device.type == "cpu" else dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    blocks = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k)
    launch(fn, device, grid, *pointers, partial, m, n, k, *sizes, span, SPLIT=splits > 1, **blocks, **constexprs,
           **options)  # fmt: skip
    if splits > 1:
        out_bits, out_bf16 = as_kernel_input(out)
        launch(
            _split_k_reduce_kernel, device, (triton.cdiv(m * n, REDUCE_BLOCK),), partial, scale,
            bias if bias is not None else out_bits, out_bits, m, n, splits, OUT_BF16=out_bf16,
            HAS_BIAS=bias is not None, SCALE_MODE=scale_mode, BLOCK=REDUCE_BLOCK,
            **({} if device.type == "cpu" else dict(num_warps=4)),
        )  # fmt: skip


def _empty(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The GEMMs' output and split-K partials: uninitialized (the tuner fills them with NaN instead, so a
    configuration that leaves elements unwritten cannot pass its check on stale memory)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _fit_block(tiles: GemmTiles) -> GemmTiles:
    """``tiles`` for per-block weight scales: a K step of one block (128), column tiles within one block row."""
    return tiles._replace(block_n=min(tiles.block_n, BLOCK_SIZE[0]), block_k=BLOCK_SIZE[1])


def w8a16_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """y = x @ (float32(weight) * scale)^T + bias, without a dequantized copy of the weight.

    Args:
        x: contiguous bf16/fp16 [M, K] on cuda (compiled) or cpu (interpreted).
        weight: contiguous float8_e4m3fn [N, K] on x's device.
        scale: float32 on x's device: 1 element (per tensor), [N, 1] (per channel) or
            [ceil(N/128), ceil(K/128)] (per block).
        bias: optional [N] in x's dtype.
        tiles: the launch configuration; default :func:`launch_tiles` (per-block scales force BLOCK_K = 128
            and BLOCK_N <= 128).
    Returns:
        [M, N] in x's dtype; float32 accumulation (see the module docstring for the order of scaling).
    Raises:
        TypeError / ValueError: dtypes, shapes or devices the kernel does not take.
    """

    _check_gemm_inputs(x, weight, "w8a16_gemm")
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous():
        raise TypeError(f"w8a16_gemm: x must be contiguous bf16/fp16, got {x.dtype}")
    granularity = scale_layout(weight, scale)
    (m, k), n = x.shape, weight.shape[0]
    out = _empty((m, n), x.dtype, x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    tiles = tiles or launch_tiles(gemm_kind("w8a16", granularity), m, n, k, x.device)
    if granularity == "block":
        tiles = _fit_block(tiles)
    scale = scale.to(torch.float32).contiguous()
    x_bits, is_bf16 = as_kernel_input(x)
    bias_bits = as_kernel_input(bias.contiguous())[0] if bias is not None else None
    out_bits = as_kernel_input(out)[0]
    mode = GRANULARITY_CODES[granularity]
    _run(
        _w8a16_gemm_kernel, x.device, m, n, k, tiles,
        (x_bits, weight.view(torch.uint8), scale, bias_bits if bias is not None else x_bits, out_bits),
        (scale.shape[-1] if granularity == "block" else 1,), (scale, bias_bits, out, mode),
        IS_BF16=is_bf16, HAS_BIAS=bias is not None, SCALE_MODE=mode, FP8_NATIVE=fp8_native(x.device),
        DOT_DTYPE=dot_dtype(x.dtype, x.device),
    )  # fmt: skip
    return out


def w8a8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """y = (xq * x_scale) @ (weight * weight_scale)^T + bias, both operands FP8 (e4m3 tensor cores).

    Scale layouts, by the weight's:

    * per 128 x 128 block (DeepSeek-V3; vLLM's w8a8_block_fp8_matmul): weight_scale [ceil(N/128),
      ceil(K/128)] (``weight_scale_inv``) and x_scale [M, ceil(K/128)], one per token group of 128
      (``quantize_activation(x, "group")``), applied to each K step of 128;
    * per channel [N, 1] or per tensor [1], with x_scale per token [M, 1] or per tensor [1]: both
      multiply the finished float32 product once (what ``torch._scaled_mm`` computes).

    Args:
        xq: contiguous float8_e4m3fn [M, K]; weight: contiguous float8_e4m3fn [N, K]; scales float32.
        out_dtype: bf16 or fp16.
        bias: optional [N] in out_dtype.
        tiles: the launch configuration; default :func:`launch_tiles` (kind "w8a8-block" or "w8a8"; per-block
            scales force BLOCK_K = 128 and BLOCK_N <= 128).
    Returns:
        [M, N] in out_dtype, float32 accumulation.
    Raises:
        RuntimeError: a CUDA device below sm_89 (no e4m3 tensor cores; use :func:`w8a16_gemm`).
        TypeError / ValueError: dtypes, shapes or scale layouts the kernel does not take.
    """
    _check_gemm_inputs(xq, weight, "w8a8_gemm")
    m, k = xq.shape
    granularity = scale_layout(weight, weight_scale)
    if xq.dtype != FP8_DTYPE or not xq.is_contiguous():
        raise TypeError(f"w8a8_gemm: xq must be a contiguous {FP8_DTYPE} tensor, got {xq.dtype}")
    if granularity == "block":
        x_cols = triton.cdiv(k, GROUP_SIZE)
        if tuple(x_scale.shape) != (m, x_cols):
            raise TypeError(f"w8a8_gemm: per-block weights need x_scale [{m}, {x_cols}], got {tuple(x_scale.shape)}")
    else:
        x_cols = 0 if x_scale.numel() == 1 else 1  # the stride of x's scales along rows: 0 one, 1 each
        if x_scale.numel() != 1 and tuple(x_scale.shape) != (m, 1):
            raise TypeError(f"w8a8_gemm: x_scale must be [{m}, 1] or one element, got {tuple(x_scale.shape)}")
    x_operands = (xq.view(torch.uint8), x_scale.to(torch.float32).contiguous())
    tiles = tiles or launch_tiles(gemm_kind("w8a8", granularity), m, weight.shape[0], k, xq.device)
    return _w8a8(x_operands, x_cols, False, weight, weight_scale, granularity, out_dtype, bias, tiles)


def dynamic_w8a8_gemm(
    x: torch.Tensor,
    act_granularity: str,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """:func:`w8a8_gemm` of x quantized dynamically, as ``kernels.fp8_act.quantize_activation(x, act_granularity)``
    quantizes it, and for decode batches inside the GEMM: one launch (two with split K) instead of the
    quantization's one or two more, and no FP8 copy of x in memory. Each program then quantizes the x tiles it
    reads, with that function's scales: per token group of 128 from the tile of each K step; per token or per
    tensor from an amax over all of K first (x's rows read twice). So bytes, scales and output equal those of
    ``w8a8_gemm(*quantize_activation(x, act_granularity), ...)`` with the same tiles, bit for bit (NaN / Inf as
    there), and that pair runs instead beyond ``DYNAMIC_QUANT_MAX_M`` rows (every column tile would re-read and
    re-quantize bf16 x) and, per tensor, beyond BLOCK_M rows (one scale needs every row in one program). Whether
    it beats the pair depends on the tiles (see the module docstring: each column tile quantizes x again).

    Args:
        x: contiguous bf16/fp16 [M, K]: the activations, also the output's dtype.
        act_granularity: "group" with per-block weights; "token" or "tensor" with per-channel / per-tensor ones.
        weight, weight_scale, bias, tiles: as for :func:`w8a8_gemm`.
    Returns:
        [M, N] in x's dtype.
    Raises:
        ValueError: ``act_granularity`` does not go with the weight's scale layout.
        RuntimeError / TypeError: as :func:`w8a8_gemm`.
    """
    _check_gemm_inputs(x, weight, "dynamic_w8a8_gemm")
    if x.dtype not in (torch.bfloat16, torch.float16) or not x.is_contiguous():
        raise TypeError(f"dynamic_w8a8_gemm: x must be contiguous bf16/fp16, got {x.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    granularity = scale_layout(weight, weight_scale)
    if act_granularity == "group" and granularity != "block" and k <= GROUP_SIZE:
        act_granularity = "token"  # one block's scale reads as one scale ([1, 1]); one group a row is one per token
    if (act_granularity == "group") != (granularity == "block") or act_granularity not in ACT_GRANULARITIES:
        raise ValueError(
            f"dynamic_w8a8_gemm: activations per {act_granularity} do not go with per-{granularity} weights"
        )
    tiles = tiles or launch_tiles(gemm_kind("w8a8", granularity), m, n, k, x.device)
    if m > DYNAMIC_QUANT_MAX_M or (act_granularity == "tensor" and m > tiles.block_m):
        xq, x_scale = quantize_activation(x, act_granularity)
        return w8a8_gemm(xq, x_scale, weight, weight_scale, x.dtype, bias, tiles)
    x_cols = {"group": triton.cdiv(k, GROUP_SIZE), "token": 1, "tensor": 0}[act_granularity]
    x_bits = as_kernel_input(x)[0]  # read as x and, unused by the kernel, as its scales
    return _w8a8((x_bits, x_bits), x_cols, True, weight, weight_scale, granularity, x.dtype, bias, tiles)


def _w8a8(x_operands, x_cols, x_quant, weight, weight_scale, granularity, out_dtype, bias, tiles) -> torch.Tensor:
    """Launch ``_w8a8_gemm_kernel`` with ``tiles``: ``x_operands`` (xq bytes, x scales) or, with ``x_quant``,
    (x's bits, x's bits)."""
    x = x_operands[0]
    (m, k), n = x.shape, weight.shape[0]
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w8a8_gemm: out_dtype must be bf16 or fp16, got {out_dtype}")
    if x.device.type == "cuda" and not fp8_native(x.device):
        raise RuntimeError("w8a8_gemm needs FP8 tensor cores (sm_89+); use w8a16_gemm")
    out = _empty((m, n), out_dtype, x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    weight_scale = weight_scale.to(torch.float32).contiguous()
    w_cols = weight_scale.shape[1] if granularity == "block" else GRANULARITY_CODES[granularity]  # per tensor: stride 0
    bias_bits = as_kernel_input(bias.contiguous())[0] if bias is not None else None
    out_bits = as_kernel_input(out)[0]
    if granularity == "block":
        tiles = _fit_block(tiles)
    _run(
        _w8a8_gemm_kernel, x.device, m, n, k, tiles,
        (*x_operands, weight.view(torch.uint8), weight_scale, bias_bits if bias is not None else out_bits, out_bits),
        (x_cols, w_cols), (weight_scale, bias_bits, out, GRANULARITY_CODES["block"]),
        OUT_BF16=out_dtype == torch.bfloat16, HAS_BIAS=bias is not None, SCALE_MODE=GRANULARITY_CODES[granularity],
        FP8_NATIVE=x.device.type == "cuda", X_QUANT=x_quant,
    )  # fmt: skip
    return out


__all__ = [
    "W8A16_TILES_CUDA",
    "W8A8_TILES_CUDA",
    "GemmTiles",
    "dynamic_w8a8_gemm",
    "gemm_kind",
    "gemm_tiles",
    "k_span",
    "launch_tiles",
    "tuned_tiles",
    "w8a16_gemm",
    "w8a8_gemm",
]
