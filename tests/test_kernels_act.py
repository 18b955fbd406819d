"""Fused dynamic activation quantization (kernels/fp8_act.py) against torch, bit for bit.

Interpreted on CPU, compiled on CUDA. Two independent oracles: the reference path the CPU forward
runs (kernels.reference.activation_scale + quantize) and torch's own float8 cast of x / scale with
the scale recomputed here from x.abs().amax().
"""

import pytest
import torch

from layerwise.kernels import reference
from layerwise.kernels.fp8_act import MAX_PARTIALS, quantize_activation

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
GRANULARITIES = ("token", "group", "tensor")
SHAPES = [(1, 1), (3, 13), (8, 300), (37, 257)]  # K not a multiple of 128 (group tails)


def _bits(t):
    return t.reshape(-1).view(torch.uint8).cpu()


def _torch_cast(x: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and bytes written out with torch ops only (the independent oracle)."""
    x = x.float().cpu()
    m, k = x.shape
    if granularity == "tensor":
        amax = x.abs().amax().reshape(1)
        expanded = amax
    elif granularity == "token":
        amax = x.abs().amax(dim=1, keepdim=True)
        expanded = amax
    else:
        groups = -(-k // 128)
        amax = torch.stack([x[:, g * 128 : (g + 1) * 128].abs().amax(dim=1) for g in range(groups)], dim=1)
        expanded = amax.repeat_interleave(128, dim=1)[:, :k]
    tiny = torch.finfo(torch.float32).tiny
    scale = torch.clamp(amax / torch.tensor(448.0), min=tiny)
    expanded = torch.clamp(expanded / torch.tensor(448.0), min=tiny)
    return (x / expanded).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _check(x, granularity):
    q, s = quantize_activation(x, granularity)
    q_ref, s_ref = reference.quantize_activation(x, granularity)
    assert s.dtype == torch.float32 and s.shape == s_ref.shape
    assert torch.equal(s.cpu(), s_ref.cpu())
    assert torch.equal(_bits(q), _bits(q_ref))
    q_cast, s_cast = _torch_cast(x, granularity)
    assert torch.equal(s.cpu(), s_cast) and torch.equal(_bits(q), _bits(q_cast))
    return q, s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_shapes_bit_exact(dtype, granularity, device):
    g = torch.Generator().manual_seed(5)
    for shape in SHAPES:
        x = (torch.randn(shape, generator=g) * 4).to(dtype)
        x.view(-1)[0] = 125.07  # rounds up into the next binade
        _check(x.to(device), granularity)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_zero_rows_get_the_tiny_scale_and_stay_zero(granularity, device):
    x = torch.randn(9, 260, generator=torch.Generator().manual_seed(2)).bfloat16()
    x[3] = 0
    x[5, 128:256] = 0  # one all-zero group inside a live row
    q, s = _check(x.to(device), granularity)
    assert not _bits(q.view(9, 260)[3]).any()
    tiny = torch.finfo(torch.float32).tiny
    if granularity == "token":
        assert s[3, 0].item() == tiny
    if granularity == "group":
        assert s[3].eq(tiny).all() and s[5, 1].item() == tiny
    assert torch.equal(
        _bits(quantize_activation(torch.zeros(4, 16, device=device), granularity)[0]), _bits(q)[:0].new_zeros(64)
    )


@pytest.mark.parametrize("device", DEVICES)
def test_rounding_sweep_and_magnitudes(device):
    # a dense sweep of values per row, rows of very different magnitude (subnormal bf16 to 1e30)
    sweep = torch.linspace(-1, 1, 3001)
    rows = torch.stack([sweep * m for m in (1e-40, 1e-30, 1e-6, 1.0, 125.07, 448.0, 1e6, 1e30)])
    rows[:, 17] = -0.0
    for granularity in GRANULARITIES:
        _check(rows.to(device), granularity)
        _check(rows.bfloat16().to(device), granularity)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("max_partials", [4, MAX_PARTIALS])
def test_per_tensor_reduces_over_more_programs_than_one(device, max_partials, monkeypatch):
    # more row blocks than programs: programs stride over rows; the max sits in the last row. With the
    # shipped MAX_PARTIALS only on CUDA (the interpreter would take ~10 s for 16k rows).
    from layerwise.kernels import fp8_act

    if device == "cpu" and max_partials == MAX_PARTIALS:
        pytest.skip("interpreter: the small bound covers the same code")
    monkeypatch.setattr(fp8_act, "MAX_PARTIALS", max_partials)
    rows = fp8_act.act_tile(torch.device(device))[0] * (max_partials + 3)
    x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(3))
    x[-1, 2] = 1000.0
    _check(x.to(device), "tensor")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_non_finite_rows_stay_non_finite(granularity, device):
    x = torch.randn(4, 200, generator=torch.Generator().manual_seed(4))
    x[1, 7], x[2, 9] = float("nan"), float("inf")
    q, s = quantize_activation(x.to(device), granularity)
    deq = q.float().cpu()
    assert torch.isnan(deq[1, 7]) and torch.isnan(deq[2, 9])  # inf / inf: NaN, as in torch
    assert not torch.isfinite(s).all()


def test_bad_input():
    with pytest.raises(ValueError, match="granularity"):
        quantize_activation(torch.ones(2, 2), "channel")
    with pytest.raises(ValueError, match="2-D"):
        quantize_activation(torch.ones(2, 2, 2), "token")
    with pytest.raises(TypeError):
        quantize_activation(torch.ones(2, 2, dtype=torch.int32), "token")
