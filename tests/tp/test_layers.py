"""Sharding rules of the parallel layers, checked in one process with a TPContext of rank r of N (no
collectives: only construction and weight loading)."""

from __future__ import annotations

import pytest
import torch

from layerwise.checkpoint import Checkpoint
from layerwise.distributed import TPContext
from layerwise.errors import TensorParallelError
from layerwise.layers.embedding import VocabParallelEmbedding
from layerwise.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from layerwise.quant.base import UnquantizedLinearMethod
from layerwise.quant.fp8 import Fp8LinearMethod
from layerwise.quant.parameters import ModelWeightParameter, default_weight_loader


def _qkv(rank, size, heads=4, kv=2, head_dim=2, quant=None):
    return QKVParallelLinear(
        8,
        head_dim,
        heads,
        kv,
        bias=True,
        quant_method=quant or UnquantizedLinearMethod(),
        params_dtype=torch.float32,
        prefix="layers.0.qkv_proj",
        tp=TPContext(None, rank, size),
    )


def _load(layer, name, tensor, shard_id=None):
    param = getattr(layer, name)
    layer.weight_loader(param, tensor, shard_id)
    return param.data


def test_row_parallel_weight_narrows_input_dim_not_output_dim():
    """A [out, in] weight carries both output_dim and input_dim: row-parallel layers take columns."""
    full = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    for r in range(2):
        layer = RowParallelLinear(
            8,
            4,
            bias=True,
            quant_method=UnquantizedLinearMethod(),
            params_dtype=torch.float32,
            tp=TPContext(None, r, 2),
        )
        assert torch.equal(_load(layer, "weight", full), full[:, 4 * r : 4 * r + 4])
        bias = torch.arange(4.0)
        assert torch.equal(_load(layer, "bias", bias), bias)  # replicated


def test_load_shard_dim_input_on_a_two_dim_parameter():
    p = ModelWeightParameter(torch.zeros(3, 4), default_weight_loader, output_dim=0, input_dim=1)
    full = torch.arange(12.0 * 2).view(3, 8)
    p.load_shard(full, tp_rank=1, tp_size=2, dim="input")
    assert torch.equal(p, full[:, 4:])


