"""Triton GEMMs over FP8 (e4m3fn) weights that never materialize a dequantized weight.

Both compute y[M, N] = x[M, K] @ W[N, K]^T (+ bias) with a float32 accumulator, reading the
FP8 weight bytes and their float32 scales inside the K loop:

* :func:`w8a16_gemm` (weight-only): x in bf16/fp16, W's scale per tensor ([1]), per output channel
  ([N, 1]) or per 128 x 128 block ([ceil(N/128), ceil(K/128)]). Each weight tile is decoded to
  x's dtype (exact: every e4m3 value is a bf16 and an fp16 value) and multiplied by tensor cores;
  per-tensor / per-channel scales multiply the accumulator once at the end, per-block scales each
  K block's partial product (BLOCK_K = 128 then). For GPUs without FP8 tensor cores (sm_80) the
  bytes are decoded with integer ops (``triton_common.e4m3_value``); sm_89+ convert in hardware.
* :func:`w8a8_block_gemm` (DeepSeek-V3's block-scaled FP8 GEMM, as vLLM's w8a8_block_fp8_matmul):
  x quantized per token group of 128 (``kernels.fp8_act``, scales [M, ceil(K/128)]), W per 128 x 128
  block; each K step of 128 is one FP8 ``tl.dot`` (sm_89+) whose float32 result is multiplied by
  the token-group scales (rows) and the block scales (columns) before it joins the accumulator:
  acc += dot(xq, wq^T) * xs[:, k] * ws[n // 128, k].

Tiling (``gemm_tiles``): decode batches (M <= 16) are memory-bound on the weight bytes, so one
program covers 16 rows of x and only BLOCK_N = 16 output columns and streams K in steps of 256
(128 for per-block): a Llama-3-8B projection (N >= 4096) then runs >= 256 programs, about two per
SM of an H100, each with num_stages = 4 tiles in flight. Larger M gets wider tiles (vLLM's
defaults for the block GEMM: 64 x 128 x 128, 4 warps, 3 stages). The tables are constants to tune
on a GPU; the choice of path per M is the caller's (``quant.fp8``).

The interpreter (CPU, tests) decodes with integer ops and multiplies in float32 with IEEE
products (``DOT_DTYPE``); bf16 output is rounded half to even by hand, as in ``fp8_tiles``.
"""

from __future__ import annotations

import functools

import torch

from layerwise.kernels.fp8_act import GROUP_SIZE
from layerwise.kernels.fp8_tiles import SCALE_MODES
from layerwise.kernels.reference import BLOCK_SIZE, FP8_DTYPE, scale_layout
from layerwise.kernels.triton_common import (
    HAS_TRITON,
    as_kernel_input,
    e4m3_value,
    helper,
    launch,
    load_f32,
    tl,
    triton,
)

# (max M, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), first row whose max M >= M wins.
# W8A16, per-tensor / per-channel weights (BLOCK_K for per-block is forced to 128).
W8A16_TILES_CUDA = (
    (16, 16, 16, 256, 4, 4),
    (32, 32, 32, 128, 4, 4),
    (64, 64, 32, 128, 4, 4),
    (None, 64, 64, 128, 4, 3),
)
# block-scaled W8A8 (BLOCK_K is the 128 of the block)
W8A8_BLOCK_TILES_CUDA = (
    (16, 16, 16, 128, 4, 4),
    (32, 32, 32, 128, 4, 4),
    (64, 64, 64, 128, 4, 3),
    (None, 64, 128, 128, 4, 3),
)
TILES_INTERPRET = (None, 16, 32, 128, 1, 1)  # the interpreter pays per program: few, mid-sized tiles


