"""Fused dynamic FP8 quantization of activations (Triton): amax, scale and e4m3 cast in one pass.

The W8A8 forward quantizes its input x [M, K] at every step. In torch that is about ten small
kernels per linear (amax reduction, division, clamp, copies, cast), which at decode batch sizes
cost more than the FP8 GEMM saves (issue 14). Here it is one launch per linear (two for one
scale over the whole tensor), with no host synchronization, so a CUDA graph can capture it:

* per token (``"token"``): one scale per row of x, scales [M, 1] (``torch._scaled_mm`` row-wise);
* per token group (``"group"``): one scale per row and 128 columns, scales [M, ceil(K / 128)]
  (the activation side of the DeepSeek-V3 block-scaled GEMM, vLLM's per_token_group_quant_fp8);
* per tensor (``"tensor"``): one scale, shape [1]. Launch 1 writes one amax partial per program
  (at most ``MAX_PARTIALS`` programs, each striding over rows); launch 2 reduces the partials in
  every program (a masked load of ``MAX_PARTIALS`` floats) and quantizes, so no buffer needs zeroing.

Arithmetic, identical to ``kernels.reference.activation_scale`` + ``kernels.reference.quantize``:

    amax  = max |x| over the group (float32; exact)
    scale = max(amax / 448, float32 tiny)      IEEE division (tl.div_rn)
    q     = e4m3fn(clamp(float32(x) / scale, -448, 448))    IEEE division, round half to even

so an all-zero group gets the tiny scale and quantizes to zeros. Finite inputs give the reference's
bytes and scales bit for bit. Non-finite inputs: a group holding Inf or NaN gets scale +Inf (the
reference: +Inf, or NaN for NaN), its NaN elements quantize to the e4m3 NaN byte 0x7F and the GEMM
output of that row is NaN in both; the finite bytes of such a group may differ (0 here).
e4m3 crosses the kernel boundary as uint8 bits (``kernels.triton_common.e4m3_bits``), so the
kernels build for sm_80 and run under the interpreter on CPU.
"""

from __future__ import annotations

import torch

from layerwise.kernels.reference import BLOCK_SIZE, FP8_DTYPE
from layerwise.kernels.triton_common import (
    abs_nan_to_inf,
    as_kernel_input,
    check_input,
    e4m3_bits,
    helper,
    launch,
    load_f32,
    max_all,
    tl,
    triton,
)

GROUP_SIZE = BLOCK_SIZE[1]  # columns per scale of the "group" layout: the 128 x 128 weight block's width
ACT_GRANULARITIES = ("tensor", "token", "group")
MAX_PARTIALS = 1024  # most programs of the per-tensor amax launch (a power of two)
# One program's tile for per-token / per-tensor programs: (rows, columns); programs loop over the columns in
# steps of the tile width. On CUDA a program takes one row, and the whole row in one step (the tile is the
# next power of two >= K, at most ACT_MAX_TILE_K): at decode (M = 8) a loop of K / 1024 dependent loads per
# pass waits on memory K / 1024 times in a row; one wide load waits once. The number of
# warps grows with the tile (ACT_WARPS). The interpreter pays per program, so it takes many rows.
ACT_ROWS_CUDA = 1
ACT_MAX_TILE_K = 16384
ACT_WARPS = ((2048, 4), (8192, 8), (ACT_MAX_TILE_K, 16))  # (tile width up to, num_warps)
ACT_TILE_INTERPRET = (16, 512)
GROUP_ROWS_CUDA = 8
GROUP_ROWS_INTERPRET = 32
FLOAT32_TINY = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny


def act_tile(device: torch.device, n_cols: int = 1) -> tuple[int, int, int]:
    """(rows, columns, num_warps) of a per-token / per-tensor program's tile for K = ``n_cols``."""
    if device.type == "cpu":
        return (*ACT_TILE_INTERPRET, 1)
    tile_k = min(max(triton.next_power_of_2(n_cols), 128), ACT_MAX_TILE_K)
    return ACT_ROWS_CUDA, tile_k, next(w for limit, w in ACT_WARPS if tile_k <= limit)