@pytest.mark.parametrize("size", [2, 4])
def test_qkv_heads_per_rank_and_replicated_kv_head(size):
    q, k, v = (torch.randn(n * 2, 8) for n in (4, 2, 2))
    for r in range(size):
        layer = _qkv(r, size)
        for shard, t in zip("qkv", (q, k, v), strict=True):
            _load(layer, "weight", t, shard)
        q_rows = 2 * (4 // size)  # head_dim 2
        kv_head = r if size == 2 else r * 2 // 4  # tp=4 > 2 kv heads: head r*K//N, on two ranks each
        kv = slice(2 * kv_head, 2 * kv_head + 2)
        expected = torch.cat([q[q_rows * r : q_rows * (r + 1)], k[kv], v[kv]])
        assert torch.equal(layer.weight.data, expected)
        assert (layer.num_heads_per_rank, layer.num_kv_heads_per_rank) == (4 // size, 1)


def test_fused_checkpoint_tensor_is_split_per_part():
    """Phi-3 stores qkv_proj and gate_up_proj fused: each part is narrowed to the rank's rows."""
    q, k, v = (torch.randn(n * 2, 8) for n in (4, 2, 2))
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    for r in range(2):
        parts, fused = _qkv(r, 2), _qkv(r, 2)
        for shard, t in zip("qkv", (q, k, v), strict=True):
            _load(parts, "weight", t, shard)
        assert torch.equal(_load(fused, "weight", torch.cat([q, k, v])), parts.weight.data)
        mlp = MergedColumnParallelLinear(
            8,
            [6, 6],
            checkpoint_shards={"gate_proj": 0, "up_proj": 1},
            bias=False,
            quant_method=UnquantizedLinearMethod(),
            params_dtype=torch.float32,
            tp=TPContext(None, r, 2),
        )
        assert torch.equal(
            _load(mlp, "weight", torch.cat([gate, up])), torch.cat([gate[3 * r : 3 * r + 3], up[3 * r : 3 * r + 3]])
        )


def test_vocab_padding_rows_are_zero():
    table = torch.randn(130, 4)
    for r in range(4):
        emb = VocabParallelEmbedding(130, 4, params_dtype=torch.float32, tp=TPContext(None, r, 4))
        emb.weight.data.fill_(7)
        _load(emb, "weight", table)
        real = 33 if r < 3 else 31
        assert emb.weight.shape == (33, 4) and torch.equal(emb.weight[:real], table[33 * r : 33 * r + real])
        assert not emb.weight[real:].any()


def test_sizes_that_do_not_split_name_the_layer_and_sizes():
    with pytest.raises(TensorParallelError, match=r"layers.0.qkv_proj: num_attention_heads=4 .* size 3"):
        _qkv(0, 3)
    with pytest.raises(TensorParallelError, match=r"tensor-parallel size 4 is larger than num_key_value_heads=3"):
        _qkv(0, 4, heads=4, kv=3)


def test_per_block_fp8_shard_must_hold_whole_blocks():
    with pytest.raises(TensorParallelError, match=r"layers.0.qkv_proj: per-rank output sizes \[128, 64, 64\].*128"):
        _qkv(0, 2, heads=4, kv=2, head_dim=64, quant=Fp8LinearMethod("block"))
    _qkv(0, 2, heads=4, kv=4, head_dim=64, quant=Fp8LinearMethod("block"))  # [128, 128, 128]: whole blocks


def test_lazy_slice_reads_only_its_bytes(hf_checkpoint):
    _, path = hf_checkpoint
    ckpt = Checkpoint(path)
    key = "model.layers.0.mlp.down_proj.weight"  # [64, 160] BF16
    lazy = dict(ckpt.iter_lazy())[key]
    assert ckpt.bytes_read == 0 and lazy.shape == (64, 160)
    part = lazy.narrow(1, 80, 80).materialize()
    assert torch.equal(part, ckpt.get_tensor(key)[:, 80:])
    assert ckpt.bytes_read == 64 * 80 * 2
    ckpt.close()


def test_tp_engine_takes_weights_over_nccl_only(tmp_path):
    import layerwise
    from layerwise.engine import Engine
    from tests.hf_checkpoints import write_hf_checkpoint

    model = layerwise.load_model(write_hf_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", num_layers=1))
    model.tp = TPContext(None, 1, 2)  # as if rank 1 of 2 (no collective runs here)
    with pytest.raises(ValueError, match="nccl only, not 'ipc'"):
        Engine(model).init_weight_transfer_engine("ipc", {})


def test_a_rank_past_the_vocabulary_holds_only_padding():
    import torch

    from layerwise.distributed import TPContext
    from layerwise.layers.embedding import VocabParallelEmbedding

    layer = VocabParallelEmbedding(5, 2, params_dtype=torch.float32, tp=TPContext(None, 3, 4))  # rows 6, 7
    assert layer.num_real_rows == 0
    layer.weight_loader(layer.weight, torch.randn(5, 2))
    assert not layer.weight.any()


def test_lazy_narrow_past_the_end_is_an_error(tmp_path):
    import pytest
    import torch
    from safetensors.torch import save_file

    from layerwise.checkpoint import Checkpoint

    (tmp_path / "config.json").write_text("{}")
    save_file({"w": torch.randn(4, 3)}, str(tmp_path / "model.safetensors"))
    lazy = dict(Checkpoint(tmp_path).iter_lazy())["w"]
    with pytest.raises(IndexError):
        lazy.narrow(0, 3, 5)
    assert lazy.narrow(0, 1, 3).materialize().shape == (3, 3)
