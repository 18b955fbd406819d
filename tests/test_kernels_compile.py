"""Every Triton kernel variant the library launches compiles to a cubin for sm_80, sm_89 and sm_90.

Runs on a CPU-only machine: triton.compile with a GPUTarget needs no GPU (Triton ships ptxas).
This is the check that a Triton kernel which only ever ran under the interpreter would fail:
a compiled kernel must unify its branches' types, and sm_80 has no float8e4nv type.
"""

import re

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from layerwise.kernels.fp8_gemm import W8A8_TILES_CUDA, W8A16_TILES_CUDA  # noqa: E402
from layerwise.kernels.triton_common import LAUNCH_OPTIONS  # noqa: E402
from layerwise.kernels.variants import CUDA_TARGETS, activation_variants, cuda_variants, gemm_variants  # noqa: E402

pytestmark = pytest.mark.slow  # the whole module (marker: pyproject.toml)

VARIANTS = list(cuda_variants("i32")) + list(cuda_variants("i64"))
ACT_VARIANTS = list(activation_variants("i32")) + list(activation_variants("i64"))
GEMM_VARIANTS = list(gemm_variants())


def _compile(variant, cc: int):
    names = list(variant.signature)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in variant.aligned}
    source = ASTSource(triton.jit(variant.fn), variant.signature, variant.constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(LAUNCH_OPTIONS, **variant.options))


def test_the_matrix_covers_every_kernel_dtype_and_layout():
    names = {v.name for v in VARIANTS}
    assert len(names) == len(VARIANTS) == 2 * 3 * 3 * 3  # width x dtype x layout x kernel
    for kernel in ("amax", "quantize", "dequantize"):
        for dtype in ("bfloat16", "float16", "float32"):
            for layout in ("tensor", "channel", "block"):
                assert f"{kernel}[{dtype},{layout},i32]" in names


def test_the_matrix_covers_every_activation_kernel():
    names = {v.name for v in ACT_VARIANTS}
    assert len(names) == len(ACT_VARIANTS) == 4 + 3 * (3 + 1 + 1 + 1)  # group x 4; bf16 i32 x 3 tiles, 3 x 1
    for width, dtype in (("i32", "bfloat16"), ("i64", "bfloat16"), ("i32", "float16"), ("i64", "float16")):
        assert f"act_quant_group[{dtype},{width}]" in names
        for kernel in ("act_quant_token", "act_amax", "act_quant_tensor"):
            assert f"{kernel}[{dtype},16384,{width}]" in names
    for tile_k in (128, 4096):
        assert f"act_quant_token[bfloat16,{tile_k},i32]" in names


SCALE_LAYOUTS = ("tensor", "channel", "block")


def test_the_matrix_covers_every_gemm():
    names = {v.name for v in GEMM_VARIANTS}
    assert len(names) == len(GEMM_VARIANTS)
    for layout in SCALE_LAYOUTS:  # the decode tile, each epilogue, both e4m3 decodes
        for decode in ("int", "native"):
            assert (
                f"w8a16_gemm[bfloat16,{layout},16x16x{128 if layout == 'block' else 256},i32,bias,{decode},aligned]"
                in names
            )
    expected = {
        "w8a16_gemm[bfloat16,channel,16x16x256,i32,bias,native]",  # unaligned
        "w8a16_gemm[bfloat16,channel,16x16x256,i64,nobias,native,aligned]",
        "w8a16_gemm[float16,channel,16x16x256,i32,nobias,native,aligned]",
        "w8a8_gemm[bfloat16,block,16x16x128,i32,bias,aligned]",
        "w8a8_gemm[bfloat16,block,16x16x128,i32,bias]",
        "w8a8_gemm[bfloat16,block,16x16x128,i64,nobias,aligned]",
        "w8a8_gemm[float16,block,16x16x128,i32,nobias,aligned]",
        # split K: the partials' store in both kernels (and both W8A16 decodes)
        "w8a16_gemm[bfloat16,channel,16x16x256,i32,nobias,split,int,aligned]",
        "w8a16_gemm[bfloat16,block,16x16x128,i32,nobias,split,native,aligned]",
        "w8a8_gemm[bfloat16,block,16x16x128,i32,nobias,split,aligned]",
        # W8A8 with per-channel / per-tensor weights (scales once at the end), unsplit and split
        "w8a8_gemm[bfloat16,channel,16x16x128,i32,bias,aligned]",
        "w8a8_gemm[bfloat16,tensor,16x16x128,i32,nobias,aligned]",
        "w8a8_gemm[bfloat16,channel,16x16x128,i32,nobias,split,aligned]",
        # M == 1 arrives as the constant 1
        "w8a16_gemm[bfloat16,channel,16x16x256,m1,bias,split,native,aligned]",
        "w8a16_gemm[bfloat16,channel,16x16x256,m1,bias,split,int,aligned]",
        "w8a8_gemm[bfloat16,block,16x16x128,m1,bias,split,aligned]",
        "w8a8_gemm[bfloat16,tensor,16x16x128,m1,nobias,aligned]",
        # x quantized inside the W8A8 GEMM: each activation granularity (per token: Triton's constant 1 stride)
        "dynamic_w8a8_gemm[bfloat16,group,16x16x128,i32,bias,aligned]",
        "dynamic_w8a8_gemm[bfloat16,token,16x16x128,i32,bias,aligned]",
        "dynamic_w8a8_gemm[bfloat16,tensor,16x16x128,i32,nobias,aligned]",
        "dynamic_w8a8_gemm[float16,group,16x16x128,i32,nobias,aligned]",
        "dynamic_w8a8_gemm[bfloat16,token,16x16x128,i32,nobias,split,aligned]",
        "dynamic_w8a8_gemm[bfloat16,group,16x16x128,m1,nobias,split,aligned]",
        "dynamic_w8a8_gemm[bfloat16,tensor,16x16x128,m1,bias]",
    }
    # every split-K reduction epilogue, and with M == 1
    expected |= {
        f"split_k_reduce[{d},{g}{m1}]" for d in ("bfloat16", "float16") for g in SCALE_LAYOUTS for m1 in ("", ",m1")
    }
    assert expected <= names, sorted(expected - names)
    for kind, table in (("w8a16_gemm", W8A16_TILES_CUDA), ("w8a8_gemm", W8A8_TILES_CUDA)):
        for _, (block_m, *_) in table:  # every tile row of both tables is built
            assert any(n.startswith(f"{kind}[bfloat16,") and f",{block_m}x" in n for n in names), (kind, block_m)
    for v in GEMM_VARIANTS:  # FP8 conversions and tensor cores only where the hardware has them
        if "FP8_NATIVE" in v.constexprs:
            assert set(v.targets) <= ({89, 90} if v.constexprs["FP8_NATIVE"] else {80}), v.name


