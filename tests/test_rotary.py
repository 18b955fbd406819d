"""RotaryEmbedding.apply against transformers' apply_rotary_pos_emb, bit for bit, and its kernel count."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from layerwise.layers.rotary import RotaryEmbedding, adjacent_heads


def _hf_rotate(q, k, positions, inv_freq, rotary_dim, dtype):
    """transformers' cos/sin (LlamaRotaryEmbedding's arithmetic) and apply_rotary_pos_emb on the rotated part."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)  # [B, T, R]
    q_rot, k_rot = apply_rotary_pos_emb(q[..., :rotary_dim], k[..., :rotary_dim], cos, sin, unsqueeze_dim=2)
    return torch.cat((q_rot, q[..., rotary_dim:]), -1), torch.cat((k_rot, k[..., rotary_dim:]), -1)


def _qkv(b, t, hq, hk, d, dtype, seed=0):
    """q, k, v as the attention splits the fused qkv_proj output: adjacent heads of one buffer."""
    qkv = torch.randn(b, t, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.view(b, t, hq, d), k.view(b, t, hk, d), v.view(b, t, hk, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rotary_dim", "adjacent"), [(None, True), (None, False), (24, True)])
def test_apply_equals_transformers_bit_for_bit(dtype, rotary_dim, adjacent):
    d = 32
    rope = RotaryEmbedding(d, 10000.0, None, torch.device("cpu"), rotary_dim=rotary_dim)
    q, k, _ = _qkv(3, 5, 4, 2, d, dtype)
    if not adjacent:  # separate tensors (q and k after per-head norms, as in Qwen3)
        q, k = q.clone(), k.clone()
        assert adjacent_heads(q, k) is None
    else:
        assert adjacent_heads(q, k) is not None
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11], [100, 101, 102, 103, 104]])
    q_out, k_out = rope.apply(q, k, *rope.cos_sin(positions, dtype))
    q_ref, k_ref = _hf_rotate(q, k, positions, rope.inv_freq, rope.rotary_dim, dtype)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_adjacent_q_and_k_are_rotated_by_one_set_of_kernels():
    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func).split(".")[1]] += 1
            return func(*args, **(kwargs or {}))

    rope = RotaryEmbedding(32, 10000.0, None, torch.device("cpu"))
    q, k, _ = _qkv(8, 1, 8, 2, 32, torch.bfloat16)
    cos, sin = rope.cos_sin(torch.full((8, 1), 5), torch.bfloat16)
    with Count() as joint:
        q_out, k_out = rope.apply(q, k, cos, sin)
    with Count() as separate:
        rope.apply(q.clone(), k.clone(), cos, sin)
    kernels = ("mul", "roll", "add", "cat", "neg")
    assert {op: joint.ops[op] for op in kernels} == {"mul": 2, "roll": 1, "add": 1, "cat": 0, "neg": 0}
    assert {op: separate.ops[op] for op in kernels} == {"mul": 4, "roll": 2, "add": 2, "cat": 0, "neg": 0}
    assert q_out.untyped_storage().data_ptr() == k_out.untyped_storage().data_ptr()  # views of one result


def test_adjacent_heads_refuses_what_is_not_one_buffer():
    q, k, v = _qkv(2, 3, 4, 2, 16, torch.bfloat16)
    assert adjacent_heads(q, k).shape == (2, 3, 6, 16)
    assert adjacent_heads(q, v) is None  # v follows k, not q
    assert adjacent_heads(k, q) is None  # order matters
    assert adjacent_heads(q, k.float()) is None
    assert adjacent_heads(q[:, :2], k[:, :2]).shape == (2, 2, 6, 16)  # same strides, fewer tokens
    assert adjacent_heads(q[..., :8], k[..., :8]) is None  # heads no longer contiguous
