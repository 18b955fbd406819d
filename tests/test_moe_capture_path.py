"""The MoE forward that CUDA graphs capture (``apply_all_experts``: every expert on every token, masked by
the routing; no host sync) against the eager expert loop (``apply``), on the CPU.

Bit-equal where each expert GEMM gives a row the same bits whatever the number of rows: bf16 activations,
and float32 with a row-by-row matmul. torch's float32 CPU GEMM (MKL) does not: a row's result depends on
the row count (1 row vs 3 vs 16 measured 3.6e-7 apart at |y| ~ 0.1), so float32 with F.linear is compared
within 8 float32 ulps of the output's magnitude (measured: 3.5). Per-tensor W8A8 quantizes activations with
one scale over the rows it is given (all T rows here, the expert's rows in eager), so it differs by the
activation quantization: bounded in SQNR at the measured level.
"""

import pytest
import torch

import layerwise
from layerwise.kernels import cpu_native
from layerwise.layers.fused_moe import QWEN_EXPERT_SHARDS, FusedMoE
from layerwise.memory import DeviceMemoryTracker
from layerwise.quant.fp8 import cpu_rowwise_scaled_mm
from layerwise.quant.fp8_moe import Fp8MoEMethod
from layerwise.quant.moe_base import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from tests.hf_checkpoints import MOE_ARCHS, sqnr_db, write_hf_checkpoint
from tests.moe_helpers import moe_block

E, H, INTER, TOP_K = 8, 64, 160, 2
F32_ULPS = 8  # float32 F.linear: row results depend on the row count (MKL); measured 3.5 ulps of max |out|


class RowwiseMethod(UnquantizedFusedMoEMethod):
    """Unquantized experts whose matmul computes each row on its own (a product and a sum over K per output
    element), so a row's bits do not depend on how many rows come with it."""

    def expert_linear(self, layer, param_name, expert_id, x):
        return (x[:, None, :] * getattr(layer, param_name)[expert_id][None]).sum(-1)