def group_rows(device: torch.device) -> int:
    """Rows of a per-group program on ``device``."""
    return GROUP_ROWS_INTERPRET if device.type == "cpu" else GROUP_ROWS_CUDA


@helper
def scale_of(amax):
    """max(amax / 448, tiny), IEEE division (amax float32, any shape)."""
    return tl.maximum(tl.div_rn(amax, 448.0), 1.1754943508222875e-38)  # FLOAT32_TINY


@helper
def quantize_bits(x, scale):
    """uint8 e4m3 bytes of clamp(x / scale, -448, 448) (IEEE division); NaN gives 0x7F."""
    y = tl.div_rn(x, scale)
    is_nan = y != y  # before the clamp: min/max may drop a NaN operand (fminf, fmaxf)
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return tl.where(is_nan, 0x7F, e4m3_bits(y)).to(tl.uint8)


def _act_quant_token_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    IS_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    TILE_K: tl.constexpr,
):
    # rows [pid * ROWS, +ROWS): pass 1 amax over the columns, pass 2 quantize (x read twice; L2-resident)
    rows = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    row_ok = rows < n_rows
    amax = tl.full([ROWS], 0.0, tl.float32)
    for k0 in range(0, n_cols, TILE_K):
        cols = (k0 + tl.arange(0, TILE_K))[None, :]
        mask = row_ok & (cols < n_cols)
        a = abs_nan_to_inf(load_f32(x_ptr + (rows * n_cols + cols), mask, IS_BF16))
        amax = tl.maximum(amax, max_all(a, 1))
    scale = scale_of(amax)
    tl.store(scale_ptr + rows, scale[:, None], mask=row_ok)
    for k0 in range(0, n_cols, TILE_K):
        cols = (k0 + tl.arange(0, TILE_K))[None, :]
        mask = row_ok & (cols < n_cols)
        x = load_f32(x_ptr + (rows * n_cols + cols), mask, IS_BF16)
        tl.store(q_ptr + (rows * n_cols + cols), quantize_bits(x, scale[:, None]), mask=mask)


