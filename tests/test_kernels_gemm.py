"""Triton FP8 GEMMs (kernels/fp8_gemm.py) against a float64 product of the dequantized operands.

Interpreted on CPU (the same source the GPU compiles; tests/test_cuda.py runs it compiled).

Tolerance, from the arithmetic of the kernels: every product of a bf16/fp16 activation and an
e4m3 weight is exact in float32 (8 + 4 significant bits), so the float32 sum of K products is off
by at most about K * 2^-24 * sum_k |x_k w_k| (Higham's bound, u = 2^-24), the scale, the bias
and the final cast add 3 more roundings of 2^-24 each, and the output cast rounds to nearest:
half an ulp, at most 2^-8 |y| in bf16 and 2^-11 |y| in fp16. The bound checked is
    |y - y64| <= 2 * (eps_out * |y64| + (K + 3) * acc_eps * (|x| @ |W|^T + |bias|))
with acc_eps = 2^-24 (float32 accumulation; FP8 tensor cores on a GPU accumulate with fewer bits,
tests/test_cuda.py passes a larger acc_eps). A wrong scale, a wrong weight column or a dropped
K tail moves y by far more than this (see test_the_bound_catches_a_wrong_result).
"""

import pytest
import torch

from layerwise.kernels import fp8_quantize_weight, reference
from layerwise.kernels.fp8_act import quantize_activation
from layerwise.kernels.fp8_gemm import GemmTiles, dynamic_w8a8_gemm, gemm_tiles, k_span, w8a8_gemm, w8a16_gemm

SHAPES = [(1, 16, 32), (3, 40, 70), (17, 33, 257), (8, 130, 300)]  # (M, N, K): tails in every dim
EPS_OUT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_close_to_f64(y, x64, w64, bias64, acc_eps=2.0**-24):
    """The bound of the module docstring; x64 [M, K] and w64 [N, K] the dequantized operands."""
    ref = x64 @ w64.t() + (bias64 if bias64 is not None else 0)
    magnitude = x64.abs() @ w64.abs().t() + (bias64.abs() if bias64 is not None else 0)
    k = x64.shape[1]
    bound = 2 * (EPS_OUT[y.dtype] * ref.abs() + (k + 3) * acc_eps * magnitude)
    err = (y.double().cpu() - ref).abs()
    assert bool((err <= bound).all()), f"max excess {(err - bound).max().item():.3e}"


