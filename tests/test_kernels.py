"""Triton kernels against the torch reference, bit for bit (interpreter on CPU, compiled on CUDA)."""

import pytest
import torch

from layerwise import kernels
from layerwise.errors import NonFiniteWeightError
from layerwise.kernels import (
    GRANULARITIES,
    fp8_amax,
    fp8_dequantize,
    fp8_quantize_weight,
    reference,
    scale_from_amax,
    scale_shape,
)
from layerwise.kernels.fp8_tiles import amax_triton, quantize_triton

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SHAPES = [(1, 1), (7, 13), (257, 4099), (300, 200)]  # none a multiple of the 128 x 128 block but 1x1


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def _check(w, granularity):
    q_ref, s_ref = fp8_quantize_weight(w, granularity, "torch")
    q_tri, s_tri = fp8_quantize_weight(w, granularity, "triton")
    assert s_ref.shape == scale_shape(w.shape, granularity)
    assert torch.equal(s_ref, s_tri)
    assert torch.equal(_bits(q_ref), _bits(q_tri))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert torch.equal(
            _bits(fp8_dequantize(q_ref, s_ref, dtype, "torch")), _bits(fp8_dequantize(q_ref, s_ref, dtype, "triton"))
        )
    return q_ref, s_ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("shape", SHAPES)
def test_random_odd_shapes(shape, granularity, device):
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16 if shape[0] % 2 else torch.float32).to(device)
    _check(w, granularity)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_all_zero_tensor(granularity, device):
    q, s = _check(torch.zeros(130, 131, dtype=torch.bfloat16, device=device), granularity)
    assert bool((s == 1).all()) and not _bits(q).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("magnitude", [1e-40, 1e-38, 1e-30, 1e-6, 1e6, 1e30, 3e38])
