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
from tests.engine_helpers import greedy
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


# --- the fused FP8 forward (kernels/fp8_act.py, kernels/fp8_gemm.py) compiled on the GPU ---

FORWARD_CASES = [
    ("fp8-per-tensor", "auto", "_scaled_mm"),  # fused per-tensor activation quant + torch._scaled_mm
    ("fp8-per-channel", "auto", "_scaled_mm"),  # fused per-token activation quant + row-wise _scaled_mm
    ("fp8-per-block", "auto", "w8a8_gemm"),  # per-group activation quant + block-scaled FP8 GEMM
    ("fp8-per-block", "w8a8", "w8a8_gemm"),
    ("fp8-per-tensor", "w8a16", "w8a16_gemm"),
    ("fp8-per-channel", "w8a16", "w8a16_gemm"),
    ("fp8-per-block", "w8a16", "w8a16_gemm"),
]


def _fp8_gpu() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_gemms_within_the_f64_bound(granularity, dtype):
    from layerwise.kernels import reference
    from layerwise.kernels.fp8_act import quantize_activation
    from layerwise.kernels.fp8_gemm import GemmTiles, dynamic_w8a8_gemm, w8a8_gemm, w8a16_gemm
    from tests.test_kernels_gemm import SHAPES, _operands, assert_close_to_f64

    # (1, 512, 1000): M == 1 reaches the kernels as Triton's constant 1, split K over 8 blocks included
    for i, (m, n, k) in enumerate([*SHAPES, (8, 4096, 4096), (64, 1024, 14336), (300, 640, 1000), (1, 512, 1000)]):
        x, q, s, bias = _operands(m, n, k, dtype, granularity, i)
        w64 = reference.dequantize(q, s, torch.float64)
        split = GemmTiles(16, 64, 128, 4, 4, 3)  # K split in up to 4 runs, the reduction finishing
        for tiles in (None, split):
            y = w8a16_gemm(x.cuda(), q.cuda(), s.cuda(), bias.cuda(), tiles=tiles)
            assert_close_to_f64(y, x.double(), w64, bias.double())
            if not _fp8_gpu():
                continue
            act = {"block": "group", "channel": "token", "tensor": "tensor"}[granularity]
            xq, xs = quantize_activation(x.cuda(), act)
            xs64 = xs.double().cpu()
            x64 = xq.double().cpu() * (xs64.repeat_interleave(128, dim=1)[:, :k] if act == "group" else xs64)
            y = w8a8_gemm(xq, xs, q.cuda(), s.cuda(), dtype, bias.cuda(), tiles=tiles)
            # FP8 tensor cores accumulate each 128-long K step with fewer bits than float32 (DeepSeek-V3
            # reports about 14 on H800): 2^-13 per product bounds it; the scaled steps add in float32
            assert_close_to_f64(y, x64, w64, bias.double(), acc_eps=2.0**-13)
            # x quantized inside the GEMM: the same bytes and scales, so the same output bit for bit
            fused = dynamic_w8a8_gemm(x.cuda(), act, q.cuda(), s.cuda(), bias.cuda(), tiles=tiles)
            assert torch.equal(fused.view(torch.int16), y.view(torch.int16)), (m, n, k, tiles)


@pytest.mark.parametrize("granularity", ["token", "group", "tensor"])
def test_compiled_activation_quant_equals_the_cpu_reference(granularity):
    from layerwise.kernels import reference
    from layerwise.kernels.fp8_act import quantize_activation

    g = torch.Generator().manual_seed(9)
    for m, k in [(1, 4096), (8, 4096), (8, 14336), (77, 1000), (4096, 4096)]:
        x = (torch.randn(m, k, generator=g) * 3).bfloat16()
        x[0, :4] = torch.tensor([125.07, -0.0, 1e-40, -1e4])
        q_cpu, s_cpu = reference.quantize_activation(x, granularity)
        q_gpu, s_gpu = quantize_activation(x.cuda(), granularity)
        assert torch.equal(s_cpu, s_gpu.cpu()) and torch.equal(_bytes(q_cpu), _bytes(q_gpu)), (m, k)


@pytest.mark.parametrize(("scheme", "fp8_mode", "kernel_name"), FORWARD_CASES)
def test_fused_forward_against_transformers(hf_checkpoint, monkeypatch, scheme, fp8_mode, kernel_name):
    import layerwise.kernels.fp8_act as fp8_act
    import layerwise.kernels.fp8_gemm as fp8_gemm

    if kernel_name != "w8a16_gemm" and not _fp8_gpu():
        pytest.skip("W8A8 needs sm_89+")
    calls = []
    for module, name in (
        (fp8_gemm, "w8a16_gemm"), (fp8_gemm, "w8a8_gemm"), (fp8_gemm, "dynamic_w8a8_gemm"),
        (fp8_act, "quantize_activation"),
    ):  # fmt: skip
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    arch, path = hf_checkpoint
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    model = layerwise.load_model(path, quantization=scheme, device="cuda", fp8_mode=fp8_mode)
    with torch.no_grad():
        out = model(ids.cuda()).float().cpu()
    assert sqnr_db(hf_logits(path, ids), out) >= 18, (arch, scheme, fp8_mode)
    expected = {"w8a16_gemm"} if kernel_name == "w8a16_gemm" else {"quantize_activation"}
    if kernel_name == "w8a8_gemm":
        expected.add("w8a8_gemm")
    assert set(calls) == expected, calls


@pytest.mark.parametrize(("scheme", "fp8_mode", "kernel_name"), FORWARD_CASES)
def test_cuda_graph_decode_with_fused_kernels_equals_eager(hf_checkpoint, scheme, fp8_mode, kernel_name):
    from layerwise.engine import Engine

    if kernel_name != "w8a16_gemm" and not _fp8_gpu():
        pytest.skip("W8A8 needs sm_89+")
    model = layerwise.load_model(hf_checkpoint[1], quantization=scheme, device="cuda", fp8_mode=fp8_mode)
    prompts = [[1, 5, 9], [7, 3], [11, 2, 4, 6], [8]]
    graph = Engine(model, max_batch_size=8, max_seq_len=64, use_cuda_graph=True)
    eager = Engine(model, max_batch_size=8, max_seq_len=64, use_cuda_graph=False)
    assert greedy(graph, prompts, 12) == greedy(eager, prompts, 12)
    assert graph.captures == 1
    # one more step from the same state (equal caches after equal tokens): the replayed kernels give eager's
    # logits (the same kernels on the same inputs; a bf16 ulp of slack for a library picking another algorithm)
    ids, pos = graph.runner._ids[:4].clone(), graph.runner._pos[:4].clone()  # the last step's inputs (4 slots)
    with torch.no_grad():
        eager_logits = eager.decode(ids, pos).float().clone()
        graph_logits = graph.decode(ids, pos).float()
    torch.testing.assert_close(graph_logits, eager_logits, rtol=2.0**-7, atol=1e-3)
