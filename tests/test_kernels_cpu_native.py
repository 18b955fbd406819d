"""The native CPU kernels (kernels/_cpu_fp8.c) against torch's own float8 cast and float32 reductions."""

import shlex
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import layerwise
from layerwise import kernels
from layerwise.kernels import cpu_native, reference

FP8 = torch.float8_e4m3fn


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


def _own_cast(x, expanded_scale):
    """torch's own formula, the independent reference: clamp(float32(x) / scale) cast to e4m3fn."""
    return (x.float() / expanded_scale).clamp(-448, 448).to(FP8)


def _expand(scale, granularity, shape):
    if granularity == "tensor":
        return scale.reshape(())
    if granularity == "channel":
        return scale
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]


def _every_bf16():
    """All 65536 bfloat16 bit patterns (NaNs, +-Inf, subnormals, both zeros) as a [256, 256] tensor."""
    return torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)


def _can_build() -> bool:
    """A C compiler, the Python headers and Linux (OpenMP with gcc): where pip install must build the extension."""
    cc = sysconfig.get_config_var("CC") or "cc"
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return sys.platform.startswith("linux") and shutil.which(shlex.split(cc)[0]) is not None and headers.exists()


native = pytest.mark.skipif(not cpu_native.available(), reason="the _cpu_fp8 extension is not built")


def test_extension_is_built_where_a_compiler_is():
    # an install on a machine with a C compiler must build it: otherwise the fast path silently is the reference
    if not _can_build():
        pytest.skip("no C compiler, Python headers or Linux: the extension is optional and the reference runs")
    assert cpu_native.available(), "kernels/_cpu_fp8.c was not built: reinstall with `pip install -e .`"


@native
def test_every_bf16_pattern_quantizes_as_torch_casts():
    x = _every_bf16()
    finite = x.float().isfinite()
    scales = [1.0, 448.0 / 3e38, torch.finfo(torch.float32).tiny, 2.0**-133, 1e-3, 0.37, 7.0, 2.0**100, 3e38 / 448]
    scales += [2.0**126 * 1.99, 2.0**127, 3e38, torch.finfo(torch.float32).max]  # scales of the top binades
    g = torch.Generator().manual_seed(0)
    scales += torch.exp(torch.empty(64).uniform_(-85, 85, generator=g)).tolist()
    for s in scales:
        scale = torch.tensor(s, dtype=torch.float32)
        got = cpu_native.quantize(x, scale, "tensor")
        assert torch.equal(_bits(got), _bits(_own_cast(x, scale))), s
        # the in-range conversion (a scale from the weight's own amax): every pattern with finite |x / s| < 464
        ok = x.reshape(-1)[(x.float().reshape(-1) / scale).abs() < 464].contiguous()
        fast = cpu_native.quantize(ok, scale, "tensor", within_range=True)
        assert torch.equal(_bits(fast), _bits(_own_cast(ok, scale))), s
    # per channel: a different scale per row; per block: 2 x 2 blocks
    row_scales = torch.exp(torch.empty(256, 1).uniform_(-60, 60, generator=g))
    assert torch.equal(_bits(cpu_native.quantize(x, row_scales, "channel")), _bits(_own_cast(x, row_scales)))
    block_scales = torch.exp(torch.empty(2, 2).uniform_(-60, 60, generator=g))
    want = _own_cast(x, _expand(block_scales, "block", x.shape))
    assert torch.equal(_bits(cpu_native.quantize(x, block_scales, "block")), _bits(want))
    assert bool(finite.any())


@native
def test_float32_rounding_ties_and_edges_quantize_as_torch_casts():
    # every e4m3 value's neighbourhood: the exact midpoints between grid points (ties to even), an ulp either
    # side, the subnormal grid (2^-9 steps), values at and above 448 and 464, and the specials
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    ulp = lambda v, d: torch.nextafter(v, torch.full_like(v, d))
    vals = torch.cat([grid, mids, ulp(mids, 1e9), ulp(mids, -1e9), torch.tensor([448.0, 463.99, 464.0, 464.01, 479.9])])
    vals = torch.cat([vals, -vals, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, 3e38])])
    x = vals.reshape(1, -1).contiguous()
    for s in (1.0, 0.5, 2.0**-10, 3.0):
        scale = torch.tensor(s)
        want = _own_cast(x * s, scale)  # * s then / s is exact for powers of two; 3.0 checks a real division
        assert torch.equal(_bits(cpu_native.quantize((x * s).contiguous(), scale, "tensor")), _bits(want)), s
        inside = (x.abs() < 464).reshape(-1)  # NaN compares False: finite values below 464 only
        y = (x.reshape(-1)[inside] * s).contiguous()
        fast = cpu_native.quantize(y, scale, "tensor", within_range=True)
        assert torch.equal(_bits(fast), _bits(want.reshape(-1)[inside])), s