def _act_quant_group_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    n_groups,
    IS_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    GROUP: tl.constexpr,
):
    # program = (row tile, group): one GROUP-column slice of ROWS rows, scales [n_rows, n_groups]
    pid = tl.program_id(0)
    group = (pid % n_groups).to(tl.int64)
    rows = ((pid // n_groups).to(tl.int64) * ROWS + tl.arange(0, ROWS))[:, None]
    cols = (group * GROUP + tl.arange(0, GROUP))[None, :]
    mask = (rows < n_rows) & (cols < n_cols)
    x = load_f32(x_ptr + (rows * n_cols + cols), mask, IS_BF16)
    scale = scale_of(max_all(abs_nan_to_inf(x), 1))
    tl.store(scale_ptr + (rows * n_groups + group), scale[:, None], mask=rows < n_rows)
    tl.store(q_ptr + (rows * n_cols + cols), quantize_bits(x, scale[:, None]), mask=mask)


def _act_amax_kernel(
    x_ptr,
    partial_ptr,
    n_rows,
    n_cols,
    IS_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    TILE_K: tl.constexpr,
):
    # program p: rows p*ROWS, (p + P)*ROWS, ... (P programs); partial[p] = their max |x|
    pid = tl.program_id(0)
    amax = tl.full([ROWS], 0.0, tl.float32)
    for r0 in range(pid * ROWS, n_rows, ROWS * tl.num_programs(0)):
        rows = (r0 + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        for k0 in range(0, n_cols, TILE_K):
            cols = (k0 + tl.arange(0, TILE_K))[None, :]
            mask = (rows < n_rows) & (cols < n_cols)
            a = abs_nan_to_inf(load_f32(x_ptr + (rows * n_cols + cols), mask, IS_BF16))
            amax = tl.maximum(amax, max_all(a, 1))
    tl.store(partial_ptr + pid, max_all(amax, 0))


def _act_quant_tensor_kernel(
    x_ptr,
    q_ptr,
    partial_ptr,
    scale_ptr,
    n_rows,
    n_cols,
    n_partials,
    IS_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    TILE_K: tl.constexpr,
    PARTIALS: tl.constexpr,
):
    # every program reduces the partials (PARTIALS floats, L2-resident) to the one scale
    pid = tl.program_id(0)
    idx = tl.arange(0, PARTIALS).to(tl.int64)
    scale = scale_of(max_all(tl.load(partial_ptr + idx, mask=idx < n_partials, other=0.0), 0))
    tl.store(scale_ptr, scale, mask=pid == 0)
    for r0 in range(pid * ROWS, n_rows, ROWS * tl.num_programs(0)):
        rows = (r0 + tl.arange(0, ROWS)).to(tl.int64)[:, None]
        for k0 in range(0, n_cols, TILE_K):
            cols = (k0 + tl.arange(0, TILE_K))[None, :]
            mask = (rows < n_rows) & (cols < n_cols)
            x = load_f32(x_ptr + (rows * n_cols + cols), mask, IS_BF16)
            tl.store(q_ptr + (rows * n_cols + cols), quantize_bits(x, scale), mask=mask)


def quantize_activation(x: torch.Tensor, granularity: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic FP8 quantization of activations x [M, K] in one pass (two launches per tensor).

    Args:
        x: contiguous 2-D bf16/fp16/fp32 tensor [M, K] on cuda (compiled) or cpu (interpreted).
        granularity: "token" (scales [M, 1]), "group" (scales [M, ceil(K / 128)]) or "tensor"
            (scale [1]).
    Returns:
        (q, scale): float8_e4m3fn [M, K] and float32 scales; equal bit for bit to
        ``kernels.reference.quantize(x, scale)`` with scale = max(amax / 448, tiny) per group, for
        finite x (see the module docstring for NaN / Inf).
    Raises:
        ValueError / TypeError: unknown granularity, or x not a contiguous 2-D float tensor.
    No host synchronization: safe to capture in a CUDA graph.
    """
    if granularity not in ACT_GRANULARITIES:
        raise ValueError(f"unknown activation granularity {granularity!r}; choose one of {ACT_GRANULARITIES}")
    check_input(x, "quantize_activation", ndim=2)
    m, k = x.shape
    n_groups = triton.cdiv(k, GROUP_SIZE)
    scale_shape = {"token": (m, 1), "group": (m, n_groups), "tensor": (1,)}[granularity]
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if m == 0 or k == 0:
        fill = FLOAT32_TINY if k == 0 else 0.0
        return q, torch.full(scale_shape, fill, dtype=torch.float32, device=x.device)
    scale = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    src, is_bf16 = as_kernel_input(x)
    bits = q.view(torch.uint8)
    if granularity == "group":
        rows = group_rows(x.device)
        grid = (triton.cdiv(m, rows) * n_groups,)
        launch(
            _act_quant_group_kernel, x.device, grid, src, bits, scale, m, k, n_groups,
            IS_BF16=is_bf16, ROWS=rows, GROUP=GROUP_SIZE,
        )  # fmt: skip
        return q, scale
    rows, tile_k, num_warps = act_tile(x.device, k)
    meta = dict(IS_BF16=is_bf16, ROWS=rows, TILE_K=tile_k)
    if x.device.type != "cpu":
        meta["num_warps"] = num_warps
    if granularity == "token":
        launch(_act_quant_token_kernel, x.device, (triton.cdiv(m, rows),), src, bits, scale, m, k, **meta)
        return q, scale
    programs = min(triton.cdiv(m, rows), MAX_PARTIALS)
    partial = torch.empty(programs, dtype=torch.float32, device=x.device)
    launch(_act_amax_kernel, x.device, (programs,), src, partial, m, k, **meta)
    launch(
        _act_quant_tensor_kernel, x.device, (programs,), src, bits, partial, scale, m, k, programs,
        PARTIALS=MAX_PARTIALS, **meta,
    )  # fmt: skip
    return q, scale


__all__ = ["ACT_GRANULARITIES", "GROUP_SIZE", "MAX_PARTIALS", "quantize_activation"]
