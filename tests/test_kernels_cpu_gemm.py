"""The native CPU FP8 W8A16 GEMM (kernels/_cpu_fp8.c linear_fp8) against torch's own float8 cast and float32 matmul."""

import pytest
import torch
import torch.nn.functional as F

import layerwise
from layerwise.kernels import cpu_native

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (M, N, K): M = 1, 3, 64, 300 rows; N and K not multiples of 8, 16 or 128 (and some that are)
SHAPES = [(1, 5, 7), (3, 130, 200), (64, 300, 257), (300, 67, 129), (8, 256, 384), (2, 3, 1031)]

native = pytest.mark.skipif(not cpu_native.available(), reason="the _cpu_fp8 extension is not built")
# the AVX2 kernels where this CPU has them, and the plain C ones everywhere
PATHS = [pytest.param(False, id="best"), pytest.param(True, id="portable")]


def _scale(granularity, n, k, generator):
    """float32 scales of the layout, spread over a few binades."""
    if granularity == "tensor":
        shape = (1,)
    elif granularity == "channel":
        shape = (n, 1)
    else:
        shape = (-(-n // 128), -(-k // 128))
    return torch.exp2(torch.empty(shape).uniform_(-12, -4, generator=generator))


def _expand(scale, n, k):
    """The scale per weight element, [N, K], written out independently of kernels/reference.py."""
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(n, k)
    if scale.shape == (n, 1):
        return scale.expand(n, k)
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]


def _weight(n, k, scale, generator):
    """e4m3fn [N, K]: a normal weight through torch's own cast, with every finite e4m3 byte somewhere in it (both zeros
    and the subnormals included)."""
    w = torch.randn(n, k, generator=generator) * 100 * _expand(scale, n, k)
    q = (w / _expand(scale, n, k)).clamp(-448, 448).to(FP8)
    every = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    flat = q.view(torch.uint8).reshape(-1)
    count = min(flat.numel(), every.numel())
    flat[torch.randperm(flat.numel(), generator=generator)[:count]] = every[:count]
    return q


def _reference(x, q, scale, bias):
    """F.linear in float32 of x and torch's own float8 -> float32 cast times the expanded scale."""
    n, k = q.shape
    return F.linear(x.float(), q.float() * _expand(scale, n, k), None if bias is None else bias.float())


def _magnitude(x, q, scale, bias):
    """sum_k |x| |w| + |bias|: what float32 rounding errors of the sum scale with."""
    n, k = q.shape
    out = F.linear(x.float().abs(), (q.float() * _expand(scale, n, k)).abs())
    return out if bias is None else out + bias.float().abs()


def _ulp(t):
    """One unit in the last place of each element of a bfloat16 or float16 tensor (of its smallest normal at 0)."""
    info = torch.finfo(t.dtype)
    a = t.float().abs().clamp_min(info.tiny)
    return torch.exp2(torch.floor(torch.log2(a))) * info.eps


def _assert_close(y, x, q, scale, bias):
    ref = _reference(x, q, scale, bias)
    tol = 1e-5 * _magnitude(x, q, scale, bias) + 1e-30
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], q.shape[0])
    if x.dtype == torch.float32:
        err = (y - ref).abs()
    else:  # the reference rounded to x's dtype; one ulp of it apart (plus the float32 tolerance, for cancellations)
        rounded = ref.to(x.dtype)
        err = (y.float() - rounded.float()).abs() - _ulp(rounded)
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} off, worst {float((err - tol).max())}"


