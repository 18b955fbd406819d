"""RotaryEmbedding against transformers' apply_rotary_pos_emb, bit for bit, and its kernel count."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layerwise.layers.rotary import RotaryEmbedding


def _hf_rotate(q, k, positions, inv_freq, rotary_dim, dtype, attention_factor=1.0):
    """transformers' cos/sin (LlamaRotaryEmbedding's arithmetic, LongRoPE's attention factor) and
    apply_rotary_pos_emb on the rotated part."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)  # [B, T, R]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin, unsqueeze_dim=2)
    return torch.cat((q_rot, q[..., rotary_dim:]), -1), torch.cat((k_rot, k[..., rotary_dim:]), -1)


def _qkv(b, t, hq, hk, d, dtype, seed=0):
    """The fused qkv_proj output [B, T, (Hq + 2 Hk) D], and q, k as the attention views them."""
    qkv = torch.randn(b, t, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return qkv, qkv[..., : hq * d].view(b, t, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d)


POSITIONS = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [100, 101, 102, 103, 104]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rotary_dim", [None, 24])
@pytest.mark.parametrize("joint", [False, True])
def test_rotation_equals_transformers_bit_for_bit(dtype, rotary_dim, joint):
    hq, hk, d = 4, 2, 32
    rope = RotaryEmbedding(d, 10000.0, None, torch.device("cpu"), rotary_dim=rotary_dim)
    qkv, q, k = _qkv(3, 5, hq, hk, d, dtype)
    cos, sin = rope.cos_sin(POSITIONS, dtype)
    if joint:  # q and k as one view of the qkv output, as LlamaAttention rotates them
        q_out, k_out = rope.rotate(qkv[..., : (hq + hk) * d].view(3, 5, hq + hk, d), cos, sin).split([hq, hk], 2)
    else:
        q_out, k_out = rope.apply(q, k, cos, sin)
    q_ref, k_ref = _hf_rotate(q, k, POSITIONS, rope.inv_freq, rope.rotary_dim, dtype)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_longrope_attention_factor_bit_for_bit():
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
    rope = RotaryEmbedding(16, 10000.0, scaling, torch.device("cpu"), max_position_embeddings=256)
    assert rope.attention_factor != 1.0
    _, q, k = _qkv(3, 5, 2, 1, 16, torch.bfloat16)
    q_out, k_out = rope.apply(q, k, *rope.cos_sin(POSITIONS, torch.bfloat16))  # position 104 > 64: long factors
    q_ref, k_ref = _hf_rotate(q, k, POSITIONS, rope.long_inv_freq, 16, torch.bfloat16, rope.attention_factor)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func).split(".")[1]] += 1
        return func(*args, **(kwargs or {}))


def test_joint_rotation_takes_one_set_of_kernels():
    rope = RotaryEmbedding(32, 10000.0, None, torch.device("cpu"))
    qkv, q, k = _qkv(8, 1, 8, 2, 32, torch.bfloat16)
    cos, sin = rope.cos_sin(torch.full((8, 1), 5), torch.bfloat16)
    with _Ops() as joint:
        rope.rotate(qkv[..., : 10 * 32].view(8, 1, 10, 32), cos, sin)
    with _Ops() as separate:
        rope.apply(q, k, cos, sin)
    kernels = ("mul", "flip", "add", "cat", "neg", "roll", "clone", "contiguous")
    assert {op: joint.ops[op] for op in kernels} == dict.fromkeys(kernels, 0) | {"mul": 2, "flip": 1, "add": 1}
    assert {op: separate.ops[op] for op in kernels} == dict.fromkeys(kernels, 0) | {"mul": 4, "flip": 2, "add": 2}


def test_gradients_reach_q_and_k_through_the_joint_rotation():
    rope = RotaryEmbedding(16, 10000.0, None, torch.device("cpu"))
    qkv = torch.randn(2, 3, (4 + 2 * 2) * 16, requires_grad=True)
    out = rope.rotate(qkv[..., : 6 * 16].view(2, 3, 6, 16), *rope.cos_sin(POSITIONS[:2, :3], torch.float32))
    out.square().sum().backward()
    assert bool((qkv.grad[..., : 6 * 16] != 0).all()) and bool((qkv.grad[..., 6 * 16 :] == 0).all())
