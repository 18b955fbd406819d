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
from layerwise.kernels.variants import CUDA_TARGETS, activation_variants, cuda_variants  # noqa: E402

VARIANTS = list(cuda_variants("i32")) + list(cuda_variants("i64"))
ACT_VARIANTS = list(activation_variants("i32")) + list(activation_variants("i64"))


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


@pytest.mark.parametrize("cc", CUDA_TARGETS)
@pytest.mark.parametrize("variant", VARIANTS + ACT_VARIANTS, ids=lambda v: v.name)
def test_kernel_compiles_to_a_cubin(variant, cc):
    compiled = _compile(variant, cc)
    assert len(compiled.asm["cubin"]) > 0
    # every tensor of addresses is offset by int64: elements past 2^31 are reachable
    addptrs = [line for line in compiled.asm["ttir"].splitlines() if "tt.addptr" in line and "tensor<" in line]
    assert addptrs
    for line in addptrs:
        offset_type = re.search(r",\s*tensor<[^>]*x(i\d+)>", line.split(":", 1)[1])
        assert offset_type and offset_type.group(1) == "i64", line