@native
@pytest.mark.parametrize("granularity", reference.GRANULARITIES)
@pytest.mark.parametrize("headroom", [False, True])
@pytest.mark.parametrize("order", ["sorted", "shuffled"])
def test_in_range_quantize_of_every_finite_bf16(granularity, headroom, order):
    # The in-range conversion (a scale from the weight's own amax) of every finite bfloat16 pattern, as torch casts
    # it. Sorted by value, each 64-element vector holds neighbouring magnitudes, which the table covers (the
    # table path where the CPU has it); shuffled, vectors mix binades, zeros and subnormals and take the exact
    # path. The scales are the weight's own (a load's) and, with `headroom`, up to 2^24 times larger (still in
    # range, kept finite): more elements fall below the table's lowest binade, and scales reach 2^127 and above.
    x = _every_bf16().reshape(-1)
    g = torch.Generator().manual_seed(11)
    x = x[x.float().isfinite()]
    x = x.sort().values if order == "sorted" else x[torch.randperm(x.numel(), generator=g)]
    x = x[: 85 * 768].reshape(85, 768).contiguous()  # rows long enough for a table of their own
    scale = reference.scale_from_amax(reference.amax(x, granularity))
    if headroom:
        factor = torch.exp2(torch.randint(0, 25, scale.shape, generator=g).float())
        scale = (scale * factor).clamp(max=torch.finfo(torch.float32).max)
        assert scale.isfinite().all() and bool((scale >= 2.0**127).any())
    got = cpu_native.quantize(x, scale, granularity, within_range=True)
    assert torch.equal(_bits(got), _bits(_own_cast(x, _expand(scale, granularity, x.shape))))


def test_the_table_path_runs_where_the_cpu_has_avx512_vbmi():
    # the fast in-range conversion must not silently fall back to the exact one on a CPU that can run it
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not cpu_native.available() or " avx512vbmi " not in flags.replace("\n", " "):
        pytest.skip("no extension or no AVX-512 VBMI: the exact conversion runs")
    assert cpu_native.table_path()


@native
@pytest.mark.parametrize("granularity", reference.GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 3])
def test_amax_and_quantize_of_a_ragged_weight_split_over_threads(granularity, dtype, threads):
    # 1030 x 1100: ragged in both dims for 128-blocks, and > 2^19 elements so 3 threads each get a range
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(1030, 1100, generator=g) * 0.02).to(dtype)
    w[1029, 1099] = -1.5  # the last element is the largest: the last thread's range must count
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        amax = cpu_native.amax(w, granularity)
        a = w.float().abs()
        if granularity == "tensor":
            want = a.amax()
        elif granularity == "channel":
            want = a.amax(dim=1, keepdim=True)
        else:
            p = torch.nn.functional.pad(a, (0, -1100 % 128, 0, -1030 % 128))
            want = p.view(p.shape[0] // 128, 128, p.shape[1] // 128, 128).amax(dim=(1, 3))
        assert amax.shape == want.shape and torch.equal(amax, want)
        scale = reference.scale_from_amax(want)
        q = cpu_native.quantize(w, scale, granularity)
        assert torch.equal(_bits(q), _bits(_own_cast(w, _expand(scale, granularity, w.shape))))
    finally:
        torch.set_num_threads(previous)


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 3])
def test_scale_quantize_equals_torchs_cast_with_each_rows_scale(dtype, threads):
    # the fused per-channel pass: every finite bfloat16 (rows of 768, sorted so that the table path runs, then
    # shuffled), and a ragged 1030 x 1100 weight split over threads; scales as the reference's, bytes as torch casts
    g = torch.Generator().manual_seed(12)
    x = _every_bf16().reshape(-1)
    x = x[x.float().isfinite()]
    weights = [x.sort().values[: 85 * 768], x[torch.randperm(x.numel(), generator=g)][: 85 * 768]]
    weights = [w.reshape(85, 768).to(dtype).contiguous() for w in weights]
    weights.append((torch.randn(1030, 1100, generator=g) * 0.02).to(dtype))
    weights[-1][1029, 1099] = -1.5  # the last row's last element: the last thread's range must count
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for w in weights:
            out = torch.empty(w.shape, dtype=FP8)
            scale = cpu_native.scale_quantize(w, out)
            want = reference.scale_from_amax(w.float().abs().amax(dim=1, keepdim=True))
            assert torch.equal(scale, want)
            assert torch.equal(_bits(out), _bits(_own_cast(w, want)))
    finally:
        torch.set_num_threads(previous)


