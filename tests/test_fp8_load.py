"""FP8 kernel tensors equal the torch reference applied to the fused checkpoint tensors."""

import pytest
import torch
from safetensors import safe_open

import layerwise
from kernels import reference
from layerwise.checkpoint import Checkpoint

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_tensor(ckpt: Checkpoint, key: str) -> torch.Tensor:
    with safe_open(ckpt.file_of(key), "pt") as f:
        return f.get_tensor(key).clone()


SCHEMES = {"fp8": ("tensor", "weight_scale", lambda n, k: (1,)),
           "fp8-per-channel": ("channel", "weight_scale", lambda n, k: (n, 1)),
           "fp8-per-block": ("block", "weight_scale_inv", lambda n, k: (-(-n // 128), -(-k // 128)))}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_every_linear_weight_is_fp8_with_reference_bytes(hf_checkpoint, scheme):
    arch, path = hf_checkpoint
    granularity, scale_name, scale_shape = SCHEMES[scheme]
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
        q_ref, scale_ref = reference.quantize_weight(fused, granularity)
        scale = getattr(module, scale_name)
        assert module.weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert tuple(scale.shape) == scale_shape(*fused.shape)
        assert torch.equal(module.weight.view(torch.uint8), q_ref.view(torch.uint8)), name
        assert torch.equal(scale.flatten(), scale_ref.flatten()), name
        if module.bias is not None:  # Qwen2 q/k/v bias: kept in checkpoint dtype, fused in order
            bias = torch.cat([_checkpoint_tensor(ckpt, f"{parent}.{p}.bias") for p in parts])
            assert torch.equal(module.bias, bias)
    assert linears == 4 * model.config.num_hidden_layers
    # embeddings, norms and lm_head stay in the checkpoint dtype
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16


def test_tied_lm_head_is_the_embedding(hf_checkpoint):
    arch, path = hf_checkpoint
    model = layerwise.load_model(path, quantization="fp8")
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
        ckpt = Checkpoint(path)
        assert torch.equal(model.lm_head.weight, _checkpoint_tensor(ckpt, "lm_head.weight"))


def test_triton_kernel_load_equals_torch_kernel_load(qwen3_8_layers):
    a = layerwise.load_model(qwen3_8_layers, quantization="fp8", kernel="torch")
    b = layerwise.load_model(qwen3_8_layers, quantization="fp8", kernel="triton")
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert pa.dtype == pb.dtype
        assert torch.equal(pa.view(torch.uint8) if pa.dtype == torch.float8_e4m3fn else pa,
                           pb.view(torch.uint8) if pb.dtype == torch.float8_e4m3fn else pb), name
