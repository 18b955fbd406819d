"""The CUDA path end to end: loads, logits, compiled Triton kernels, memory release, W8A8 guards.

Skipped without a GPU. What CPU CI proves of the same code: tests/test_kernels_compile.py
(every kernel compiles for sm_80/89/90, 64-bit offsets) and tests/test_kernels.py (the same kernel
source, interpreted, is bit-exact against the torch reference).
"""

import gc
import logging

import pytest
import torch

import layerwise
from layerwise.kernels import GRANULARITIES, fp8_dequantize, fp8_quantize_weight
from layerwise.kernels.fp8_tiles import quantize_triton
from tests.hf_checkpoints import hf_logits, sqnr_db

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMES = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_load_equals_cpu_load_bit_for_bit(hf_checkpoint, scheme, kernel):
    arch, path = hf_checkpoint
    cpu = layerwise.load_model(path, quantization=scheme, kernel="torch").state_dict()
    gpu = layerwise.load_model(path, quantization=scheme, device="cuda", kernel=kernel).state_dict()
    assert list(cpu) == list(gpu)
    for name, t in cpu.items():
        assert gpu[name].device.type == "cuda" and gpu[name].dtype == t.dtype, name
        assert torch.equal(_bytes(t), _bytes(gpu[name])), name


def test_default_kernel_on_cuda_is_triton(hf_checkpoint):
    _, report = layerwise.load_model_with_report(hf_checkpoint[1], quantization="fp8", device="cuda")
    assert report.kernel == "triton"


@pytest.mark.parametrize("fp8_mode", ["auto", "w8a16"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_cuda_logits_against_transformers(hf_checkpoint, scheme, fp8_mode):
    arch, path = hf_checkpoint
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(path, ids)
    model = layerwise.load_model(path, quantization=scheme, device="cuda", fp8_mode=fp8_mode)
    with torch.no_grad():
        out = model(ids.cuda()).float().cpu()
    assert sqnr_db(ref, out) >= 18, (arch, scheme, fp8_mode)
    unquantized = layerwise.load_model(path, quantization=None, device="cuda", dtype=torch.float32)
    with torch.no_grad():
        err = (unquantized(ids.cuda()).cpu() - ref).abs().max().item()
    assert err <= 1e-3 * ref.abs().max().item()  # TF32 may be on: looser than the CPU bound of 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_compiled_triton_equals_cpu_reference(granularity, dtype):
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(257, 4099, generator=g) * 3).to(dtype)
    w[3, :5] = torch.tensor([125.07, -0.0, 1e-40, 448.0, -1e4])  # carry, signed zero, subnormal, saturation
    q_cpu, s_cpu = fp8_quantize_weight(w, granularity, "torch")
    q_gpu, s_gpu = fp8_quantize_weight(w.cuda(), granularity, "triton")
    assert torch.equal(s_cpu, s_gpu.cpu()) and torch.equal(_bytes(q_cpu), _bytes(q_gpu))
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        expected = fp8_dequantize(q_cpu, s_cpu, out_dtype, "torch")
        got = fp8_dequantize(q_gpu, s_gpu, out_dtype, "triton")
        assert torch.equal(_bytes(expected), _bytes(got)), out_dtype


def test_tensor_over_2_pow_31_elements():
    rows, cols = (2**31) // 16384 + 1, 16384  # a 128256 x 16384 embedding is of this size class
    w = torch.empty(rows, cols, dtype=torch.bfloat16, device="cuda")
    w[:-2].fill_(0.5)
    tail = torch.randn(2, cols, generator=torch.Generator().manual_seed(1)).bfloat16()
    w[-2:] = tail.cuda()
    q, scale = fp8_quantize_weight(w, "tensor", "triton")
    assert torch.equal(scale.cpu(), tail.float().abs().max().clamp(min=0.5) / 448)
    expected_tail = (tail.float() / scale.cpu()).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(_bytes(q[-2:]), _bytes(expected_tail))  # elements past 2^31 were written
    out = torch.empty_like(q)
    quantize_triton(w, scale, out)
    assert torch.equal(_bytes(out[-2:]), _bytes(expected_tail))


def test_deleted_model_returns_cuda_memory(hf_checkpoint):
    torch.cuda.synchronize()
    gc.collect()
    baseline = torch.cuda.memory_allocated()
    model = layerwise.load_model(hf_checkpoint[1], quantization="fp8", device="cuda")
    layerwise.reload_weights(model, hf_checkpoint[1])
    assert torch.cuda.memory_allocated() > baseline
    del model
    gc.collect()
    assert torch.cuda.memory_allocated() == baseline


def test_fp16_per_channel_w8a8_falls_back_with_one_warning(hf_checkpoint, caplog, monkeypatch):
    import layerwise.quant.fp8 as quant_fp8

    monkeypatch.setattr(quant_fp8, "_WARNED", set())
    path = hf_checkpoint[1]
    model = layerwise.load_model(
        path, quantization="fp8-per-channel", device="cuda", dtype=torch.float16, fp8_mode="w8a8"
    )
    ids = torch.randint(0, 128, (1, 8), device="cuda")
    with caplog.at_level(logging.WARNING, logger="layerwise.quant.fp8"):
        with torch.no_grad():
            out = model(ids)
            model(ids)
    assert out.dtype == torch.float16 and bool(torch.isfinite(out).all())
    assert sum("W8A16" in r.getMessage() for r in caplog.records) == 1
