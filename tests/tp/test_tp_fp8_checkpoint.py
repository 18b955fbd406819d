"""A pre-quantized FP8 block checkpoint under tensor parallelism (gloo, 2 ranks): every rank's FP8 weight and
weight_scale_inv are the matching rows / columns (blocks) of the file's tensors, byte for byte, and the logits equal
the TP=1 model's; a reload keeps every data_ptr and equals a fresh load."""

from __future__ import annotations

import torch

import layerwise
from tests.fp8_checkpoints import write_fp8_checkpoint
from tests.hf_checkpoints import write_hf_checkpoint
from tests.tp import workers

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 127, 64, 3, 100, 17, 8]])
SIZES = dict(hidden=256, intermediate=512, num_attention_heads=2, num_key_value_heads=2, head_dim=128)


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _half(t, r, dim, parts=1):
    """Rank r's half of each of ``parts`` stacked parts of ``t`` along ``dim``."""
    return torch.cat([c.chunk(2, dim)[r] for c in t.chunk(parts, dim)], dim)


def test_fp8_block_checkpoint_shards_are_slices_of_the_file(tp2, tmp_path):
    bf16 = write_hf_checkpoint(tmp_path / "bf16", "MistralForCausalLM", **SIZES)
    files = write_fp8_checkpoint(bf16, tmp_path / "fp8", "block")
    reference = layerwise.load_model(tmp_path / "fp8", dtype="float32")(IDS)
    for r, out in enumerate(tp2.run(workers.load_fp8_checkpoint, str(tmp_path / "fp8"), IDS)):
        got = out["tensors"]
        for layer, parts in (("self_attn.qkv_proj", ("q", "k", "v")), ("mlp.gate_up_proj", ("gate", "up"))):
            section = layer.split(".")[0]
            pairs = [files[f"model.layers.1.{section}.{p}_proj.weight"] for p in parts]
            weight = torch.cat([_half(q, r, 0) for q, _ in pairs])
            scale = torch.cat([_half(s, r, 0) for _, s in pairs])
            assert torch.equal(_bytes(got[f"model.layers.1.{layer}.weight"]), _bytes(weight)), (r, layer)
            assert torch.equal(got[f"model.layers.1.{layer}.weight_scale_inv"], scale), (r, layer)
        for layer in ("self_attn.o_proj", "mlp.down_proj"):
            q, s = files[f"model.layers.1.{layer}.weight"]
            assert torch.equal(_bytes(got[f"model.layers.1.{layer}.weight"]), _bytes(_half(q, r, 1))), (r, layer)
            assert torch.equal(got[f"model.layers.1.{layer}.weight_scale_inv"], _half(s, r, 1)), (r, layer)
        err = (out["logits"].double() - reference.double()).abs().max() / reference.double().abs().max()
        assert err < 1e-5, err


def test_fp8_checkpoint_reload_under_tp_keeps_pointers_and_equals_a_fresh_load(tp2, tmp_path):
    paths = []
    for seed in (0, 1):
        bf16 = write_hf_checkpoint(tmp_path / f"bf16_{seed}", "MistralForCausalLM", seed=seed, **SIZES)
        write_fp8_checkpoint(bf16, tmp_path / f"fp8_{seed}", "block")
        paths.append(str(tmp_path / f"fp8_{seed}"))
    for out in tp2.run(workers.reload_keeps_pointers, *paths, "fp8"):
        assert out["ptrs_kept"] and out["equal"] and out["updated"] > 0, out
