"""Every Triton kernel variant the library launches on a GPU, for ahead-of-time compile checks.

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", cc, 32))`` builds a
cubin without a GPU (Triton ships ptxas), so CPU-only CI proves that each variant compiles for each
compute capability (tests/test_kernels_compile.py). The variants are derived from the same
constants the launch wrappers in ``kernels.fp8_tiles`` use: input/output dtypes, scale modes,
per-row or per-tile amax, CUDA tile sizes and the 128 x 128 block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from layerwise.kernels.fp8_act import (
    ACT_MAX_TILE_K,
    GROUP_ROWS_CUDA,
    GROUP_SIZE,
    MAX_PARTIALS,
    _act_amax_kernel,
    _act_quant_group_kernel,
    _act_quant_tensor_kernel,
    _act_quant_token_kernel,
    act_tile,
)
from layerwise.kernels.fp8_gemm import (
    REDUCE_BLOCK,
    W8A8_TILES_CUDA,
    W8A16_TILES_CUDA,
    _split_k_reduce_kernel,
    _w8a8_gemm_kernel,
    _w8a16_gemm_kernel,
    dot_dtype,
)
from layerwise.kernels.fp8_tiles import _amax_kernel, _dequantize_kernel, _quantize_kernel
from layerwise.kernels.reference import ACT_GRANULARITY, BLOCK_SIZE, GRANULARITY_CODES
from layerwise.kernels.triton_common import TILE_CUDA

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# pointer type a tensor of each dtype is passed as (bf16 travels as int16 bits: see triton_common)
POINTER_TYPES = {torch.bfloat16: "*i16", torch.float16: "*fp16", torch.float32: "*fp32"}
# activation dtypes the fused W8A8 forward launches with (quant.fp8.fused_forward)
ACT_DTYPES = (torch.bfloat16, torch.float16)
# the activation kernels hold no architecture-specific code (e4m3 as integer bits): the oldest and the
# newest target suffice
ACT_TARGETS = (80, 90)
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
        options: the launch options the wrapper passes (num_warps, num_stages), compiled with.
        aligned: arguments known to be multiples of 16 (pointers: 16-byte aligned), as Triton specializes
            them at launch for typical shapes; with them the GEMMs' loads are vectorized and pipelined
            through shared memory (cp.async), so the compile shows the real shared-memory use.
    """

    name: str
    fn: Callable
    signature: dict
    constexprs: dict
    targets: tuple = CUDA_TARGETS
    options: dict = field(default_factory=dict)  # launch options: num_warps, num_stages
    aligned: tuple = ()  # arguments compiled as multiples of 16 (Triton's runtime specialization)


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
        for granularity, mode in GRANULARITY_CODES.items():
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
    """The fused activation quantization kernels (``kernels.fp8_act``) the CUDA forward launches.

    The per-token and per-tensor kernels' row tile is the next power of two of K with its warp count:
    bf16 with int32 sizes is built at the narrowest, a middle and the widest tile (K <= 128, 4096,
    > 8192); fp16 and int64 sizes at the widest only (the code differs by the load, and by the index
    width, not by the tile), to keep CPU CI short.
    """
    cuda = torch.device("cuda")
    for dtype in ACT_DTYPES:
        name = str(dtype)[6:]
        common = dict(x_ptr=POINTER_TYPES[dtype], q_ptr="*u8", scale_ptr="*fp32", partial_ptr="*fp32")
        common.update(n_rows=index_type, n_cols=index_type, n_groups=index_type, n_partials=index_type)
        is_bf16 = dtype == torch.bfloat16
        const = dict(IS_BF16=is_bf16, ROWS=GROUP_ROWS_CUDA, GROUP=GROUP_SIZE)
        fn = _act_quant_group_kernel
        yield KernelVariant(
            f"act_quant_group[{name},{index_type}]", fn, _signature(fn, common, const), const, ACT_TARGETS
        )
        widths = (1, 4096, ACT_MAX_TILE_K) if is_bf16 and index_type == "i32" else (ACT_MAX_TILE_K,)
        for n_cols in widths:
            rows, tile_k, num_warps = act_tile(cuda, n_cols)
            for fn, const in (
                (_act_quant_token_kernel, dict(IS_BF16=is_bf16, ROWS=rows, TILE_K=tile_k)),
                (_act_amax_kernel, dict(IS_BF16=is_bf16, ROWS=rows, TILE_K=tile_k)),
                (_act_quant_tensor_kernel, dict(IS_BF16=is_bf16, ROWS=rows, TILE_K=tile_k, PARTIALS=MAX_PARTIALS)),
            ):
                kernel = fn.__name__.strip("_").removesuffix("_kernel")
                yield KernelVariant(
                    f"{kernel}[{name},{tile_k},{index_type}]",
                    fn,
                    _signature(fn, common, const),
                    const,
                    ACT_TARGETS,
                    dict(num_warps=num_warps),
                )


