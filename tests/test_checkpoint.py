"""Checkpoint streaming: decoder-layer order whatever the shard order, one mmap'ed tensor at a time."""

import json

import pytest
import torch
from safetensors.torch import save_file

from layerwise.checkpoint import Checkpoint, decoder_layer, layer_group
from layerwise.reload.types import ReloadReport


def test_order_is_by_decoder_layer_not_by_shard(tmp_path):
    keys = [
        "lm_head.weight",
        "model.layers.10.a.weight",
        "model.layers.2.b.weight",
        "model.norm.weight",
        "model.layers.2.a.weight",
        "model.embed_tokens.weight",
        "model.layers.0.a.weight",
    ]
    # shard 1 holds the last layers and lm_head, shard 2 the first ones
    shards = {"s1.safetensors": keys[:4], "s2.safetensors": keys[4:]}
    for name, ks in shards.items():
        save_file({k: torch.full((2,), float(i)) for i, k in enumerate(ks)}, str(tmp_path / name))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: n for n, ks in shards.items() for k in ks}})
    )
    (tmp_path / "config.json").write_text("{}")
    ckpt = Checkpoint(tmp_path)
    order = [k for k, _ in ckpt]
    assert order == [
        "model.embed_tokens.weight",
        "model.layers.0.a.weight",
        "model.layers.2.a.weight",
        "model.layers.2.b.weight",
        "model.layers.10.a.weight",
        "lm_head.weight",
        "model.norm.weight",
    ]
    assert [layer_group(k) for k in order] == sorted(layer_group(k) for k in order)
    assert ckpt.total_bytes == 7 * 2 * 4
    assert ckpt.group_bytes()["layers.2"] == 16


def test_single_file_and_streamed_tensors_are_file_views(tmp_path):
    save_file({"model.layers.0.w": torch.arange(1 << 16, dtype=torch.float32)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = Checkpoint(tmp_path)
    ((key, t),) = list(ckpt)
    assert key == "model.layers.0.w" and t[-1].item() == (1 << 16) - 1
    assert ckpt.tensors[key].nbytes == 4 << 16
    # a memory-mapped view, not a private copy: its storage cannot be resized
    assert not t.untyped_storage().resizable()


@pytest.mark.parametrize(
    "name,index",
    [
        ("model.layers.3.mlp.up_proj.weight", 3),
        ("model.layers.12", 12),
        ("model.layers.0.self_attn.qkv_proj", 0),
        ("model.embed_tokens.weight", None),
        ("model.norm.weight", None),
        ("lm_head.weight", None),
        ("model.layers_extra.1.weight", None),
    ],
)
def test_decoder_layer_index_of_keys_and_prefixes(name, index):
    assert decoder_layer(name) == index


def test_reload_report_lists_the_decoder_layers_it_touched():
    report = ReloadReport(["model.layers.2.self_attn.qkv_proj", "lm_head", "model.layers.0.mlp.down_proj.weight"])
    assert report.updated_decoder_layers == [0, 2]
