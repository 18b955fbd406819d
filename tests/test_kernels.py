"""Triton kernels against the torch reference, bit for bit (interpreter on CPU, compiled on CUDA)."""

import pytest
import torch

from kernels import NonFiniteError, fp8_quantize_per_tensor, scale_from_amax
from kernels.fp8 import amax_triton, quantize_triton
from kernels.reference import FP8_E4M3_MAX, amax, quantize

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _bits(q):
    return q.view(torch.uint8)


def _check(w):
    q_ref, s_ref = fp8_quantize_per_tensor(w, "torch")
    q_tri, s_tri = fp8_quantize_per_tensor(w, "triton")
    assert torch.equal(s_ref, s_tri)
    assert torch.equal(_bits(q_ref), _bits(q_tri))
    return q_ref, s_ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 1), (7, 13), (257, 4099)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_random_odd_shapes(shape, dtype, device):
    g = torch.Generator().manual_seed(sum(shape))
    _check((torch.randn(shape, generator=g) * 3).to(dtype).to(device))


@pytest.mark.parametrize("device", DEVICES)
def test_all_zero_tensor(device):
    q, s = _check(torch.zeros(7, 13, dtype=torch.bfloat16, device=device))
    assert s.item() == 1.0 and not _bits(q).any()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("magnitude", [1e-38, 1e-30, 1e-6, 1e6, 1e30, 3e38])
def test_tiny_and_huge_magnitudes(magnitude, device):
    g = torch.Generator().manual_seed(0)
    r = torch.randn(33, 65, generator=g, dtype=torch.float64)
    w = (r / r.abs().max() * magnitude).to(torch.bfloat16).to(device)  # largest |w| == magnitude
    q, s = _check(w)
    assert torch.isfinite(s).all() and s.item() > 0
    assert torch.isfinite(q.float()).all()


@pytest.mark.parametrize("device", DEVICES)
def test_every_rounding_boundary_with_unit_scale(device):
    # dense sweep across the whole e4m3 range, plus values that carry into the next binade
    # (125.07 -> 128 in torch; Triton's interpreter cast gives 64), signed zeros, subnormals, saturation
    x = torch.linspace(-460, 460, 300_001)
    special = torch.tensor([125.07, 239.9, -0.0, 0.0, 1e-40, -1e-40, 2.0 ** -10, 3 * 2.0 ** -11,
                            -(2.0 ** -10), 448.0, -448.0, 464.0, 1e30, -1e30])
    x = torch.cat([x, special]).to(device)
    one = torch.ones((), device=device)
    assert torch.equal(_bits(quantize(x, one)), _bits(quantize_triton(x, one)))


@pytest.mark.parametrize("device", DEVICES)
def test_amax_matches_and_non_finite_is_rejected(device):
    w = torch.randn(100, 37).to(device)
    assert torch.equal(amax(w), amax_triton(w))
    for bad in (float("nan"), float("inf"), -float("inf")):
        x = w.clone()
        x[50, 3] = bad
        assert not torch.isfinite(amax(x))
        assert not torch.isfinite(amax_triton(x))
        with pytest.raises(NonFiniteError):
            scale_from_amax(amax(x))


def test_reference_definition():
    w = torch.tensor([[-2.0, 0.5], [1.0, 0.25]], dtype=torch.bfloat16)
    q, s = fp8_quantize_per_tensor(w)
    assert s.item() == pytest.approx(2.0 / FP8_E4M3_MAX)
    assert q.float().tolist() == [[-448.0, 112.0], [224.0, 56.0]]


def test_wrapper_checks_inputs():
    with pytest.raises(ValueError, match="contiguous"):
        quantize_triton(torch.randn(8, 8).t(), torch.ones(()))
    with pytest.raises(TypeError, match="bf16/fp16/fp32"):
        amax_triton(torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="one scale"):
        quantize_triton(torch.randn(4), torch.ones(2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")
def test_compiled_triton_equals_interpreted_triton():
    w = torch.randn(257, 4099, dtype=torch.bfloat16)
    q_cpu, s_cpu = fp8_quantize_per_tensor(w, "triton")
    q_gpu, s_gpu = fp8_quantize_per_tensor(w.cuda(), "triton")
    assert torch.equal(s_cpu, s_gpu.cpu()) and torch.equal(_bits(q_cpu), _bits(q_gpu).cpu())


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_input_is_not_modified(kernel, dtype):
    w = torch.randn(64, 33).to(dtype)
    before = w.clone()
    fp8_quantize_per_tensor(w, kernel)
    assert torch.equal(w, before)