@pytest.mark.parametrize(
    ("variant", "cc"),
    # every variant for sm_80, then for sm_89, then for sm_90, and before the other tests' sm_90 compiles: Triton
    # 3.6 (torch 2.11's) carries state from one compile to the next in a process, so that after any sm_90
    # compile its e4m3 -> bf16 conversions for sm_89 emit sm_90-only PTX that ptxas refuses. A real process
    # compiles for its own GPU only; Triton 3.9 does not carry it
    [(v, cc) for cc in CUDA_TARGETS for v in VARIANTS + ACT_VARIANTS + GEMM_VARIANTS if cc in v.targets],
    ids=lambda p: p.name if hasattr(p, "name") else str(p),
)
def test_kernel_compiles_to_a_cubin(variant, cc):
    compiled = _compile(variant, cc)
    # the launch fits the SM's shared memory (per block, opt-in maximum: sm_80 163 KiB, sm_89 99 KiB, sm_90 227 KiB)
    assert compiled.metadata.shared <= {80: 166912, 89: 101376, 90: 232448}[cc], compiled.metadata.shared
    assert len(compiled.asm["cubin"]) > 0
    # every tensor of addresses is offset by int64: elements past 2^31 are reachable
    addptrs = [line for line in compiled.asm["ttir"].splitlines() if "tt.addptr" in line and "tensor<" in line]
    assert addptrs
    for line in addptrs:
        offset_type = re.search(r",\s*tensor<[^>]*x(i\d+)>", line.split(":", 1)[1])
        assert offset_type and offset_type.group(1) == "i64", line


def test_aligned_gemms_pipeline_their_loads():
    # with 16-aligned pointers and sizes (Triton's launch-time specialization) the K loop's loads become
    # cp.async copies into shared memory, num_stages deep: the latency hiding the decode tiles rely on
    # (split K too: its loop starts at split * k_split, and only k_split's alignment keeps the copies vectorized)
    for name in ("w8a16_gemm[bfloat16,channel,16x16x256,i32,bias,native,aligned]",
                 "w8a8_gemm[bfloat16,block,16x16x128,i32,bias,aligned]",
                 "w8a16_gemm[bfloat16,channel,16x16x256,i32,nobias,split,native,aligned]",
                 "w8a8_gemm[bfloat16,block,16x16x128,i32,nobias,split,aligned]",
                 "dynamic_w8a8_gemm[bfloat16,group,16x16x128,i32,bias,aligned]",
                 "dynamic_w8a8_gemm[bfloat16,token,16x16x128,i32,nobias,split,aligned]"):  # fmt: skip
        variant = next(v for v in GEMM_VARIANTS if v.name == name)
        compiled = _compile(variant, 90)
        assert "cp.async" in compiled.asm["ptx"], name
        assert compiled.metadata.shared >= 2 * 16 * 128, name  # more than one stage of the smallest tile


def test_kernels_that_divide_use_ieee_division():
    # Triton's `/` on fp32 is div.full.f32 (approximate), and Triton 3.6 (torch 2.11's pin) ignores
    # tl.fdiv(ieee_rounding=True): on an H100 one quotient in ~2000 was an ulp off, which moved
    # round-half-to-even ties (84.0 -> 88 instead of 80) and broke bit-equality with torch's cast
    dividing = ("quantize[", "act_quant_token[", "act_quant_group[", "act_quant_tensor[")
    picked = {}
    for v in VARIANTS + ACT_VARIANTS:
        kind = next((k for k in dividing if v.name.startswith(k)), None)
        if kind is not None and kind not in picked:
            picked[kind] = v
    assert set(picked) == set(dividing)
    for variant in picked.values():
        ptx = _compile(variant, 90).asm["ptx"]
        assert "div.rn.f32" in ptx, variant.name
        assert not re.search(r"div\.(full|approx)", ptx), variant.name
