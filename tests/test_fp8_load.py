"""FP8 kernel tensors equal torch's own float8 cast (and torchao's) of the fused checkpoint tensors."""

import pytest
import torch
from safetensors import safe_open

import layerwise
from layerwise.checkpoint import Checkpoint

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_tensor(ckpt: Checkpoint, key: str) -> torch.Tensor:
    with safe_open(ckpt.file_of(key), "pt") as f:
        return f.get_tensor(key).clone()


def _expected_fp8(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 bytes and scale computed with torch's own ops, independently of kernels/: amax / 448,
    then torch's float32 division, clamp and float8_e4m3fn cast."""
    w = w.float()
    if granularity == "tensor":
        scale = w.abs().max() / 448
        return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale.reshape(1)
    if granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    blocks = torch.nn.functional.pad(w.abs(), (0, kb * 128 - k, 0, nb * 128 - n)).reshape(nb, 128, kb, 128)
    scale = blocks.amax(dim=(1, 3)) / 448
    per_element = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    return (w / per_element).clamp(-448, 448).to(torch.float8_e4m3fn), scale


SCHEMES = {
    "fp8": ("tensor", "weight_scale"),
    "fp8-per-channel": ("channel", "weight_scale"),
    "fp8-per-block": ("block", "weight_scale_inv"),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_linear_weight_is_fp8_with_torch_cast_bytes(hf_checkpoint, scheme):
    arch, path = hf_checkpoint
    granularity, scale_name = SCHEMES[scheme]
    ckpt = Checkpoint(path)
    model = layerwise.load_model(path, quantization=scheme)
    linears = 0
    for name, module in model.named_modules():
        short = name.rsplit(".", 1)[-1]
        if short not in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            continue
        linears += 1
        parent = name.rsplit(".", 1)[0]
        parts = FUSED.get(short, (short,))
        fused = torch.cat([_checkpoint_tensor(ckpt, f"{parent}.{p}.weight") for p in parts])
        q_expected, scale_expected = _expected_fp8(fused, granularity)
        scale = getattr(module, scale_name)
        assert module.weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert scale.shape == scale_expected.shape, name
        assert torch.equal(scale, scale_expected), name
        assert torch.equal(module.weight.view(torch.uint8), q_expected.view(torch.uint8)), name
        if module.bias is not None:  # Qwen2 q/k/v bias: kept in checkpoint dtype, fused in order
            bias = torch.cat([_checkpoint_tensor(ckpt, f"{parent}.{p}.bias") for p in parts])
            assert torch.equal(module.bias, bias)
    assert linears == 4 * model.config.num_hidden_layers
    # embeddings, norms and lm_head stay in the checkpoint dtype
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16


def test_per_tensor_bytes_equal_torchao_float8_quantization(hf_checkpoint):
    quant_primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    arch, path = hf_checkpoint
    ckpt = Checkpoint(path)
    model = layerwise.load_model(path, quantization="fp8")
    layer = model.model.layers[0]
    for module, key in (
        (layer.mlp.down_proj, "model.layers.0.mlp.down_proj.weight"),
        (layer.self_attn.o_proj, "model.layers.0.self_attn.o_proj.weight"),
    ):
        # in float32: torchao computes amax / 448 in the input dtype, which for bf16 rounds the scale
        w = _checkpoint_tensor(ckpt, key).float()
        scale = quant_primitives._choose_scale_float8(w, block_size=list(w.shape), float8_dtype=torch.float8_e4m3fn)
        q = quant_primitives._quantize_affine_float8(w, scale, torch.float8_e4m3fn)
        assert torch.equal(module.weight_scale, scale.reshape(1).float()), key
        assert torch.equal(module.weight.view(torch.uint8), q.view(torch.uint8)), key


def test_tied_lm_head_is_the_embedding(hf_checkpoint):
    arch, path = hf_checkpoint
    model = layerwise.load_model(path, quantization="fp8")
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        ckpt = Checkpoint(path)
        assert torch.equal(model.lm_head.weight, _checkpoint_tensor(ckpt, "lm_head.weight"))


@pytest.mark.slow
def test_triton_kernel_load_equals_torch_kernel_load(qwen3_8_layers):
    a = layerwise.load_model(qwen3_8_layers, quantization="fp8", kernel="torch")
    b = layerwise.load_model(qwen3_8_layers, quantization="fp8", kernel="triton")
    state_a, state_b = a.state_dict(), b.state_dict()
    assert list(state_a) == list(state_b)
    for name, pa in state_a.items():
        pb = state_b[name]
        assert pa.dtype == pb.dtype
        assert torch.equal(
            pa.view(torch.uint8) if pa.dtype == torch.float8_e4m3fn else pa,
            pb.view(torch.uint8) if pb.dtype == torch.float8_e4m3fn else pb,
        ), name
