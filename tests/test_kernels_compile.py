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

from layerwise.kernels.triton_common import LAUNCH_OPTIONS  # noqa: E402
from layerwise.kernels.variants import CUDA_TARGETS, activation_variants, cuda_variants, gemm_variants  # noqa: E402

VARIANTS = list(cuda_variants("i32")) + list(cuda_variants("i64"))
ACT_VARIANTS = list(activation_variants("i32")) + list(activation_variants("i64"))
GEMM_VARIANTS = list(gemm_variants())


def _compile(variant, cc: int):
    source = ASTSource(triton.jit(variant.fn), variant.signature, variant.constexprs)
    return triton.compile(source, target=GPUTarget("cuda", cc, 32), options=dict(LAUNCH_OPTIONS))


def test_the_matrix_covers_every_kernel_dtype_and_layout():
    names = {v.name for v in VARIANTS}
    assert len(names) == len(VARIANTS) == 2 * 3 * 3 * 3  # width x dtype x layout x kernel
    for kernel in ("amax", "quantize", "dequantize"):
        for dtype in ("bfloat16", "float16", "float32"):
            for layout in ("tensor", "channel", "block"):
                assert f"{kernel}[{dtype},{layout},i32]" in names


def test_the_matrix_covers_every_activation_kernel():
    names = {v.name for v in ACT_VARIANTS}
    assert len(names) == len(ACT_VARIANTS) == 2 * 2 * 4  # width x dtype x kernel
    for kernel in ("act_quant_token", "act_quant_group", "act_amax", "act_quant_tensor"):
        assert f"{kernel}[bfloat16,i64]" in names


def test_the_matrix_covers_every_gemm():
    names = {v.name for v in GEMM_VARIANTS}
    assert len(names) == len(GEMM_VARIANTS)
    for dtype in ("bfloat16", "float16"):
        for layout in ("tensor", "channel", "block"):
            for decode in ("int", "native"):  # sm_80 and sm_89+ forms of the decode tile
                assert any(n.startswith(f"w8a16_gemm[{dtype},{layout},16x16x") and n.endswith(f",{decode}]")
                           for n in names)  # fmt: skip
        assert any(n.startswith(f"w8a8_block_gemm[{dtype},16x16x128,") for n in names)
    assert "w8a8_block_gemm[bfloat16,16x16x128,i64,nobias]" in names
    assert "w8a16_gemm[bfloat16,block,16x16x128,i32,bias,native]" in names
    for v in GEMM_VARIANTS:  # FP8 conversions and tensor cores only where the hardware has them
        assert set(v.targets) <= ({89, 90} if v.constexprs["FP8_NATIVE"] else {80}), v.name


@pytest.mark.parametrize(
    ("variant", "cc"),
    [(v, cc) for v in VARIANTS + ACT_VARIANTS + GEMM_VARIANTS for cc in CUDA_TARGETS if cc in v.targets],
    ids=lambda p: p.name if hasattr(p, "name") else str(p),
)
def test_kernel_compiles_to_a_cubin(variant, cc):
    compiled = _compile(variant, cc)
    assert len(compiled.asm["cubin"]) > 0
    # every tensor of addresses is offset by int64: elements past 2^31 are reachable
    addptrs = [line for line in compiled.asm["ttir"].splitlines() if "tt.addptr" in line and "tensor<" in line]
    assert addptrs
    for line in addptrs:
        offset_type = re.search(r",\s*tensor<[^>]*x(i\d+)>", line.split(":", 1)[1])
        assert offset_type and offset_type.group(1) == "i64", line