def gemm_variants() -> Iterator[KernelVariant]:
    """The FP8 GEMM specializations the CUDA forward and the tuner launch (``kernels.fp8_gemm``), for AOT compiles.

    A GEMM compile costs about a second of CPU, so the list is chosen, not a full product (CPU CI stays
    under a minute): the decode tile (first table row) in every scale layout, with a bias, 16-aligned
    (the common runtime case, see ``KernelVariant.aligned``), integer e4m3 decode on sm_80 and FP8
    hardware on sm_90 (sm_89 once); then one variant for each other code difference: unaligned, int64
    sizes, fp16, split K (partials out), M = 1 (index type "m1": Triton passes an integer argument equal to 1
    as the constant 1, so ``m`` is then a Python int inside the kernel), and each larger tile (sm_90); and the
    split-K reduction in each output dtype and scale mode, and with M = 1. The dynamic W8A8 GEMM (x quantized
    inside) once per activation granularity (group, token, tensor), in fp16, split, and with M = 1.
    """
    bf16, fp16 = torch.bfloat16, torch.float16
    # (kind, dtype, tile row, scale layout, index type, bias, aligned, FP8 targets, sm_80 too, split K)
    specs = [("w8a16", bf16, 0, g, "i32", True, True, (89, 90) if g == "channel" else (90,), True, False)
             for g in ("tensor", "channel", "block")]  # fmt: skip
    specs += [
        ("w8a16", bf16, 0, "channel", "i32", True, False, (90,), True, False),
        ("w8a16", bf16, 0, "channel", "i64", False, True, (90,), True, False),
        ("w8a16", fp16, 0, "channel", "i32", False, True, (90,), False, False),
        ("w8a16", bf16, 0, "channel", "i32", False, True, (90,), True, True),
        ("w8a16", bf16, 0, "block", "i32", False, True, (90,), False, True),
        ("w8a16", bf16, 0, "channel", "m1", True, True, (90,), True, True),
    ]
    specs += [
        ("w8a16", bf16, t, g, "i32", False, True, (90,), False, False) for t in (1, 2, 3) for g in ("channel", "block")
    ]
    specs += [
        ("w8a8", bf16, 0, "block", "i32", True, True, (89, 90), False, False),
        ("w8a8", bf16, 0, "block", "i32", True, False, (90,), False, False),
        ("w8a8", bf16, 0, "block", "i64", False, True, (90,), False, False),
        ("w8a8", fp16, 0, "block", "i32", False, True, (90,), False, False),
        ("w8a8", bf16, 0, "block", "i32", False, True, (90,), False, True),
        ("w8a8", bf16, 0, "channel", "i32", True, True, (89, 90), False, False),
        ("w8a8", bf16, 0, "tensor", "i32", False, True, (90,), False, False),
        ("w8a8", bf16, 0, "channel", "i32", False, True, (90,), False, True),
        ("w8a8", bf16, 0, "block", "m1", True, True, (90,), False, True),
        ("w8a8", bf16, 0, "tensor", "m1", False, True, (90,), False, False),
    ]
    specs += [("w8a8", bf16, t, "block", "i32", False, True, (90,), False, False) for t in (1, 2, 3)]
    # dynamic_w8a8_gemm (x quantized inside the GEMM): the scale layout field names the activations' granularity
    specs += [
        ("dynamic", bf16, 0, "group", "i32", True, True, (89, 90), False, False),
        ("dynamic", bf16, 0, "token", "i32", True, True, (89, 90), False, False),
        ("dynamic", bf16, 0, "tensor", "i32", False, True, (90,), False, False),
        ("dynamic", fp16, 0, "group", "i32", False, True, (90,), False, False),
        ("dynamic", bf16, 0, "token", "i32", False, True, (90,), False, True),
        ("dynamic", bf16, 0, "group", "m1", False, True, (90,), False, True),
        ("dynamic", bf16, 0, "tensor", "m1", True, False, (90,), False, False),
    ]
    cuda = torch.device("cuda")
    for kind, dtype, t, granularity, index_type, has_bias, aligned, fp8_targets, sm80, split in specs:
        name, ptr, is_bf16 = str(dtype)[6:], POINTER_TYPES[dtype], dtype == torch.bfloat16
        table = W8A16_TILES_CUDA if kind == "w8a16" else W8A8_TILES_CUDA
        tiles = table[t][1]
        block_m, block_n, block_k = tiles.block_m, tiles.block_n, tiles.block_k
        if granularity in ("block", "group"):
            block_n, block_k = min(block_n, BLOCK_SIZE[0]), BLOCK_SIZE[1]
        options = dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages)
        label = f"{block_m}x{block_n}x{block_k},{index_type},{'bias' if has_bias else 'nobias'}"
        label += ",split" if split else ""
        width = "i32" if index_type == "m1" else index_type
        sizes = dict(m=width, n=width, k=width, k_split=width)
        m_const = {"m": 1} if index_type == "m1" else {}
        if kind == "w8a16":
            fn, alignment = _w8a16_gemm_kernel, W8A16_ALIGNED
            types = dict(sizes, x_ptr=ptr, w_ptr="*u8", scale_ptr="*fp32", bias_ptr=ptr, out_ptr=ptr)
            types.update(partial_ptr="*fp32", scale_cols=width)
            forms = [(True, fp8_targets)] + ([(False, (80,))] if sm80 else [])
            for native, targets in forms:
                const = dict(
                    IS_BF16=is_bf16, HAS_BIAS=has_bias, SCALE_MODE=GRANULARITY_CODES[granularity], FP8_NATIVE=native,
                    DOT_DTYPE=dot_dtype(dtype, cuda), SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                    **m_const,
                )  # fmt: skip
                yield KernelVariant(
                    f"w8a16_gemm[{name},{granularity},{label},{'native' if native else 'int'}"
                    f"{',aligned' if aligned else ''}]",
                    fn, _signature(fn, types, const), const, targets, options, alignment if aligned else (),
                )  # fmt: skip
        else:
            fn, alignment = _w8a8_gemm_kernel, W8A8_ALIGNED
            dynamic = kind == "dynamic"  # x in bf16/fp16 at xq_ptr (x_scale_ptr unused), quantized in the kernel
            types = dict(sizes, xq_ptr=ptr if dynamic else "*u8", x_scale_ptr=ptr if dynamic else "*fp32")
            types.update(w_ptr="*u8", w_scale_ptr="*fp32", bias_ptr=ptr, out_ptr=ptr, partial_ptr="*fp32")
            types.update(x_scale_cols=width, w_scale_cols=width)
            weights = {a: w for w, a in ACT_GRANULARITY.items()}[granularity] if dynamic else granularity
            x_const = {"x_scale_cols": 1} if dynamic and granularity == "token" else {}  # Triton's 1 specialization
            const = dict(
                OUT_BF16=is_bf16, HAS_BIAS=has_bias, SCALE_MODE=GRANULARITY_CODES[weights], FP8_NATIVE=True,
                X_QUANT=dynamic, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **m_const, **x_const,
            )  # fmt: skip
            yield KernelVariant(
                f"{'dynamic_w8a8' if dynamic else 'w8a8'}_gemm[{name},{granularity},{label}"
                f"{',aligned' if aligned else ''}]",
                fn, _signature(fn, types, const), const, fp8_targets, options, alignment if aligned else (),
            )  # fmt: skip
    fn = _split_k_reduce_kernel
    for dtype in ACT_DTYPES:
        ptr = POINTER_TYPES[dtype]
        types = dict(partial_ptr="*fp32", scale_ptr="*fp32", bias_ptr=ptr, out_ptr=ptr, m="i32", n="i32", splits="i32")
        for granularity, mode in GRANULARITY_CODES.items():
            for m_const in ({}, {"m": 1}):
                const = dict(
                    OUT_BF16=dtype == torch.bfloat16, HAS_BIAS=True, SCALE_MODE=mode, BLOCK=REDUCE_BLOCK, **m_const
                )
                yield KernelVariant(
                    f"split_k_reduce[{str(dtype)[6:]},{granularity}{',m1' if m_const else ''}]", fn,
                    _signature(fn, types, const), const, ACT_TARGETS, dict(num_warps=4),
                )  # fmt: skip


# pointers and the sizes that are multiples of 16 in real models (M, the batch, usually is not); k_split, the
# K columns of a split, is a multiple of BLOCK_K always (without it the K loop's start has no known alignment
# and its loads are neither vectorized nor pipelined)
W8A16_ALIGNED = ("x_ptr", "w_ptr", "scale_ptr", "bias_ptr", "out_ptr", "partial_ptr", "n", "k", "k_split")
W8A8_ALIGNED = (
    "xq_ptr", "x_scale_ptr", "w_ptr", "w_scale_ptr", "bias_ptr", "out_ptr", "partial_ptr", "n", "k", "k_split",
)  # fmt: skip
