"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers' own forward, and the FP8 expert
bytes against torch's own cast, on tiny checkpoints that transformers wrote (8 experts, top-2)."""

import pytest
import torch

import layerwise
from layerwise.errors import TensorParallelError
from layerwise.quant.config import QuantConfig
from layerwise.quant.fp8 import cpu_rowwise_scaled_mm
from layerwise.quant.fp8_moe import Fp8MoEMethod
from layerwise.quant.moe_base import UnquantizedFusedMoEMethod
from tests.hf_checkpoints import MOE_ARCHS, hf_logits, sqnr_db, write_hf_checkpoint
from tests.moe_helpers import as_bytes, expert_weights, moe_block, torch_fp8_reference

SCHEMES = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]


@pytest.fixture(scope="module", params=MOE_ARCHS)
def moe_checkpoint(request, tmp_path_factory):
    """(arch, path, transformers' float32 logits of IDS): 3 layers (Qwen3-MoE: layer 0 dense)."""
    arch = request.param
    path = write_hf_checkpoint(tmp_path_factory.mktemp(arch), arch, num_layers=3)
    return arch, path, hf_logits(path, IDS)


IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))


def test_float32_matches_transformers(moe_checkpoint):
    arch, path, ref = moe_checkpoint
    model = layerwise.load_model(path, quantization=None, dtype=torch.float32)
    with torch.no_grad():
        out = model(IDS)
    err = (out - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"{arch}: max |diff| {err}"


def test_bf16_forward_close_to_transformers(moe_checkpoint):
    arch, path, ref = moe_checkpoint
    model = layerwise.load_model(path, quantization=None)
    assert moe_block(model, 1).experts.w13_weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert sqnr_db(ref, model(IDS).float()) > 30


def test_layer_kinds_follow_the_config(moe_checkpoint):
    arch, path, _ = moe_checkpoint
    model = layerwise.load_model(path, quantization="fp8")
    kinds = [type(moe_block(model, i)).__name__ for i in range(3)]
    # Qwen3-MoE: mlp_only_layers=[0] keeps layer 0 dense; Mixtral: every layer is sparse
    assert kinds == (["LlamaMLP"] if arch == "Qwen3MoeForCausalLM" else ["SparseMoeBlock"]) + ["SparseMoeBlock"] * 2
    block = moe_block(model, 1)
    assert block.gate.weight.dtype == torch.bfloat16  # the router is never quantized
    assert block.experts.w13_weight.shape == (8, 64, 64) and block.experts.w2_weight.shape == (8, 64, 32)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fp8_sqnr_and_expert_bytes_equal_torch_cast(moe_checkpoint, scheme):
    arch, path, ref = moe_checkpoint
    granularity = scheme.rsplit("-", 1)[1]
    model = layerwise.load_model(path, quantization=scheme, dtype=torch.float32)
    with torch.no_grad():
        db = sqnr_db(ref, model(IDS))
    assert db >= 18.0, f"{arch} {scheme}: SQNR {db:.1f} dB"
    experts = moe_block(model, 2).experts
    suffix = "weight_scale_inv" if granularity == "block" else "weight_scale"
    for e in range(8):
        for name, w in zip(("w13", "w2"), expert_weights(path, arch, 2, e), strict=True):
            q, scale = torch_fp8_reference(w, granularity)
            assert torch.equal(as_bytes(getattr(experts, f"{name}_weight")[e]), as_bytes(q)), (name, e)
            assert torch.equal(
                getattr(experts, f"{name}_{suffix}")[e], scale.reshape(-1)[0] if granularity == "tensor" else scale
            )


def test_fp8_block_scales_on_ragged_128_blocks(tmp_path):
    """I = 160, H = 256: w13 [320, 256] has 3 x 2 blocks, w2 [256, 160] 2 x 2, the last ones ragged."""
    arch = "Qwen3MoeForCausalLM"
    path = write_hf_checkpoint(
        tmp_path, arch, num_layers=2, hidden=256, moe_intermediate_size=160, max_shard_size="2MB"
    )
    model = layerwise.load_model(path, quantization="fp8-per-block")
    experts = moe_block(model, 1).experts
    assert experts.w13_weight_scale_inv.shape == (8, 3, 2) and experts.w2_weight_scale_inv.shape == (8, 2, 2)
    for e in (0, 7):
        for name, w in zip(("w13", "w2"), expert_weights(path, arch, 1, e), strict=True):
            q, scale = torch_fp8_reference(w, "block")
            assert torch.equal(as_bytes(getattr(experts, f"{name}_weight")[e]), as_bytes(q)), (name, e)
            assert torch.equal(getattr(experts, f"{name}_weight_scale_inv")[e], scale)


def test_per_tensor_scale_spans_gate_and_up(moe_checkpoint):
    arch, path, _ = moe_checkpoint
    model = layerwise.load_model(path, quantization="fp8")
    w13, _ = expert_weights(path, arch, 1, 3)
    scale = moe_block(model, 1).experts.w13_weight_scale[3]
    assert scale == w13.float().abs().max() / 448.0  # one scale over both shards, not gate's or up's alone
    assert scale > min(w13[:32].float().abs().max(), w13[32:].float().abs().max()) / 448.0


def test_w8a8_on_cpu_close_to_transformers(moe_checkpoint):
    arch, path, ref = moe_checkpoint
    if arch != "Qwen3MoeForCausalLM":
        pytest.skip("torch's CPU _scaled_mm is a slow reference: one architecture is enough")
    if not cpu_rowwise_scaled_mm():
        pytest.skip("this torch's CPU _scaled_mm takes per-tensor scales only")
    model = layerwise.load_model(path, quantization="fp8-per-channel", fp8_mode="w8a8")
    with torch.no_grad():
        db = sqnr_db(ref, model(IDS).float())
    assert db >= 15.0, f"{arch} w8a8: SQNR {db:.1f} dB"


@pytest.mark.parametrize("scheme", ["none"] + SCHEMES)
def test_capture_path_equals_the_expert_loop(scheme):
    """The CUDA-graph path (no host sync: every expert on every token, masked) computes what the loop computes;
    the layer is built on the CPU and processed whole (process_weights_after_loading)."""
    from layerwise.layers.fused_moe import QWEN_EXPERT_SHARDS, FusedMoE

    method = QuantConfig(scheme).get_moe_method("moe")
    experts = FusedMoE(
        8, 64, 160, quant_method=method, params_dtype=torch.float32, expert_shards=QWEN_EXPERT_SHARDS, prefix="moe"
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.w13_weight.copy_(torch.randn(experts.w13_weight.shape, generator=gen) * 0.05)
        experts.w2_weight.copy_(torch.randn(experts.w2_weight.shape, generator=gen) * 0.05)
    w2 = experts.w2_weight.detach().clone()
    method.process_weights_after_loading(experts)
    x = torch.randn(10, 64, generator=gen)
    weights = torch.softmax(torch.randn(10, 2, generator=gen), dim=-1)
    ids = torch.tensor([[0, 3], [3, 0], [7, 1], [2, 5], [5, 2], [1, 6], [6, 4], [4, 7], [0, 1], [3, 4]])
    loop = experts(x, weights, ids)
    dense = method.apply_all_experts(experts, x, weights, ids)
    # float32: a GEMM row's bits depend on the row count (tests/test_moe_capture_path.py), so a few ulps
    torch.testing.assert_close(dense, loop, rtol=1e-6, atol=1e-6)
    if scheme != "none":  # the whole-layer path quantizes each expert as torch's own cast does
        q, _ = torch_fp8_reference(w2[5], scheme.rsplit("-", 1)[1])
        assert torch.equal(as_bytes(experts.w2_weight[5]), as_bytes(q))


def test_scheme_without_moe_method_is_a_clear_error(moe_checkpoint):
    _, path, _ = moe_checkpoint
    with pytest.raises(ValueError, match="not supported for mixture-of-experts.*fp8-per-tensor"):
        layerwise.load_model(path, quantization="torchao:Float8WeightOnlyConfig")
    assert isinstance(QuantConfig("none").get_moe_method("moe"), UnquantizedFusedMoEMethod)
    method = QuantConfig("fp8-per-block", fp8_mode="w8a16").get_moe_method("moe")
    assert isinstance(method, Fp8MoEMethod) and (method.granularity, method.fp8_mode) == ("block", "w8a16")


@pytest.mark.parametrize(
    "experts, intermediate, expert_parallel, named",
    [(5, 32, True, "num_experts=5"), (8, 33, False, "intermediate size=33")],
)
def test_moe_layers_that_do_not_split_are_refused_while_building(
    moe_checkpoint, experts, intermediate, expert_parallel, named
):
    """Expert parallelism needs E divisible by the group size, tensor parallelism over the experts I: refused while the
    layer is built on the meta device, before a weight is read (tests/tp/test_tp_moe.py runs the two layouts)."""
    from layerwise.config import ModelConfig
    from layerwise.distributed import TPContext
    from layerwise.layers.fused_moe import QWEN_EXPERT_SHARDS, FusedMoE

    with torch.device("meta"), pytest.raises(TensorParallelError, match=named):
        FusedMoE(
            experts,
            64,
            intermediate,
            quant_method=UnquantizedFusedMoEMethod(),
            params_dtype=torch.bfloat16,
            expert_shards=QWEN_EXPERT_SHARDS,
            prefix="model.layers.1.mlp.experts",
            tp=TPContext(None, 0, 2, expert_parallel),
        )
    assert ModelConfig.from_dict({**_config(moe_checkpoint[1]), "mlp_only_layers": [1]}).is_moe_layer(1) is False


def _config(path):
    import json

    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_triton_kernel_quantizes_an_expert_as_the_torch_reference(granularity):
    """kernel="triton" (the CUDA default; interpreted here) gives each expert the torch kernel's bytes and
    scales, on a ragged [320, 160] weight (blocks of 128 that do not fit)."""
    w = torch.randn(320, 160, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w[7, 9] = 3.0  # an outlier row/block
    out = {}
    for kernel in ("torch", "triton"):
        method = Fp8MoEMethod(granularity, kernel)
        scale_name = method.scale_names["w13_weight"]
        shape = (2,) if granularity == "tensor" else ((2, 320, 1) if granularity == "channel" else (2, 3, 2))
        tensors = {"w13_weight": torch.zeros(2, 320, 160, dtype=torch.float8_e4m3fn), scale_name: torch.zeros(shape)}
        method.process_expert(None, "w13_weight", 1, w, tensors)
        out[kernel] = tensors
    for name in out["torch"]:
        assert torch.equal(as_bytes(out["torch"][name]), as_bytes(out["triton"][name])), name
    q, scale = torch_fp8_reference(w, granularity)
    assert torch.equal(as_bytes(out["triton"]["w13_weight"][1]), as_bytes(q))