def gemm_tiles(m: int, device: torch.device, kind: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for ``m`` rows of x; kind "w8a16" or "block"."""
    if device.type == "cpu":
        return TILES_INTERPRET[1:]
    table = W8A16_TILES_CUDA if kind == "w8a16" else W8A8_BLOCK_TILES_CUDA
    for row in table:
        if row[0] is None or m <= row[0]:
            return row[1:]
    raise AssertionError("unreachable: the last row takes any M")


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
    """(rows int64 [BLOCK_M], cols int64 [BLOCK_N]) of this program's output tile; programs run over
    the tiles of [m, n] with the column tile fastest, on grid axis 0."""
    pid = tl.program_id(0)
    n_tiles = (n + BLOCK_N - 1) // BLOCK_N
    rm = (pid // n_tiles).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (pid % n_tiles).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rm, rn


def _w8a16_gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    scale_cols,
    IS_BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE_MODE: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # DOT_DTYPE: x's dtype on CUDA (tensor cores); float32 with IEEE products in the interpreter
    rm, rn = program_tile(m, n, BLOCK_M, BLOCK_N)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, k, BLOCK_K):
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
    if SCALE_MODE == 0:
        acc = acc * tl.load(scale_ptr)
    elif SCALE_MODE == 1:
        acc = acc * tl.load(scale_ptr + rn, mask=rn < n, other=0.0)[None, :]
    mask = (rm[:, None] < m) & (rn[None, :] < n)
    if HAS_BIAS:
        acc = acc + load_f32(bias_ptr + rn, rn < n, IS_BF16)[None, :]
    store_out(out_ptr, rm[:, None] * n + rn[None, :], acc, mask, IS_BF16)


def _w8a8_block_gemm_kernel(
    xq_ptr,
    x_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    out_ptr,
    m,
    n,
    k,
    x_scale_cols,
    w_scale_cols,
    OUT_BF16: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8_NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm, rn = program_tile(m, n, BLOCK_M, BLOCK_N)
    acc = tl.full([BLOCK_M, BLOCK_N], 0.0, tl.float32)
    for k0 in range(0, k, BLOCK_K):  # BLOCK_K == 128: one token group and one weight block column
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(xq_ptr + (rm[:, None] * k + rk[None, :]), mask=(rm[:, None] < m) & (rk[None, :] < k), other=0)
        b = tl.load(w_ptr + (rn[None, :] * k + rk[:, None]), mask=(rk[:, None] < k) & (rn[None, :] < n), other=0)
        if FP8_NATIVE:  # e4m3 tensor cores (sm_89+)
            part = tl.dot(a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True), out_dtype=tl.float32)
        else:
            a32 = e4m3_value(a.to(tl.int32))
            b32 = e4m3_value(b.to(tl.int32))
            part = tl.dot(a32, b32, input_precision="ieee", out_dtype=tl.float32)
        xs = tl.load(x_scale_ptr + (rm * x_scale_cols + k0 // BLOCK_K), mask=rm < m, other=0.0)
        ws = tl.load(w_scale_ptr + ((rn // 128) * w_scale_cols + k0 // 128), mask=rn < n, other=0.0)
        acc += part * xs[:, None] * ws[None, :]
    mask = (rm[:, None] < m) & (rn[None, :] < n)
    if HAS_BIAS:
        acc = acc + load_f32(bias_ptr + rn, rn < n, OUT_BF16)[None, :]
    store_out(out_ptr, rm[:, None] * n + rn[None, :], acc, mask, OUT_BF16)


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


def _run(fn, device, m, n, tiles, args, **constexprs) -> None:
    block_m, block_n, block_k, num_warps, num_stages = tiles
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    if device.type != "cpu":
        constexprs.update(num_warps=num_warps, num_stages=num_stages)
    launch(fn, device, grid, *args, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **constexprs)


def w8a16_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """y = x @ (float32(weight) * scale)^T + bias, without a dequantized copy of the weight.

    Args:
        x: contiguous bf16/fp16 [M, K] on cuda (compiled) or cpu (interpreted).
        weight: contiguous float8_e4m3fn [N, K] on x's device.
        scale: float32 on x's device: 1 element (per tensor), [N, 1] (per channel) or
            [ceil(N/128), ceil(K/128)] (per block).
        bias: optional [N] in x's dtype.
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
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    tiles = gemm_tiles(m, x.device, "w8a16")
    if granularity == "block":  # one block column per K step, one block row per column tile
        tiles = (tiles[0], min(tiles[1], BLOCK_SIZE[0]), BLOCK_SIZE[1], *tiles[3:])
    scale = scale.to(torch.float32).contiguous()
    x_bits, is_bf16 = as_kernel_input(x)
    bias_bits = as_kernel_input(bias.contiguous())[0] if bias is not None else x
    args = (
        x_bits, weight.view(torch.uint8), scale, bias_bits,
        as_kernel_input(out)[0], m, n, k, scale.shape[-1] if granularity == "block" else 1,
    )  # fmt: skip
    native = fp8_native(x.device)
    _run(
        _w8a16_gemm_kernel, x.device, m, n, tiles, args,
        IS_BF16=is_bf16, HAS_BIAS=bias is not None, SCALE_MODE=SCALE_MODES[granularity],
        FP8_NATIVE=native, DOT_DTYPE=dot_dtype(x.dtype, x.device),
    )  # fmt: skip
    return out


def w8a8_block_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = (xq * x_scale) @ (weight * weight_scale)^T + bias, block-scaled FP8 (DeepSeek-V3 scheme).

    Args:
        xq: contiguous float8_e4m3fn [M, K] (``kernels.fp8_act.quantize_activation(x, "group")``).
        x_scale: float32 [M, ceil(K/128)], one scale per row and 128 columns.
        weight: contiguous float8_e4m3fn [N, K].
        weight_scale: float32 [ceil(N/128), ceil(K/128)] (``weight_scale_inv``).
        out_dtype: bf16 or fp16.
        bias: optional [N] in out_dtype.
    Returns:
        [M, N] in out_dtype, float32 accumulation.
    Raises:
        RuntimeError: a CUDA device below sm_89 (no e4m3 tensor cores; use :func:`w8a16_gemm`).
        TypeError / ValueError: dtypes or shapes the kernel does not take.
    """
    _check_gemm_inputs(xq, weight, "w8a8_block_gemm")
    (m, k), n = xq.shape, weight.shape[0]
    groups = triton.cdiv(k, GROUP_SIZE)
    if xq.dtype != FP8_DTYPE or not xq.is_contiguous() or tuple(x_scale.shape) != (m, groups):
        raise TypeError(f"w8a8_block_gemm: xq must be contiguous {FP8_DTYPE} with x_scale [{m}, {groups}]")
    if tuple(weight_scale.shape) != (triton.cdiv(n, BLOCK_SIZE[0]), triton.cdiv(k, BLOCK_SIZE[1])):
        raise ValueError(f"w8a8_block_gemm: weight_scale of shape {tuple(weight_scale.shape)} is not per 128 x 128")
    if out_dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"w8a8_block_gemm: out_dtype must be bf16 or fp16, got {out_dtype}")
    if xq.device.type == "cuda" and not fp8_native(xq.device):
        raise RuntimeError("w8a8_block_gemm needs FP8 tensor cores (sm_89+); use w8a16_gemm")
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_() if bias is None else out.copy_(bias.expand(m, n))
    args = (
        xq.view(torch.uint8), x_scale.to(torch.float32).contiguous(), weight.view(torch.uint8),
        weight_scale.to(torch.float32).contiguous(), as_kernel_input(bias.contiguous())[0] if bias is not None else out,
        as_kernel_input(out)[0], m, n, k, groups, weight_scale.shape[1],
    )  # fmt: skip
    _run(
        _w8a8_block_gemm_kernel, xq.device, m, n, gemm_tiles(m, xq.device, "block"), args,
        OUT_BF16=out_dtype == torch.bfloat16, HAS_BIAS=bias is not None, FP8_NATIVE=xq.device.type == "cuda",
    )  # fmt: skip
    return out


__all__ = ["W8A16_TILES_CUDA", "W8A8_BLOCK_TILES_CUDA", "gemm_tiles", "w8a16_gemm", "w8a8_block_gemm"]