@native
def test_scale_quantize_writes_into_a_slice_of_scales_and_raises_on_a_non_finite_row():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(13)).bfloat16()
    scales = torch.zeros(400, 1)
    out = torch.empty(w.shape, dtype=FP8)
    got = cpu_native.scale_quantize(w, out, scales[100:])
    assert got.data_ptr() == scales[100:].data_ptr() and not scales[:100].any()
    assert torch.equal(scales[100:], reference.scale_from_amax(reference.amax(w, "channel")))
    with pytest.raises(ValueError, match="scale_out"):
        cpu_native.scale_quantize(w, out, scales[:300].t())  # not [300, 1]
    w[150, 7] = float("nan")
    with pytest.raises(layerwise.NonFiniteWeightError):
        cpu_native.scale_quantize(w, out)
    w[150, 7] = float("inf")
    with pytest.raises(layerwise.NonFiniteWeightError):
        cpu_native.scale_quantize(w, out)


@native
@pytest.mark.parametrize("granularity", reference.GRANULARITIES)
def test_amax_of_nan_and_inf_groups(granularity):
    w = torch.ones(256, 384, dtype=torch.bfloat16)
    w[3, 5], w[200, 300] = float("nan"), -float("inf")
    amax = cpu_native.amax(w, granularity).reshape(-1)
    if granularity == "tensor":
        assert amax.isnan().all()
    elif granularity == "channel":
        assert amax[3].isnan() and amax[200] == float("inf") and (amax[[0, 4, 255]] == 1).all()
    else:  # blocks (0, 0) and (1, 2)
        assert amax[0].isnan() and amax[5] == float("inf") and (amax[[1, 2, 3, 4]] == 1).all()
    assert kernels.has_non_finite(w) and not kernels.has_non_finite(torch.ones(3, dtype=torch.bfloat16))


@native
def test_dispatch_takes_the_native_path_and_writes_out_in_place(monkeypatch):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(300, 200, generator=g).bfloat16()
    q, scale = kernels.fp8_quantize_weight(w, "block")
    expert = torch.zeros(2, 300, 200, dtype=FP8)
    got = kernels.fp8_quantize(w, scale, out=expert[1])
    assert got.data_ptr() == expert[1].data_ptr() and torch.equal(_bits(expert[1]), _bits(q))
    calls = []
    monkeypatch.setattr(cpu_native, "quantize", lambda *a, **k: calls.append(1))
    kernels.fp8_quantize(w, scale)  # bf16, contiguous, CPU: native
    kernels.fp8_quantize(w.t(), scale.t().contiguous())  # not contiguous: the reference
    kernels.fp8_quantize(w.half(), scale)  # float16: the reference
    assert calls == [1]


def test_without_the_extension_the_reference_runs(monkeypatch):
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    w = torch.randn(40, 300, generator=torch.Generator().manual_seed(7)).bfloat16()
    q, scale = kernels.fp8_quantize_weight(w, "channel")
    assert torch.equal(_bits(q), _bits(_own_cast(w, scale)))


@native
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_extension_runs_on_torchs_openmp_runtime():
    # a second libgomp would bring its own thread team, competing with torch's spinning threads
    cpu_native.quantize(torch.ones(1024, 1024, dtype=torch.bfloat16), torch.ones(()), "tensor")
    with open("/proc/self/maps") as maps:
        runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line or "libomp" in line}
    assert len(runtimes) <= 1, runtimes