@native
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_linear_fp8_equals_float32_matmul_of_torchs_cast(shape, granularity, dtype, portable):
    m, n, k = shape
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    scale = _scale(granularity, n, k, g)
    q = _weight(n, k, scale, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    _assert_close(cpu_native.linear_fp8(x, q, scale, portable=portable), x, q, scale, None)
    _assert_close(cpu_native.linear_fp8(x, q, scale, bias, portable=portable), x, q, scale, bias)


@native
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_and_batched_x(dtype, portable):
    g = torch.Generator().manual_seed(5)
    n, k = 70, 136
    scale = _scale("block", n, k, g)
    q = _weight(n, k, scale, g)
    bias = torch.randn(n, generator=g)  # a float32 bias with bfloat16 / float16 x
    wide = torch.randn(9, k + 24, generator=g).to(dtype)
    views = [
        wide[:, 5 : 5 + k],  # rows farther apart than k: read in place
        wide[:, : 2 * k : 2][:, : k // 2].repeat(1, 2),  # a copy, for the shapes
        torch.randn(k, 9, generator=g).to(dtype).t(),  # columns adjacent: copied first
        wide[:, :k].reshape(3, 3, k),  # [..., K]
        wide[2, :k],  # one row, 1-D
        wide[:1, :k].expand(4, k),  # rows that overlap
    ]
    for x in views:
        _assert_close(cpu_native.linear_fp8(x, q, scale, bias, portable=portable), x, q, scale, bias)
    # an empty batch
    assert cpu_native.linear_fp8(wide[:0, :k], q, scale).shape == (0, n)


@native
@pytest.mark.parametrize("portable", PATHS)
def test_a_row_does_not_depend_on_the_batch_or_the_threads(portable):
    """Every output element is the same sum in the same order whatever M, the row's place and the thread count (the
    rollout of a sequence does not depend on what it is batched with)."""
    g = torch.Generator().manual_seed(6)
    n, k = 200, 300
    scale = _scale("channel", n, k, g)
    q = _weight(n, k, scale, g)
    x = torch.randn(67, k, generator=g).to(torch.bfloat16)
    full = cpu_native.linear_fp8(x, q, scale, portable=portable)
    for i in (0, 5, 66):
        assert torch.equal(cpu_native.linear_fp8(x[i : i + 1], q, scale, portable=portable)[0], full[i])
    assert torch.equal(cpu_native.linear_fp8(x[3:11], q, scale, portable=portable), full[3:11])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_native.linear_fp8(x, q, scale, portable=portable), full)
    finally:
        torch.set_num_threads(threads)


@native
@pytest.mark.parametrize("portable", PATHS)
def test_nan_bytes_give_nan_rows_and_extreme_scales(portable):
    g = torch.Generator().manual_seed(7)
    n, k = 9, 40
    x = torch.randn(3, k, generator=g)
    q = torch.randn(n, k, generator=g).to(FP8)
    q.view(torch.uint8)[2, 17] = 0x7F
    q.view(torch.uint8)[5, 39] = 0xFF  # in the scalar tail of a span
    y = cpu_native.linear_fp8(x, q, torch.ones(1), portable=portable)
    assert y[:, [2, 5]].isnan().all() and not y[:, [0, 1, 3, 4, 6, 7, 8]].isnan().any()
    # subnormal e4m3 bytes times a scale whose 2^8 multiple overflows float32 (the table path), and a float32
    # subnormal scale
    tiny = torch.randint(1, 8, (n, k), generator=g, dtype=torch.uint8).view(FP8)
    for s in (2.0**126, 2.0**-140):
        scale = torch.full((n, 1), s)
        xs = x * 2.0**-110 if s > 1 else x
        _assert_close(cpu_native.linear_fp8(xs, tiny, scale, portable=portable), xs, tiny, scale, None)


@native
def test_what_linear_fp8_refuses():
    q = torch.zeros(16, 32, dtype=FP8)
    x = torch.randn(4, 32)
    s = torch.ones(1)
    assert cpu_native.supports_linear(x, q, s)
    refused = [
        (x, q.t(), s, None),  # a weight that is not contiguous [N, K]
        (x, q, torch.ones(16, 2), None),  # a scale of no layout
        (x, q, torch.ones(1, dtype=torch.float64), None),
        (x.double(), q, s, None),
        (x[:, :16], q, s, None),  # K mismatch
        (x, q, s, torch.zeros(15)),
        (x, q.to(torch.bfloat16), s, None),
        (x.to("meta"), q, s, None),
    ]
    for args in refused:
        assert not cpu_native.supports_linear(*args)
        with pytest.raises(ValueError, match="linear_fp8"):
            cpu_native.linear_fp8(*args)
    # autograd: the kernel records no graph, so it refuses x that needs a gradient (unless grad is off)
    xg = x.clone().requires_grad_()
    assert not cpu_native.supports_linear(xg, q, s)
    with torch.no_grad():
        assert cpu_native.supports_linear(xg, q, s)


def test_without_the_extension_nothing_is_taken(monkeypatch):
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    assert cpu_native.gemm_path() is None
    assert not cpu_native.supports_linear(torch.randn(2, 16), torch.zeros(8, 16, dtype=FP8), torch.ones(1))


SCHEMES = {"fp8": "tensor", "fp8-per-channel": "channel", "fp8-per-block": "block"}


@native
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_model_logits_through_the_fused_path_match_dequantize_and_linear(hf_checkpoint, scheme, monkeypatch):
    """A loaded FP8 model's forward runs the fused GEMM in every linear, and its logits equal those of the old W8A16
    path (dequantize the weight, then F.linear) up to float32 rounding (float32 model) or bfloat16 rounding."""
    arch, path = hf_checkpoint
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(8))
    calls = []
    fused = cpu_native.linear_fp8
    monkeypatch.setattr(cpu_native, "linear_fp8", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    for dtype in (torch.float32, torch.bfloat16):
        model = layerwise.load_model(path, quantization=scheme, dtype=dtype)
        with torch.no_grad():
            calls.clear()
            new = model(ids).float()
            assert len(calls) == 4 * 2  # qkv, o, gate_up and down of both layers
            with monkeypatch.context() as m:
                m.setattr(cpu_native, "supports_linear", lambda *a: False)
                old = model(ids).float()
            assert len(calls) == 4 * 2
        err = (new - old).abs().max().item()
        bound = (1e-4 if dtype == torch.float32 else 3e-2) * old.abs().max().item()
        assert err <= bound, f"{arch} {scheme} {dtype}: max |diff| {err}, bound {bound}"


@native
def test_a_profile_shows_the_kernel_as_an_operator():
    from torch.profiler import ProfilerActivity, profile

    q, s, x = torch.zeros(16, 32, dtype=FP8), torch.ones(1), torch.randn(4, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        cpu_native.linear_fp8(x, q, s)
    names = [e.key for e in prof.key_averages()]
    assert cpu_native.LINEAR_FP8_PROFILE_NAME in names
