"""Every Triton kernel variant the library launches on a GPU, for ahead-of-time compile checks.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32))`` builds a
cubin without a GPU (Triton ships ptxas), so CPU-only CI proves that each variant compiles for each
compute capability (tests/test_kernels_compile.py). The variants are derived from the same
constants the launch wrappers in ``kernels.fp8_tiles`` use: input/output dtypes, scale modes,
per-row or per-tile amax, CUDA tile sizes and the 128 x 128 block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from layerwise.kernels.fp8_act import (
    ACT_TILE_CUDA,
    GROUP_ROWS_CUDA,
    GROUP_SIZE,
    MAX_PARTIALS,
    _act_amax_kernel,
    _act_quant_group_kernel,
    _act_quant_tensor_kernel,
    _act_quant_token_kernel,
)
from layerwise.kernels.fp8_gemm import SCALE_MODES as GEMM_SCALE_MODES
from layerwise.kernels.fp8_gemm import (
    W8A8_BLOCK_TILES_CUDA,
    W8A16_TILES_CUDA,
    _w8a8_block_gemm_kernel,
    _w8a16_gemm_kernel,
    dot_dtype,
)
from layerwise.kernels.fp8_tiles import SCALE_MODES, _amax_kernel, _dequantize_kernel, _quantize_kernel
from layerwise.kernels.reference import BLOCK_SIZE
from layerwise.kernels.triton_common import TILE_CUDA

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# pointer type a tensor of each dtype is passed as (bf16 travels as int16 bits: see triton_common)
POINTER_TYPES = {torch.bfloat16: "*i16", torch.float16: "*fp16", torch.float32: "*fp32"}
# activation dtypes the fused W8A8 forward launches with (quant.fp8.fused_forward)
ACT_DTYPES = (torch.bfloat16, torch.float16)
# compute capabilities checked: A100 (no e4m3 hardware type), L40S/RTX 4090, H100/H200
CUDA_TARGETS = (80, 89, 90)


@dataclass(frozen=True)
class KernelVariant:
    """One specialization of a kernel: its Python function, argument types and constexprs.

    Attributes:
        name: readable id, e.g. "quantize[bfloat16,channel,i32]".
        fn: the undecorated kernel function (wrap with ``triton.jit`` to compile).
        signature: argument name -> Triton type ("*fp32", "i32", "constexpr").
        constexprs: constexpr argument name -> value.
        targets: the compute capabilities it is launched on (FP8 tensor-core variants: sm_89+ only).
    """

    name: str
    fn: Callable
    signature: dict
    constexprs: dict
    targets: tuple = (80, 89, 90)  # compute capabilities the wrappers launch it on


def _signature(fn: Callable, types: dict, constexprs: dict) -> dict:
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return {n: "constexpr" if n in constexprs else types[n] for n in names}


def cuda_variants(index_type: str = "i32") -> Iterator[KernelVariant]:
    """Every (kernel, dtype, scale layout, tile) the wrappers launch on CUDA.

    Args:
        index_type: Triton type of the size arguments: "i32", or "i64" (what Triton picks for a
            size of 2^31 or more).
    """
    sizes = {"n_rows": index_type, "n_cols": index_type, "scale_cols": index_type}
    for dtype in DTYPES:
        for granularity in ("tensor", "channel", "block"):
            tile_n, tile_k = BLOCK_SIZE if granularity == "block" else TILE_CUDA
            const = dict(
                IS_BF16=dtype == torch.bfloat16, PER_ROW=granularity == "channel", TILE_N=tile_n, TILE_K=tile_k
            )
            types = dict(sizes, x_ptr=POINTER_TYPES[dtype], out_ptr="*fp32")
            yield KernelVariant(
                f"amax[{str(dtype)[6:]},{granularity},{index_type}]",
                _amax_kernel,
                _signature(_amax_kernel, types, const),
                const,
            )
        for granularity, mode in SCALE_MODES.items():
            common = dict(
                SCALE_MODE=mode, BLOCK_N=BLOCK_SIZE[0], BLOCK_K=BLOCK_SIZE[1], TILE_N=TILE_CUDA[0], TILE_K=TILE_CUDA[1]
            )
            const = dict(common, IS_BF16=dtype == torch.bfloat16)
            types = dict(sizes, x_ptr=POINTER_TYPES[dtype], out_ptr="*u8", scale_ptr="*fp32")
            yield KernelVariant(
                f"quantize[{str(dtype)[6:]},{granularity},{index_type}]",
                _quantize_kernel,
                _signature(_quantize_kernel, types, const),
                const,
            )
            const = dict(common, OUT_BF16=dtype == torch.bfloat16)
            types = dict(sizes, q_ptr="*u8", out_ptr=POINTER_TYPES[dtype], scale_ptr="*fp32")
            yield KernelVariant(
                f"dequantize[{str(dtype)[6:]},{granularity},{index_type}]",
                _dequantize_kernel,
                _signature(_dequantize_kernel, types, const),
                const,
            )


def activation_variants(index_type: str = "i32") -> Iterator[KernelVariant]:
    """Every (kernel, dtype) of the fused activation quantization (``kernels.fp8_act``) on CUDA."""
    rows, tile_k = ACT_TILE_CUDA
    for dtype in ACT_DTYPES:
        name = str(dtype)[6:]
        common = dict(x_ptr=POINTER_TYPES[dtype], q_ptr="*u8", scale_ptr="*fp32", partial_ptr="*fp32")
        common.update(n_rows=index_type, n_cols=index_type, n_groups=index_type, n_partials=index_type)
        is_bf16 = dtype == torch.bfloat16
        for fn, const in (
            (_act_quant_token_kernel, dict(IS_BF16=is_bf16, ROWS=rows, TILE_K=tile_k)),
            (_act_quant_group_kernel, dict(IS_BF16=is_bf16, ROWS=GROUP_ROWS_CUDA, GROUP=GROUP_SIZE)),
            (_act_amax_kernel, dict(IS_BF16=is_bf16, ROWS=rows, TILE_K=tile_k)),
            (_act_quant_tensor_kernel, dict(IS_BF16=is_bf16, ROWS=rows, TILE_K=tile_k, PARTIALS=MAX_PARTIALS)),
        ):
            kernel = fn.__name__.strip("_").removesuffix("_kernel")
            yield KernelVariant(f"{kernel}[{name},{index_type}]", fn, _signature(fn, common, const), const)


def gemm_variants() -> Iterator[KernelVariant]:
    """The FP8 GEMM specializations the CUDA forward launches (``kernels.fp8_gemm``), for AOT compiles.

    W8A16 decodes e4m3 with integer ops on sm_80 and in hardware on sm_89+; the block-scaled W8A8 GEMM
    (FP8 tensor cores) runs on sm_89+. To keep CPU CI under a minute, the full matrix is built for
    bf16 (the checkpoints' dtype) and the decode tile (the first row of each table: int64 sizes and a
    bias too); fp16 and the larger tiles only where the code differs: fp16 for the decode tile, the larger
    tiles with int32 sizes, no bias, per-channel and per-block epilogues. FP8 variants build for sm_89 and
    sm_90 in the decode tile with int32 sizes, for sm_90 only otherwise.
    """
    cuda = torch.device("cuda")
    for dtype in ACT_DTYPES:
        name, ptr, is_bf16 = str(dtype)[6:], POINTER_TYPES[dtype], dtype == torch.bfloat16
        for t, (_, block_m, block_n, block_k, _, _) in enumerate(W8A16_TILES_CUDA):
            if t and not is_bf16:
                continue
            for granularity, mode in GEMM_SCALE_MODES.items():
                if t and granularity == "tensor":  # larger tiles: the per-tensor epilogue is the decode tile's
                    continue
                if granularity == "block":
                    block_n, block_k = min(block_n, BLOCK_SIZE[0]), BLOCK_SIZE[1]
                for index_type, has_bias in _gemm_sizes(t == 0 and is_bf16):
                    types = dict(x_ptr=ptr, w_ptr="*u8", scale_ptr="*fp32", bias_ptr=ptr, out_ptr=ptr)
                    types.update(m=index_type, n=index_type, k=index_type, scale_cols=index_type)
                    for native, targets in (
                        (False, (80,)),
                        (True, (89, 90) if t == 0 and index_type == "i32" else (90,)),
                    ):
                        const = dict(
                            IS_BF16=is_bf16, HAS_BIAS=has_bias, SCALE_MODE=mode, FP8_NATIVE=native,
                            DOT_DTYPE=dot_dtype(dtype, cuda), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                        )  # fmt: skip
                        yield KernelVariant(
                            f"w8a16_gemm[{name},{granularity},{block_m}x{block_n}x{block_k},{index_type},"
                            f"{'bias' if has_bias else 'nobias'},{'native' if native else 'int'}]",
                            _w8a16_gemm_kernel,
                            _signature(_w8a16_gemm_kernel, types, const),
                            const,
                            targets,
                        )
        for t, (_, block_m, block_n, block_k, _, _) in enumerate(W8A8_BLOCK_TILES_CUDA):
            if t and not is_bf16:
                continue
            for index_type, has_bias in _gemm_sizes(t == 0 and is_bf16):
                types = dict(xq_ptr="*u8", x_scale_ptr="*fp32", w_ptr="*u8", w_scale_ptr="*fp32")
                types.update(bias_ptr=ptr, out_ptr=ptr, m=index_type, n=index_type, k=index_type)
                types.update(x_scale_cols=index_type, w_scale_cols=index_type)
                const = dict(
                    OUT_BF16=is_bf16, HAS_BIAS=has_bias, FP8_NATIVE=True, BLOCK_M=block_m, BLOCK_N=block_n,
                    BLOCK_K=block_k,
                )  # fmt: skip
                yield KernelVariant(
                    f"w8a8_block_gemm[{name},{block_m}x{block_n}x{block_k},{index_type},"
                    f"{'bias' if has_bias else 'nobias'}]",
                    _w8a8_block_gemm_kernel,
                    _signature(_w8a8_block_gemm_kernel, types, const),
                    const,
                    (89, 90) if t == 0 and index_type == "i32" else (90,),
                )


def _gemm_sizes(full: bool) -> tuple:
    """(index type, has bias) pairs built for a GEMM tile: both widths and a bias where ``full``."""
    return (("i32", True), ("i64", False)) if full else (("i32", False),)