@native
def test_scale_equals_the_recipe_for_zero_tiny_and_huge_amaxes():
    # one row per amax: 0 (scale 1.0), below 448 * tiny (clamped to tiny), subnormal, ordinary, near max
    g = torch.Generator().manual_seed(8)
    amaxes = torch.cat(
        [
            torch.tensor([0.0, 1e-45, 1e-40, 448 * 1.17e-38, 5e-36, 3.4e38]),
            torch.exp(torch.empty(250).uniform_(-87, 88, generator=g)),
        ]
    )
    w = torch.zeros(len(amaxes), 3)
    w[:, 1] = -amaxes
    want = torch.clamp(amaxes / torch.tensor(448.0), min=torch.finfo(torch.float32).tiny)  # the recipe, in torch
    want = torch.where(amaxes > 0, want, torch.ones_like(want))[:, None]
    assert torch.equal(cpu_native.scale(w, "channel"), want)
    assert torch.equal(kernels.fp8_scale(w, "channel"), want)
    assert torch.equal(kernels.scale_from_amax(amaxes[:, None]), want)  # the dispatcher's native path
    w[7, 2] = float("inf")
    with pytest.raises(layerwise.NonFiniteWeightError):
        cpu_native.scale(w, "channel")


@native
@pytest.mark.parametrize("threads", [1, 3])
def test_copy_checked_copies_every_bf16_pattern_and_finds_each_non_finite_one(threads):
    # all 65536 bit patterns, repeated to > 2^19 elements so 3 threads each get a range; then one pattern at a time
    # at the very end (the last thread's range) for every NaN and Inf pattern
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    src = every.repeat(9)
    finite = torch.isfinite(src.float())
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        dst = torch.empty_like(src)
        assert cpu_native.copy_checked(src, dst) is False and torch.equal(_bits(dst), _bits(src))
        clean = src[finite].contiguous()
        out = torch.empty_like(clean)
        assert cpu_native.copy_checked(clean, out) is True and torch.equal(_bits(out), _bits(clean))
        for bad in every[~torch.isfinite(every.float())].view(torch.int16).tolist():  # 256: Inf and NaN, both signs
            clean.view(torch.int16)[-1] = bad
            assert cpu_native.copy_checked(clean, out) is False, hex(bad & 0xFFFF)
    finally:
        torch.set_num_threads(previous)


@native
def test_copy_checked_of_float32_and_refusals():
    src = torch.tensor([0.0, -0.0, 1e-45, 3.4028235e38, -3.4028235e38, 7.5])
    dst = torch.empty_like(src)
    assert cpu_native.copy_checked(src, dst) is True and torch.equal(_bits(dst), _bits(src))
    for special in (float("nan"), float("inf"), float("-inf")):
        assert cpu_native.copy_checked(torch.cat([src, torch.tensor([special])]), torch.empty(7)) is False
    with pytest.raises(ValueError, match="cannot copy"):
        cpu_native.copy_checked(src, torch.empty(6, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cannot copy"):
        cpu_native.copy_checked(src, torch.empty(5))
    assert not cpu_native.supports_copy(src, torch.empty(12)[::2])  # not contiguous


@native
def test_a_batch_of_pieces_is_refused_unless_every_piece_is_a_plain_contiguous_cpu_tensor():
    # the batch kernels read raw pointers: one unfit piece anywhere sends the whole batch to the per-weight path
    def ok():
        return torch.ones(4, 8, dtype=torch.bfloat16)

    assert cpu_native.supports_batch([[(0, ok())], [(0, ok()[:2]), (16, ok()[2:])]])
    unfit = {
        "non-contiguous": torch.ones(8, 4, dtype=torch.bfloat16).t(),
        "float16": torch.ones(4, 8, dtype=torch.float16),
        "another dtype than the first": torch.ones(4, 8),
        "empty": torch.ones(0, 8, dtype=torch.bfloat16),
        "meta": torch.ones(4, 8, dtype=torch.bfloat16, device="meta"),
    }
    for what, t in unfit.items():
        assert not cpu_native.supports_batch([[(0, ok())], [(0, t)]]), what
        with pytest.raises(ValueError):
            cpu_native.amax_batch([[(0, ok())], [(0, t)]], (4, 8), "tensor")
    assert not cpu_native.supports_batch([[(0, torch.ones(4, 8))]] * 0) and not cpu_native.supports_batch([[]])


def test_granularity_codes_are_the_ones_the_kernels_hard_code():
    """_cpu_fp8.c (``granularity``) and the Triton kernels (``SCALE_MODE``; fp8_gemm uses the per-tensor code 0 as
    a scale stride) read these numbers: reordering GRANULARITIES must not change them silently."""
    from layerwise.kernels.reference import GRANULARITY_CODES

    assert GRANULARITY_CODES == {"tensor": 0, "channel": 1, "block": 2}