def test_subnormal_tiny_and_huge_magnitudes(magnitude, granularity, device):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(133, 65, generator=g, dtype=torch.float64)
    w = (r / r.abs().max() * magnitude).to(torch.bfloat16).to(device)  # 1e-40: bf16 subnormals
    q, s = _check(w, granularity)
    assert bool(torch.isfinite(s).all()) and bool((s > 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_mixed_magnitudes_per_group(granularity, device):
    # rows and blocks of very different scale, zero rows, and values at +-448 and far beyond
    g = torch.Generator().manual_seed(1)
    w = torch.randn(260, 300, generator=g)
    w[:128] *= 1e-3
    w[200:210] = 0
    w[5, 7], w[6, 8], w[250, 299] = 448.0, -448.0, 1e5
    _check(w.to(device), granularity)


@pytest.mark.parametrize("device", DEVICES)
def test_every_rounding_boundary_with_unit_scale(device):
    # dense sweep across and past the e4m3 range, plus values that carry into the next binade
    # (125.07 -> 128 in torch; a plain interpreter cast gives 64), signed zeros, subnormals, saturation
    x = torch.linspace(-460, 460, 300_001)
    special = torch.tensor(
        [
            125.07,
            239.9,
            -0.0,
            0.0,
            1e-40,
            -1e-40,
            2.0**-10,
            3 * 2.0**-11,
            -(2.0**-10),
            448.0,
            -448.0,
            449.0,
            464.0,
            1e30,
            -1e30,
        ]
    )
    x = torch.cat([x, special]).to(device)
    one = torch.ones((), device=device)
    assert torch.equal(_bits(reference.quantize(x, one)), _bits(quantize_triton(x, one)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_non_finite_is_rejected(granularity, device):
    w = torch.randn(100, 137).to(device)
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = w.clone()
        x[50, 3] = bad
        for kernel in ("torch", "triton"):
            assert not bool(torch.isfinite(fp8_amax(x, granularity, kernel)).all())
            with pytest.raises(NonFiniteWeightError):
                fp8_quantize_weight(x, granularity, kernel)


def test_reference_definition():
    w = torch.tensor([[-2.0, 0.5], [1.0, 0.25]], dtype=torch.bfloat16)
    q, s = fp8_quantize_weight(w)
    assert s.item() == pytest.approx(2.0 / 448)
    assert q.float().tolist() == [[-448.0, 112.0], [224.0, 56.0]]
    q, s = fp8_quantize_weight(w, "channel")
    assert s.flatten().tolist() == pytest.approx([2.0 / 448, 1.0 / 448])
    assert q.float().tolist() == [[-448.0, 112.0], [448.0, 112.0]]


def test_wrappers_check_inputs():
    with pytest.raises(ValueError, match="contiguous"):
        quantize_triton(torch.randn(8, 8).t(), torch.ones(()))
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        amax_triton(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="fits no layout"):
        quantize_triton(torch.randn(4, 4), torch.ones(2))
    with pytest.raises(ValueError, match="2-D"):
        fp8_amax(torch.randn(4, 4, 4), "channel", "triton")


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_input_is_not_modified(kernel, granularity):
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(64, 33).to(dtype)
        before = w.clone()
        fp8_quantize_weight(w, granularity, kernel)
        assert torch.equal(w, before)


def test_custom_ops_trace_under_torch_compile():
    from layerwise.kernels import ops

    w = torch.randn(40, 50)

    def f(x):
        scale = torch.clamp(ops.fp8_amax_triton(x, "channel") / 448, min=1e-12)
        return ops.fp8_dequantize_triton(ops.fp8_quantize_triton(x, scale), scale, torch.float32)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fails on a graph break
    assert torch.equal(compiled(w), f(w))
    cases = [
        (torch.ops.layerwise.fp8_amax_triton, (w, "block")),
        (torch.ops.layerwise.fp8_quantize_triton, (w, torch.ones(40, 1))),
        (torch.ops.layerwise.fp8_dequantize_triton, (w.to(torch.float8_e4m3fn), torch.ones(1), torch.bfloat16)),
    ]
    for op, args in cases:  # the fake implementations agree with the real ones on shape and dtype
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))


@pytest.mark.parametrize("shape", [(), (5,), (3, 5, 7), (2, 3, 4, 9)])
def test_per_tensor_of_any_rank(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).bfloat16()
    _check(w, "tensor")


def test_launch_grid_is_one_axis_for_real_model_sizes():
    from layerwise.kernels.triton_common import MAX_PROGRAMS, TILE_CUDA, as_matrix, grid_1d

    # a 131072 x 16384 embedding (2^31 elements; 128256 x 16384 is just under): the old 2-D grid put
    # 64 column tiles on axis 1, and a flat per-tensor layout put numel / 256 > 65535 programs there
    n, k = 131072 + 16, 16384
    grid = grid_1d(n, k, *TILE_CUDA)
    assert len(grid) == 1 and grid[0] == (n // 16) * (k // 256) <= MAX_PROGRAMS
    assert (n - 1) * k + (k - 1) >= 2**31  # the last offset needs 64 bits (test_kernels_compile checks i64)
    # per-tensor on a non-2-D tensor is laid out as rows of its last dimension, not one long row
    assert as_matrix(torch.empty(4, 1000, 4096, device="meta")).shape == (4000, 4096)
    assert as_matrix(torch.empty((), device="meta")).shape == (1, 1)
    with pytest.raises(ValueError, match="programs"):
        grid_1d(2**40, 2**20, *TILE_CUDA)


def test_resolve_kernel():
    assert kernels.resolve_kernel(None, "cpu") == "torch"
    assert kernels.resolve_kernel(None, "cuda") == ("triton" if kernels.HAS_TRITON else "torch")
    with pytest.raises(ValueError):
        kernels.resolve_kernel("cutlass", "cpu")


def test_eager_triton_ops_do_not_import_the_compiler_stack():
    # a custom op's first eager call imports torch._dynamo, sympy and Inductor (seconds); the load path
    # must not (issue 14). A fresh interpreter, so that earlier tests' imports do not count.
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from layerwise.kernels import ops\n"
        "w = torch.randn(8, 8)\n"
        "s = torch.clamp(ops.fp8_amax_triton(w, 'channel') / torch.tensor(448.0), min=1e-12)\n"
        "ops.fp8_dequantize_triton(ops.fp8_quantize_triton(w, s), s, torch.float32)\n"
        "heavy = [m for m in ('torch._dynamo', 'sympy', 'torch._inductor') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_skipping_the_clamp_for_an_own_amax_scale_changes_no_byte(granularity):
    # fp8_quantize_weight's reference path skips the clamp (within_range): |w| / scale may exceed 448 by an
    # ulp where amax / 448 rounds down; torch's cast must still give 448's byte. 4096 amaxes, one per row.
    g = torch.Generator().manual_seed(11)
    amaxes = torch.exp(torch.empty(4096).uniform_(-80, 80, generator=g)).clamp(max=3e38)
    w = torch.rand(4096, 130, generator=g) * amaxes[:, None]
    w[:, 0], w[:, 1] = amaxes, -amaxes
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = w.to(dtype) if dtype != torch.float16 else (w / amaxes[:, None] * 60000).to(dtype)
        scale = scale_from_amax(reference.amax(x, granularity))
        fast = reference.quantize(x, scale, within_range=True)
        assert torch.equal(_bits(fast), _bits(reference.quantize(x, scale)))
        expanded = reference._expand_rows(scale, granularity, 0, x.shape[0], x.shape[1])
        own_cast = (x.float() / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)  # torch's own formula
        assert torch.equal(_bits(fast), _bits(own_cast))


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_amax_of_a_large_bf16_weight_equals_float32_reduction(granularity):
    # >= CHUNK_NUMEL elements and ragged in both dims: the widened (float32 buffer) path of reference.amax
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(1030, 1100, generator=g) * 0.02).bfloat16()
    w[700, 1099] = float("nan")
    got = reference.amax(w, granularity)
    a = w.float().abs()
    if granularity == "channel":
        want = a.amax(dim=1, keepdim=True)
    else:
        a = torch.nn.functional.pad(a, (0, -1100 % 128, 0, -1030 % 128))
        want = a.view(a.shape[0] // 128, 128, a.shape[1] // 128, 128).amax(dim=(1, 3))
    assert got.shape == want.shape and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("granularity", ["channel", "block"])
def test_rows_longer_than_a_chunk(granularity):
    # a row of more than CHUNK_NUMEL elements is one chunk of its own (the work buffers grow to hold it)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(3, reference.CHUNK_NUMEL + 300, generator=g) * 0.02).bfloat16()
    a = w.float().abs()
    if granularity == "channel":
        want = a.amax(dim=1, keepdim=True)
    else:
        a = torch.nn.functional.pad(a, (0, -a.shape[1] % 128, 0, 125))
        want = a.view(1, 128, a.shape[1] // 128, 128).amax(dim=(1, 3))
    amax = reference.amax(w, granularity)
    assert torch.equal(amax, want)
    scale = want / torch.tensor(448.0)  # no zero and no subnormal amax here: the recipe is this division
    expanded = scale if granularity == "channel" else scale.repeat_interleave(128, dim=1)[:, : w.shape[1]]
    own_cast = (w.float() / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)  # torch's own formula
    assert torch.equal(_bits(reference.quantize(w, scale)), _bits(own_cast))


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_triton_quantize_writes_straight_into_out(monkeypatch, granularity):
    # a reload quantizes into the live FP8 weight: the kernel writes there, with no FP8 temporary copied in
    import layerwise.kernels.fp8_tiles as fp8_tiles

    w = torch.randn(130, 300, generator=torch.Generator().manual_seed(3)).bfloat16()
    q_ref, scale = fp8_quantize_weight(w, granularity, "torch")
    written = []
    launch = fp8_tiles._launch

    def recording(fn, x, out, *args, **kwargs):
        written.append(out.data_ptr())
        return launch(fn, x, out, *args, **kwargs)

    monkeypatch.setattr(fp8_tiles, "_launch", recording)
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    assert kernels.fp8_quantize(w, scale, "triton", out=out) is out
    assert written == [out.data_ptr()] and torch.equal(out.view(torch.uint8), q_ref.view(torch.uint8))
    alias = torch.empty(0, dtype=torch.float8_e4m3fn).set_(w.untyped_storage(), 0, w.shape)  # w's own bytes
    with pytest.raises(ValueError, match="shares memory with w"):  # the kernel would overwrite what it reads
        kernels.fp8_quantize(w, scale, "triton", out=alias)
    strided = torch.empty(300, 130, dtype=torch.float8_e4m3fn).t()  # not contiguous: quantized, then copied in
    assert kernels.fp8_quantize(w, scale, "triton", out=strided) is strided
    assert torch.equal(strided.contiguous().view(torch.uint8), q_ref.view(torch.uint8))