def build_experts(method, dtype, seed=0, hidden=H, inter=INTER, num_experts=E):
    """A FusedMoE built on the CPU from random weights and processed whole (process_weights_after_loading)."""
    experts = FusedMoE(
        num_experts,
        hidden,
        inter,
        quant_method=method,
        params_dtype=dtype,
        expert_shards=QWEN_EXPERT_SHARDS,
        prefix="moe",
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.w13_weight.copy_(torch.randn(experts.w13_weight.shape, generator=gen) * 0.05)
        experts.w2_weight.copy_(torch.randn(experts.w2_weight.shape, generator=gen) * 0.05)
    method.process_weights_after_loading(experts)
    return experts


def routing(tokens, weights_dtype, seed=1, num_experts=E, exclude=(), top_k=TOP_K):
    """(topk_weights [T, k] in weights_dtype, topk_ids int64 [T, k]) as select_experts makes them: top-k of a
    softmax, renormalized; experts in ``exclude`` are never chosen."""
    logits = torch.randn(tokens, num_experts, generator=torch.Generator().manual_seed(seed))
    logits[:, list(exclude)] = -float("inf")
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(weights_dtype), ids


def both_paths(method, experts, tokens, dtype, weights_dtype, seed=2, top_k=TOP_K):
    x = torch.randn(tokens, experts.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights, ids = routing(tokens, weights_dtype, num_experts=experts.num_experts, top_k=top_k)
    with torch.no_grad():
        return method.apply(experts, x, weights, ids), method.apply_all_experts(experts, x, weights, ids)


def assert_within_f32_ulps(eager, dense):
    bound = F32_ULPS * torch.finfo(torch.float32).eps * eager.abs().max().item()
    assert (eager - dense).abs().max().item() <= bound


# Qwen3-MoE: bf16 routing weights (the logits' dtype); Mixtral: float32 routing weights with bf16 activations
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_unquantized_bf16_is_bit_equal_to_eager(tokens, weights_dtype):
    method = UnquantizedFusedMoEMethod()
    eager, dense = both_paths(method, build_experts(method, torch.bfloat16), tokens, torch.bfloat16, weights_dtype)
    assert dense.dtype == torch.bfloat16
    assert torch.equal(dense, eager)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accumulation_order_is_eagers_with_four_experts_per_token(dtype):
    """With k = 2 the order cannot show (0 + a + b == 0 + b + a); with k = 4 a token's sum rounds differently in
    another expert order, so this pins increasing expert id with a cast to x.dtype per expert."""
    method = RowwiseMethod()
    experts = build_experts(method, dtype)
    eager, dense = both_paths(method, experts, 16, dtype, torch.float32, top_k=4)
    assert torch.equal(dense, eager)


@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_float32_with_a_rowwise_matmul_is_bit_equal_to_eager(tokens):
    method = RowwiseMethod()
    eager, dense = both_paths(method, build_experts(method, torch.float32), tokens, torch.float32, torch.float32)
    assert torch.equal(dense, eager)


@pytest.mark.parametrize("tokens", [5, 16])
def test_unquantized_float32_within_gemm_rounding_of_eager(tokens):
    method = UnquantizedFusedMoEMethod()
    eager, dense = both_paths(method, build_experts(method, torch.float32), tokens, torch.float32, torch.float32)
    assert_within_f32_ulps(eager, dense)


@pytest.mark.parametrize(
    ("granularity", "mode"),
    [("tensor", "w8a16"), ("channel", "w8a16"), ("block", "w8a16"), ("channel", "w8a8")],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_row_independent_modes_equal_eager(granularity, mode, dtype):
    """W8A16 dequantizes the expert as eager does; per-channel W8A8 scales activations per token."""
    if mode == "w8a8" and not cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only")
    method = Fp8MoEMethod(granularity, fp8_mode=mode)
    eager, dense = both_paths(method, build_experts(method, dtype), 16, dtype, dtype)
    if dtype == torch.bfloat16:
        assert torch.equal(dense, eager)
    else:
        assert_within_f32_ulps(eager, dense)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_per_tensor_w8a8_differs_by_the_activation_scale_only(dtype, seed):
    """One activation scale over all T rows (dense) or the expert's rows (eager): both are as close to the
    W8A16 result (no activation quantization), and close to each other. Measured over T in (2, 8, 16, 33) x 3
    seeds x 2 dtypes: eager-vs-dense 23.6..32.2 dB, each vs W8A16 25.8..28.0 dB, dense at most 1.0 dB below
    eager."""
    method = Fp8MoEMethod("tensor", fp8_mode="w8a8")
    eager, dense = both_paths(method, build_experts(method, dtype, seed=seed), 16, dtype, dtype)
    w8a16 = Fp8MoEMethod("tensor", fp8_mode="w8a16")
    reference, _ = both_paths(w8a16, build_experts(w8a16, dtype, seed=seed), 16, dtype, dtype)
    assert not torch.equal(dense, eager)  # the scale does differ: this test measures that, not rounding
    assert sqnr_db(eager.float(), dense.float()) >= 22.0
    assert sqnr_db(reference.float(), dense.float()) >= sqnr_db(reference.float(), eager.float()) - 1.5


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("scheme", ["none", "fp8-per-channel"])
def test_an_unchosen_expert_with_non_finite_weights_changes_nothing(scheme, poison):
    """An expert no token chose adds an exact zero, even when its output is NaN or Inf for every token."""
    method = UnquantizedFusedMoEMethod() if scheme == "none" else Fp8MoEMethod("channel", fp8_mode="w8a16")
    experts = build_experts(method, torch.bfloat16)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    weights, ids = routing(6, torch.bfloat16, exclude=(5,))
    with torch.no_grad():
        clean = method.apply_all_experts(experts, x, weights, ids)
        if scheme == "none":
            experts.w13_weight[5].fill_(poison)
            experts.w2_weight[5].fill_(poison)
        else:  # e4m3fn has no Inf: poison the expert's scales
            experts.w13_weight_scale[5].fill_(poison)
            experts.w2_weight_scale[5].fill_(poison)
        gate_up = method.expert_linear(experts, "w13_weight", 5, x)
        assert not torch.isfinite(gate_up).any()  # the poisoned expert does produce NaN / Inf
        dense = method.apply_all_experts(experts, x, weights, ids)
        eager = method.apply(experts, x, weights, ids)  # never runs expert 5
    assert torch.isfinite(dense).all()
    assert torch.equal(dense, clean) and torch.equal(dense, eager)


def test_transient_bytes_are_activations_not_gathered_experts():
    """Experts of 2I x H = 2048 x 512 bf16 (2 MiB for w13, 1 MiB for w2) and T = 8, k = 2: the gathered path
    this replaces held T*k = 16 experts' w13 and w2 (48 MiB); the dense path holds [T, 2I] / [T, H]
    activations, about 32 KiB, whatever E and T*k."""
    hidden, inter, tokens = 512, 1024, 8
    method = UnquantizedFusedMoEMethod()
    experts = build_experts(method, torch.bfloat16, hidden=hidden, inter=inter)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weights, ids = routing(tokens, torch.bfloat16)
    with torch.no_grad(), DeviceMemoryTracker("cpu") as tracker:
        out = method.apply_all_experts(experts, x, weights, ids)
    gathered = tokens * TOP_K * 3 * inter * hidden * 2  # 50331648 bytes
    act = tokens * 2 * inter * 2  # one [T, 2I] bf16 activation: 32768 bytes
    # measured 82112 (eager: 59488): out [T, H] bf16, [T, E] routing, then per expert [T, 2I], silu(gate)
    # and its product [T, I] x 2, y [T, H] and its weighted forms, freed expert by expert
    assert tracker.peak_bytes <= 3 * act
    assert gathered > 500 * tracker.peak_bytes
    assert tracker.final_bytes == out.numel() * out.element_size()


@pytest.mark.parametrize("fused", [False, True], ids=["dequantize", "fused"])
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_w8a16_transient_is_eager_per_expert_weights_plus_activations(granularity, fused, monkeypatch):
    """On the CPU, W8A16 runs one expert at a time in both paths. Dequantize + F.linear (where the native fused GEMM
    does not run) holds one expert's dequantized weight (the torch reference's float32 temporaries: 2 [2I, H]
    float32 tensors per tensor/channel, 3 per block); the fused GEMM (cpu_native.linear_fp8) holds none. The dense
    path adds only activations of all T rows to eager's peak, never T*k experts."""
    if fused and not cpu_native.available():
        pytest.skip("the _cpu_fp8 extension is not built")
    if not fused:
        monkeypatch.setattr(cpu_native, "supports_linear", lambda *args: False)
    hidden, inter, tokens, num_experts = 256, 512, 8, 4
    method = Fp8MoEMethod(granularity, fp8_mode="w8a16")
    experts = build_experts(method, torch.bfloat16, hidden=hidden, inter=inter, num_experts=num_experts)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    weights, ids = routing(tokens, torch.bfloat16, num_experts=num_experts)
    peaks = {}
    for path in (method.apply, method.apply_all_experts):
        with torch.no_grad(), DeviceMemoryTracker("cpu") as tracker:
            path(experts, x, weights, ids)
        peaks[path.__name__] = tracker.peak_bytes
    w13_f32 = 2 * inter * hidden * 4  # 1048576 bytes
    act = tokens * 2 * inter * 2  # 16384 bytes
    if fused:  # activations only (measured 27728 bytes; the kernel's own float32 tiles of x and w are not torch's)
        assert peaks["apply"] <= 3 * act
    else:
        assert peaks["apply"] >= 2 * w13_f32  # eager dequantizes one expert's w13 (the figure is not empty)
    assert peaks["apply_all_experts"] <= peaks["apply"] + act
    assert peaks["apply_all_experts"] <= (3 if granularity == "block" else 2) * w13_f32 + 2 * act
    assert tokens * TOP_K * 3 * inter * hidden * 2 > 3 * peaks["apply_all_experts"]  # the gathered path's bf16


@pytest.fixture(scope="module", params=MOE_ARCHS)
def checkpoint(request, tmp_path_factory):
    arch = request.param
    return arch, write_hf_checkpoint(tmp_path_factory.mktemp(f"capture-{arch}"), arch, num_layers=3)


@pytest.fixture
def dense_forward(monkeypatch):
    """Every MoE layer forward runs the capture path, as it does inside torch.cuda.graph."""

    calls = []

    def apply(self, layer, x, topk_weights, topk_ids):
        calls.append(layer.prefix)
        return self.apply_all_experts(layer, x, topk_weights, topk_ids)

    def enable():
        monkeypatch.setattr(FusedMoEMethodBase, "apply", apply)
        return calls

    return enable


def test_model_logits_bit_equal_in_bf16(checkpoint, dense_forward):
    """Whole models with transformers' routing (Qwen3-MoE: bf16 weights; Mixtral: float32 weights)."""
    arch, path = checkpoint
    model = layerwise.load_model(path, quantization=None)
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        eager = model(ids)
        calls = dense_forward()
        dense = model(ids)
    assert calls == [moe_block(model, i).experts.prefix for i in range(3) if hasattr(moe_block(model, i), "experts")]
    assert torch.equal(dense, eager), arch


def test_model_logits_per_tensor_w8a8(checkpoint, dense_forward):
    """The tolerance of the CUDA-graph test (tests/test_moe_cuda.py): per-tensor W8A8 through three layers.
    Measured (ids [2, 7] and [2, 1], 2 seeds each): eager-vs-dense logits 27.0..39.4 dB, each vs W8A16
    24.4..27.9 dB, dense never more than 0.2 dB below eager; the greedy tokens differed at 1 of 14 positions
    once (Mixtral, seed 6), so a captured decode may pick other tokens than eager under per-tensor W8A8."""
    arch, path = checkpoint
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    logits = {}
    for mode in ("w8a8", "w8a16"):
        model = layerwise.load_model(path, quantization="fp8-per-tensor", fp8_mode=mode)
        with torch.no_grad():
            logits[mode] = model(ids).float()
    reference = logits["w8a16"]
    with torch.no_grad():
        calls = dense_forward()
        dense = model(ids).float()  # W8A16: no activation quantization, so as eager bit for bit
        dense_w8a8 = layerwise.load_model(path, quantization="fp8-per-tensor", fp8_mode="w8a8")(ids).float()
    assert calls
    assert torch.equal(dense, reference), arch
    eager = logits["w8a8"]
    assert sqnr_db(eager, dense_w8a8) >= 25.0, arch
    assert sqnr_db(reference, dense_w8a8) >= sqnr_db(reference, eager) - 1.0, arch


def test_capture_path_runs_the_all_experts_forward_eagerly(monkeypatch):
    # the Engine warms up inside capture_path so that the capture launches nothing new: every expert on all rows,
    # as under capture; outside the block the eager loop runs (only experts that received tokens)
    from layerwise.quant.moe_base import capture_path

    method = UnquantizedFusedMoEMethod()
    experts = build_experts(method, torch.bfloat16)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4)).bfloat16()
    weights, ids = routing(3, torch.bfloat16, exclude=(5,))
    ran = []
    real = method.expert_linear
    monkeypatch.setattr(
        method, "expert_linear", lambda layer, p, e, x: ran.append((e, x.shape[0])) or real(layer, p, e, x)
    )
    with torch.no_grad():
        with capture_path():
            inside = experts(x, weights, ids)
        assert sorted({e for e, _ in ran}) == list(range(E)) and {rows for _, rows in ran} == {3}
        ran.clear()
        outside = experts(x, weights, ids)
    assert 5 not in {e for e, _ in ran}  # never chosen: the eager loop skips it
    assert torch.equal(inside, method.apply_all_experts(experts, x, weights, ids))
    assert torch.equal(outside, method.apply(experts, x, weights, ids))
