"""layerwise/routing.py: checkpoint keys reach the right parameter and shard, on a small module tree
built from the real layers (no checkpoint, no quantization)."""

import re

import pytest
import torch
from torch import nn

from layerwise.errors import UnexpectedWeightError
from layerwise.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from layerwise.quant.base import UnquantizedLinearMethod
from layerwise.routing import load_weights


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(
            6, 2, 2, 1, bias=True, quant_method=UnquantizedLinearMethod(), params_dtype=torch.float32
        )
        self.o_proj = RowParallelLinear(
            4, 6, bias=False, quant_method=UnquantizedLinearMethod(), params_dtype=torch.float32
        )


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = _Attention()
        self.gate_up_proj = MergedColumnParallelLinear(
            6,
            [3, 3],
            checkpoint_shards={"gate_proj": 0, "up_proj": 1},
            bias=False,
            quant_method=UnquantizedLinearMethod(),
            params_dtype=torch.float32,
        )


def _recording_tree():
    """The block with every weight_loader replaced by a recorder of (param name, shard_id, key=)."""
    block, calls = _Block(), []
    for module_name, module in block.named_modules():
        for name, p in module.named_parameters(recurse=False):
            p.weight_loader = lambda param, w, shard_id=None, *, key=None, _n=f"{module_name}.{name}": calls.append(
                (_n, shard_id, key)
            )
    return block, calls


@pytest.mark.parametrize(
    "key,target,shard_id",
    [
        ("self_attn.q_proj.weight", "self_attn.qkv_proj.weight", "q"),
        ("self_attn.k_proj.weight", "self_attn.qkv_proj.weight", "k"),
        ("self_attn.v_proj.bias", "self_attn.qkv_proj.bias", "v"),
        ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.weight", None),  # an already-fused tensor (Phi-3)
        ("self_attn.o_proj.weight", "self_attn.o_proj.weight", None),
        ("gate_proj.weight", "gate_up_proj.weight", 0),
        ("up_proj.weight", "gate_up_proj.weight", 1),
    ],
)
def test_keys_route_to_their_parameter_and_shard(key, target, shard_id):
    block, calls = _recording_tree()
    assert load_weights(block, [(key, torch.zeros(1))]) == [key]
    assert calls == [(target, shard_id, None)]  # outside a layerwise session: a plain weight_loader call


@pytest.mark.parametrize("key", ["self_attn.w_proj.weight", "self_attn.o_proj.scale", "mlp.gate_proj.weight"])
def test_unknown_keys_name_the_key(key):
    block, calls = _recording_tree()
    with pytest.raises(UnexpectedWeightError) as e:
        load_weights(block, [(key, torch.zeros(1))])
    assert e.value.key == key and not calls


def test_skip_predicate_and_order():
    block, calls = _recording_tree()
    keys = ["up_proj.weight", "rotary_emb.inv_freq", "self_attn.q_proj.weight"]
    loaded = load_weights(block, [(k, torch.zeros(1)) for k in keys], skip=lambda k: k.endswith("inv_freq"))
    assert loaded == ["up_proj.weight", "self_attn.q_proj.weight"]
    assert [c[0] for c in calls] == ["gate_up_proj.weight", "self_attn.qkv_proj.weight"]


def test_kernel_format_parameters_are_refused():
    block, _ = _recording_tree()
    block.self_attn.o_proj.weight = nn.Parameter(torch.zeros(6, 4))  # as after process_weights_after_loading
    with pytest.raises(UnexpectedWeightError, match="kernel format"):
        load_weights(block, [("self_attn.o_proj.weight", torch.zeros(6, 4))])


@pytest.mark.parametrize("layer,shards", [("gate_up_proj", "[0, 1]"), ("self_attn.qkv_proj", "['q', 'k', 'v']")])
def test_an_unknown_shard_id_names_the_layer_and_its_shards(layer, shards):
    module = _Block().get_submodule(layer)
    with pytest.raises(ValueError, match=f"no shard_id 'x' \\(shards: {re.escape(shards)}\\)"):
        module.weight_loader(module.weight, torch.zeros(3, 6), "x")