def _operands(m, n, k, dtype, granularity, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g)
    w[: n // 2] *= 50  # rows (and blocks) of different magnitude: scales that must not be mixed up
    q, s = fp8_quantize_weight(w.bfloat16(), granularity)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, q, s, bias


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a16_gemm(dtype, granularity):
    for i, (m, n, k) in enumerate(SHAPES):
        x, q, s, bias = _operands(m, n, k, dtype, granularity, i)
        w64 = reference.dequantize(q, s, torch.float64)
        with_bias = i % 2 == 1
        y = w8a16_gemm(x, q, s, bias if with_bias else None)
        assert y.shape == (m, n) and y.dtype == dtype
        assert_close_to_f64(y, x.double(), w64, bias.double() if with_bias else None)


def _quantized_x(x, act):
    """(xq, x_scale, float64 dequantized x) of x quantized per ``act`` ("group", "token" or "tensor")."""
    xq, xs = quantize_activation(x, act)
    scale = xs.double().repeat_interleave(128, dim=1)[:, : x.shape[1]] if act == "group" else xs.double()
    return xq, xs, xq.double() * scale


# weight scale layout -> the activation scales it is paired with (quant.fp8), and one more it takes
W8A8_PAIRS = [
    ("block", "group"), ("channel", "token"), ("tensor", "tensor"), ("channel", "tensor"), ("tensor", "token"),
]  # fmt: skip


@pytest.mark.parametrize(("granularity", "act"), W8A8_PAIRS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a8_gemm(dtype, granularity, act):
    for i, (m, n, k) in enumerate(SHAPES):
        x, q, s, bias = _operands(m, n, k, dtype, granularity, 10 + i)
        xq, xs, x64 = _quantized_x(x, act)
        with_bias = i % 2 == 0
        y = w8a8_gemm(xq, xs, q, s, dtype, bias if with_bias else None)
        assert y.shape == (m, n) and y.dtype == dtype
        assert_close_to_f64(y, x64, reference.dequantize(q, s, torch.float64), bias.double() if with_bias else None)


@pytest.mark.parametrize(("granularity", "act"), W8A8_PAIRS)
@pytest.mark.parametrize("split_k", [1, 3])
def test_dynamic_w8a8_gemm_equals_quantize_then_gemm(granularity, act, split_k):
    # x quantized inside the GEMM: the bytes and scales of quantize_activation, so the output of the unfused pair,
    # bit for bit (a row holding NaN and one holding Inf too), within the float64 bound; per tensor at M <= BLOCK_M
    tiles = GemmTiles(16, 32, 128, split_k, 1, 1)
    for i, (m, n, k) in enumerate([(1, 16, 32), (3, 40, 70), (16, 33, 257), (8, 130, 300)]):
        dtype = torch.float16 if i == 1 else torch.bfloat16
        x, q, s, bias = _operands(m, n, k, dtype, granularity, 40 + i)
        if m > 2:  # a NaN row and an Inf row; the last shape a NaN alone (per tensor: NaN, not Inf, sets amax)
            x[1, 5] = float("nan")
            if i < 3:
                x[2, k - 1] = float("-inf")
        bias = bias if i % 2 == 0 else None
        y = dynamic_w8a8_gemm(x, act, q, s, bias, tiles=tiles)
        xq, xs, x64 = _quantized_x(x, act)
        unfused = w8a8_gemm(xq, xs, q, s, dtype, bias, tiles=tiles)
        assert y.dtype == dtype and torch.equal(y.view(torch.int16), unfused.view(torch.int16)), (m, n, k)
        finite = torch.isfinite(x).all(dim=1) if act != "tensor" else torch.isfinite(x).all().expand(m)
        w64 = reference.dequantize(q, s, torch.float64)
        assert_close_to_f64(y[finite], x64[finite], w64, bias.double() if bias is not None else None)
        assert not torch.isfinite(y[~finite]).any()


def test_dynamic_w8a8_gemm_quantizes_first_where_inside_cannot_or_should_not(monkeypatch):
    # one scale over 17 rows spans two programs of 16; beyond DYNAMIC_QUANT_MAX_M rows every column tile would
    # re-read x: quantize_activation runs first there, and only there; the result is the same either way
    from layerwise.kernels import fp8_gemm

    calls = []
    real = fp8_gemm.quantize_activation
    monkeypatch.setattr(fp8_gemm, "quantize_activation", lambda x, g: calls.append((x.shape[0], g)) or real(x, g))
    monkeypatch.setattr(fp8_gemm, "DYNAMIC_QUANT_MAX_M", 20)
    qc, sc = fp8_quantize_weight(torch.randn(32, 256).bfloat16(), "channel")
    tiles = GemmTiles(16, 32, 128, 1, 1, 1)
    for m, act, first in ((16, "tensor", False), (17, "tensor", True), (20, "token", False), (21, "token", True)):
        x = torch.randn(m, 256).bfloat16()
        y = dynamic_w8a8_gemm(x, act, qc, sc, tiles=tiles)
        assert calls == ([(m, act)] if first else []), (m, act)
        calls.clear()
        assert torch.equal(
            y.view(torch.int16), w8a8_gemm(*real(x, act), qc, sc, torch.bfloat16, None, tiles).view(torch.int16)
        )


def test_dynamic_w8a8_gemm_refuses_activations_that_do_not_go_with_the_weights():
    x = torch.randn(4, 256).bfloat16()
    qc, sc = fp8_quantize_weight(torch.randn(32, 256).bfloat16(), "channel")
    qb, sb = fp8_quantize_weight(torch.randn(256, 256).bfloat16(), "block")
    for act, q, s in (("group", qc, sc), ("token", qb, sb), ("row", qc, sc)):
        with pytest.raises(ValueError, match=f"activations per {act} do not go with"):
            dynamic_w8a8_gemm(x, act, q, s)
    with pytest.raises(TypeError, match="contiguous bf16/fp16"):
        dynamic_w8a8_gemm(x.float(), "token", qc, sc)


SPLIT_SHAPES = [(3, 40, 70), (17, 33, 257), (8, 130, 300), (2, 24, 1000)]  # 1, 2-3 and 8 K blocks of 128


@pytest.mark.parametrize("split_k", [2, 3, 16])
def test_split_k(split_k):
    # the K blocks dealt to 2, 3 or (more splits than blocks) every block its own split; the float32
    # partials summed by the reduction, which applies scale and bias: the same bound as unsplit
    tiles = GemmTiles(16, 32, 128, split_k, 1, 1)
    for i, (m, n, k) in enumerate(SPLIT_SHAPES):
        span, splits = k_span(k, tiles)
        assert span % 128 == 0 and (splits - 1) * span < k <= splits * span  # no split empty, K covered
        assert splits == min(split_k, -(-k // 128))
        for granularity in ("tensor", "channel", "block"):
            x, q, s, bias = _operands(m, n, k, torch.bfloat16, granularity, 20 + i)
            y = w8a16_gemm(x, q, s, bias, tiles=tiles)
            assert_close_to_f64(y, x.double(), reference.dequantize(q, s, torch.float64), bias.double())
            act = {"block": "group", "channel": "token", "tensor": "tensor"}[granularity]
            xq, xs, x64 = _quantized_x(x.half(), act)
            y = w8a8_gemm(xq, xs, q, s, torch.float16, None, tiles=tiles)
            assert y.dtype == torch.float16
            assert_close_to_f64(y, x64, reference.dequantize(q, s, torch.float64), None)


def test_the_bound_catches_a_wrong_result():
    x, q, s, _ = _operands(8, 130, 300, torch.bfloat16, "block", 0)
    w64 = reference.dequantize(q, s, torch.float64)
    y = w8a16_gemm(x, q, s)
    assert_close_to_f64(y, x.double(), w64, None)
    s_swapped = s.flip(0)  # the block rows' scales swapped
    with pytest.raises(AssertionError):
        assert_close_to_f64(w8a16_gemm(x, q, s_swapped), x.double(), w64, None)
    y_tail = w8a16_gemm(x[:, :256].contiguous(), q[:, :256].contiguous(), s[:, :2].contiguous())  # K tail dropped
    with pytest.raises(AssertionError):
        assert_close_to_f64(y_tail, x.double(), w64, None)


def test_empty_and_bad_inputs():
    q, s = fp8_quantize_weight(torch.randn(32, 16).bfloat16(), "channel")
    assert w8a16_gemm(torch.empty(0, 16, dtype=torch.bfloat16), q, s).shape == (0, 32)
    with pytest.raises(ValueError, match="x \\[M, K\\]"):
        w8a16_gemm(torch.randn(2, 8).bfloat16(), q, s)
    with pytest.raises(TypeError, match="bf16/fp16"):
        w8a16_gemm(torch.randn(2, 16), q, s)
    with pytest.raises(TypeError, match="float8"):
        w8a16_gemm(torch.randn(2, 16).bfloat16(), q.float(), s)
    xq, xs = quantize_activation(torch.randn(2, 16).bfloat16(), "token")
    with pytest.raises(TypeError, match="x_scale"):
        w8a8_gemm(xq, xs.expand(2, 2), q, s, torch.bfloat16)
    qb, sb = fp8_quantize_weight(torch.randn(256, 256).bfloat16(), "block")  # scales [2, 2]
    xq, xs = quantize_activation(torch.randn(2, 256).bfloat16(), "token")
    with pytest.raises(TypeError, match="per-block weights need x_scale \\[2, 2\\]"):
        w8a8_gemm(xq, xs, qb, sb, torch.bfloat16)


def test_tile_tables_cover_every_m():
    cuda = torch.device("cuda")
    for kind in ("w8a16", "w8a8"):
        for m in (1, 8, 16, 17, 64, 65, 4096, 1 << 20):
            block_m, block_n, block_k, split_k, _, _ = gemm_tiles(m, cuda, kind)
            assert min(block_m, block_n, block_k) >= 16 and split_k >= 1  # tl.dot's minimum
            if kind == "w8a8":
                assert block_k == 128 and 128 % block_n == 0  # one weight block per K step and column tile


@pytest.fixture(scope="module")
def qwen2_checkpoint(tmp_path_factory):
    """A 2-layer Qwen2 checkpoint (its qkv_proj has a bias: the GEMMs' fused bias is exercised)."""
    from tests.hf_checkpoints import write_hf_checkpoint

    return write_hf_checkpoint(tmp_path_factory.mktemp("qwen2-gemm"), "Qwen2ForCausalLM")


IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def qwen2_reference_logits(qwen2_checkpoint):
    """transformers' float32 logits of IDS (computed once for the module)."""
    from tests.hf_checkpoints import hf_logits

    return hf_logits(qwen2_checkpoint, IDS)


@pytest.mark.parametrize(
    ("scheme", "fp8_mode"),
    [
        ("fp8-per-tensor", "w8a16"),
        ("fp8-per-channel", "w8a16"),
        ("fp8-per-block", "w8a16"),
        ("fp8-per-block", "auto"),
        ("fp8-per-block", "w8a8"),
    ],
)
def test_model_forward_through_the_triton_gemms(
    qwen2_checkpoint, qwen2_reference_logits, monkeypatch, scheme, fp8_mode
):
    # The CUDA forward path (quant.fp8 with fused_forward true) run here under the interpreter: W8A16
    # GEMMs, and for per-block "auto" on an FP8 GPU the group-quantized block-scaled W8A8 GEMM.
    import layerwise
    import layerwise.kernels.fp8_gemm as fp8_gemm
    import layerwise.quant.fp8 as quant_fp8
    from tests.hf_checkpoints import sqnr_db

    ids = IDS
    model = layerwise.load_model(qwen2_checkpoint, quantization=scheme, fp8_mode=fp8_mode)
    torch_model = model
    if fp8_mode == "w8a8":  # per-block W8A8 exists only as the Triton GEMM on an FP8 GPU: refused on CPU
        with pytest.raises(RuntimeError, match="sm89"), torch.no_grad():
            model(ids)
        torch_model = layerwise.load_model(qwen2_checkpoint, quantization=scheme, fp8_mode="w8a16")
    with torch.no_grad():
        torch_path = torch_model(ids).float()
    calls = []
    monkeypatch.setattr(quant_fp8, "fused_forward", lambda kernel, x: x.dtype == torch.bfloat16)
    monkeypatch.setattr(fp8_gemm, "fp8_native", lambda device: True)
    for name in ("w8a16_gemm", "w8a8_gemm"):
        real = getattr(fp8_gemm, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(fp8_gemm, name, counted)
    with torch.no_grad():
        triton_path = model(ids).float()
    expected = "w8a16_gemm" if fp8_mode == "w8a16" else "w8a8_gemm"
    assert calls and set(calls) == {expected}
    assert sqnr_db(qwen2_reference_logits, triton_path) >= 18
    # same weights, same W8A16 arithmetic up to rounding: far closer to the torch path than to transformers
    assert sqnr_db(torch_path, triton_path) >= (35 if fp8_mode == "w8a16" else 20)


@pytest.mark.parametrize("scheme", ["fp8-per-tensor", "fp8-per-channel"])
def test_w8a8_forward_takes_the_triton_gemm_only_where_tuned(
    qwen2_checkpoint, qwen2_reference_logits, monkeypatch, scheme
):
    # The CUDA W8A8 forward of per-tensor / per-channel weights (interpreted here): torch._scaled_mm, unless the
    # tuner stored a "w8a8" configuration for the shape (it does only where the Triton GEMM, x quantized inside,
    # was faster)
    import layerwise
    import layerwise.kernels.fp8_gemm as fp8_gemm
    import layerwise.quant.fp8 as quant_fp8
    from layerwise.kernels.fp8_gemm import TILES_INTERPRET
    from tests.hf_checkpoints import sqnr_db

    if scheme == "fp8-per-channel" and not quant_fp8.cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only")
    model = layerwise.load_model(qwen2_checkpoint, quantization=scheme, fp8_mode="w8a8")
    monkeypatch.setattr(quant_fp8, "fused_forward", lambda kernel, x: x.dtype == torch.bfloat16)
    calls = []
    real_gemm, real_scaled_mm = fp8_gemm.dynamic_w8a8_gemm, torch._scaled_mm
    monkeypatch.setattr(fp8_gemm, "dynamic_w8a8_gemm", lambda *a, **k: calls.append("gemm") or real_gemm(*a, **k))
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append("_scaled_mm") or real_scaled_mm(*a, **k))
    with torch.no_grad():
        scaled_mm_path = model(IDS).float()
    assert calls and set(calls) == {"_scaled_mm"}  # nothing tuned: _scaled_mm
    calls.clear()
    tuned = []
    monkeypatch.setattr(fp8_gemm, "tuned_tiles", lambda kind, m, n, k, device: tuned.append(kind) or TILES_INTERPRET)
    with torch.no_grad():
        triton_path = model(IDS).float()
    assert calls and set(calls) == {"gemm"} and set(tuned) == {"w8a8"}
    assert sqnr_db(qwen2_reference_logits, triton_path) >= 18
    # the same FP8 operands and scales as _scaled_mm's, only the float32 summation order differs; a last-bit
    # difference of a bf16 output can move the next layer's FP8 rounding, hence the W8A8 bound of the test above
    assert sqnr_db(scaled_mm_path, triton_path) >= 20
