"""Tensor parallelism on CPU (gloo, 127.0.0.1): a TP=N load equals the TP=1 load.

BF16 checkpoints in fp32 compute: logits within 1e-5 relative. FP8 with global scales: each rank's FP8
shard is the matching slice of the TP=1 kernel tensor, byte for byte. Workers: tests/tp/workers.py.
"""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.api import load_model_with_report
from layerwise.transfer import tensor_metadata
from tests.hf_checkpoints import write_hf_checkpoint
from tests.tp import workers
from tests.transfer.harness import Trainer, checkpoint_tensors, free_port

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 127, 64, 3, 100, 17, 8]])


def _close(a, b, rtol):
    err = (a.double() - b.double()).abs().max() / b.double().abs().max()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def _rows(full, r, n):
    k = full.shape[0] // n
    return full[r * k : (r + 1) * k]


def _cols(full, r, n):
    k = full.shape[1] // n
    return full[:, r * k : (r + 1) * k]


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_bf16_logits_equal_tp1(tp2, hf_checkpoint):
    arch, path = hf_checkpoint
    reference = layerwise.load_model(path, quantization=None, dtype="float32")
    logits = reference(IDS)
    full_numel = {p: info.load_numel_total for p, info in workers._infos(reference)}
    results = tp2.run(workers.load_and_forward, str(path), IDS, None, "float32")
    for rank, out in enumerate(results):
        _close(out["logits"], logits, 1e-5)
        assert out["tensors"]["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == (4 * 16 + 2 * 2 * 16) // 2
        assert (out["report"]["tp_rank"], out["report"]["tp_size"]) == (rank, 2)
        # load_numel counts the rank's elements: half of every sharded module, all of a replicated one
        for prefix, numel in out["load_numel_total"].items():
            sharded = "proj" in prefix or "embed" in prefix or "lm_head" in prefix
            assert numel == (full_numel[prefix] // 2 if sharded else full_numel[prefix]), prefix


@pytest.mark.parametrize("arch", ["Phi3ForCausalLM", "MistralForCausalLM"])
def test_fused_checkpoint_and_sliding_window_models_under_tp(tp2, tmp_path, arch):
    """Phi-3 stores qkv_proj and gate_up_proj fused (split per part on each rank); Mistral: sliding window."""
    path = write_hf_checkpoint(tmp_path / "m", arch)
    logits = layerwise.load_model(path, quantization=None, dtype="float32")(IDS)
    for out in tp2.run(workers.load_and_forward, str(path), IDS, None, "float32"):
        _close(out["logits"], logits, 1e-5)


def test_fp8_global_scales_shards_are_slices_of_tp1(tp2, hf_checkpoint):
    arch, path = hf_checkpoint
    reference = layerwise.load_model(path, quantization="fp8", dtype="float32")
    ref = {n: t.detach() for n, t in reference.named_parameters()}
    ref_logits = reference(IDS)
    results = tp2.run(workers.load_and_forward, str(path), IDS, "fp8", "float32", True)
    for r, out in enumerate(results):
        got = out["tensors"]
        for i in range(2):
            p = f"model.layers.{i}."
            q, kv = 4 * 16, 2 * 16
            qkv = ref[p + "self_attn.qkv_proj.weight"]
            parts = (qkv[:q], qkv[q : q + kv], qkv[q + kv :])
            expected = {
                "self_attn.qkv_proj.weight": torch.cat([_rows(x, r, 2) for x in parts]),
                "mlp.gate_up_proj.weight": torch.cat(
                    [_rows(x, r, 2) for x in ref[p + "mlp.gate_up_proj.weight"].chunk(2)]
                ),
                "self_attn.o_proj.weight": _cols(ref[p + "self_attn.o_proj.weight"], r, 2),
                "mlp.down_proj.weight": _cols(ref[p + "mlp.down_proj.weight"], r, 2),
            }
            for name, want in expected.items():
                assert got[p + name].dtype == torch.float8_e4m3fn
                assert torch.equal(_bytes(got[p + name]), _bytes(want)), f"rank {r}: {p + name}"
                scale = name.replace("weight", "weight_scale")
                assert torch.equal(got[p + scale], ref[p + scale]), f"rank {r}: {p + scale}"
        _close(out["logits"], ref_logits, 1e-5)


def test_local_scales_by_default(tp2, hf_checkpoint):
    """Without global_scales each rank's per-tensor scale is its own shard's amax / 448 (vLLM)."""
    arch, path = hf_checkpoint
    if arch != "LlamaForCausalLM":
        pytest.skip("one architecture is enough")
    unquantized = tp2.run(workers.load_and_forward, str(path), IDS, None, "float32")
    fp8 = tp2.run(workers.load_and_forward, str(path), IDS, "fp8", "float32")
    name = "model.layers.0.mlp.down_proj.weight"
    for r in range(2):
        amax = unquantized[r]["tensors"][name].abs().max()
        assert torch.equal(fp8[r]["tensors"][name.replace("weight", "weight_scale")], (amax / 448).reshape(1))


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-reload")
    return [str(write_hf_checkpoint(root / n, "Qwen3ForCausalLM", seed=s)) for n, s in (("a", 1), ("b", 2))]


def test_reload_under_tp_equals_fresh_load(tp2, two_checkpoints):
    a, b = two_checkpoints
    for out in tp2.run(workers.reload_keeps_pointers, a, b, "fp8"):
        assert out == {"ptrs_kept": True, "equal": True, "updated": out["updated"]} and out["updated"] > 0


def test_weight_sync_into_a_tp2_engine(tp2, two_checkpoints):
    """A trainer (rank 0) broadcasts BF16 tensors; engine rank r joins the transfer group as rank_offset + r,
    keeps its slices, and ends up equal to a fresh TP load of the trainer's weights (data_ptrs kept)."""
    a, b = two_checkpoints
    trainer = Trainer()
    try:
        info = {
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 3,
            "timeout_seconds": 60,
        }
        tp2.submit(workers.engine_join_transfer, a, info)
        trainer.send("nccl_init", (info, "cpu"))
        assert tp2.collect() == [0, 1]  # each engine rank's worker_rank is its TP rank
        trainer.expect_ok()
        tensors = checkpoint_tensors(b)
        args = {"packed": True, "packed_buffer_size_bytes": 1 << 16}
        update_info = dict(tensor_metadata(tensors), is_checkpoint_format=True, **args)
        tp2.submit(workers.engine_update_and_compare, update_info, b, [1, 5, 9])
        trainer.send("nccl_send", (tensors, args, None, None))
        results = tp2.collect()
        trainer.expect_ok()
    finally:
        trainer.close()
    for out in results:
        assert out["equal"] and out["ptrs_kept"]
    assert results[0]["tokens"] == results[1]["tokens"]


def test_bytes_read_and_peak_per_rank(tp2, qwen3_8_layers):
    _, tp1 = load_model_with_report(qwen3_8_layers, quantization="fp8")
    assert tp1.bytes_read == tp1.checkpoint_bytes
    results = tp2.run(workers.load_and_forward, str(qwen3_8_layers), IDS, "fp8", None, False, True)
    for out in results:
        rep = out["report"]
        # sharded weights: half each; replicated: norms (a few KiB)
        assert rep["bytes_read"] < 0.52 * tp1.bytes_read, (rep["bytes_read"], tp1.bytes_read)
        assert rep["model_bytes"] < 0.55 * tp1.model_bytes
        # peak: this rank's FP8 share plus about one of its modules in BF16: the TP=1 bound (1.25 layers,
        # tests/test_memory.py) halved; measured 0.60 of a layer at tp=2 (1.20 at tp=1)
        assert rep["peak_bytes"] - rep["model_bytes"] <= 1.25 * tp1.largest_layer_checkpoint_bytes / 2, rep


def test_model_that_cannot_be_sharded_fails_before_loading(tp2, tmp_path):
    path = write_hf_checkpoint(tmp_path / "m", "MistralForCausalLM", num_attention_heads=3, num_key_value_heads=1)
    for kind, message in tp2.run(workers.load_error, str(path)):
        assert kind == "TensorParallelError"
        assert "num_attention_heads=3" in message and "tensor-parallel size 2" in message


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_tp4_replicated_kv_heads_and_uneven_vocab(tp4, tmp_path, arch):
    """num_key_value_heads=2 at tp=4: each kv head on two ranks; vocab 130 padded to 132 (33 rows a rank).
    Llama's LM head is its own, Qwen2's is tied to the embedding."""
    path = write_hf_checkpoint(tmp_path / "m", arch, vocab=130)
    reference = layerwise.load_model(path, quantization=None, dtype="float32")
    ref = {n: t.detach() for n, t in reference.named_parameters()}
    ids = torch.tensor([[0, 129, 99, 98, 33, 32, 66, 65, 1, 128]])  # ids next to every rank's vocab boundary
    results = tp4.run(workers.load_and_forward, str(path), ids, None, "float32")
    for r, out in enumerate(results):
        _close(out["logits"], reference(ids), 1e-5)
        qkv, full = (
            out["tensors"]["model.layers.0.self_attn.qkv_proj.weight"],
            ref["model.layers.0.self_attn.qkv_proj.weight"],
        )
        kv_head = r * 2 // 4
        assert torch.equal(qkv[:16], full[16 * r : 16 * (r + 1)])  # one query head
        assert torch.equal(qkv[16:32], full[64 + 16 * kv_head : 64 + 16 * (kv_head + 1)])  # its k head
        assert torch.equal(qkv[32:], full[96 + 16 * kv_head : 96 + 16 * (kv_head + 1)])  # its v head
        embed = out["tensors"]["model.embed_tokens.weight"]
        real = min(33, 130 - 33 * r)
        assert embed.shape[0] == 33 and torch.equal(
            embed[:real], ref["model.embed_tokens.weight"][33 * r : 33 * r + real]
        )
        assert not embed[real:].any()


def test_no_tp_group_means_no_sharding_whatever_the_world_size(tp2, hf_checkpoint):
    _, path = hf_checkpoint
    assert tp2.run(workers.load_without_group, str(path)) == [(None, 1, (128, 64))] * 2


@pytest.mark.parametrize("scheme", ["fp8-per-channel", "fp8-per-block"])
def test_per_channel_and_per_block_scales_shard_with_rows_and_blocks(tp2, tmp_path, scheme):
    """global_scales, shards of whole 128-blocks (2 heads of 128, kv heads 2, hidden 256, intermediate 512 at
    tp=2): each rank's FP8 weight and scales are the matching rows/columns (blocks) of the TP=1 tensors, byte
    for byte. Per-channel scales of row-parallel layers are every row's, reduced over the ranks."""
    path = write_hf_checkpoint(
        tmp_path / "m",
        "MistralForCausalLM",
        hidden=256,
        intermediate=512,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=128,
    )
    reference = layerwise.load_model(path, quantization=scheme, dtype="float32")
    ref = {n: t.detach() for n, t in reference.named_parameters()}
    ids = IDS % 128
    results = tp2.run(workers.load_and_forward, str(path), ids, scheme, "float32", True)
    scale = "weight_scale" if scheme == "fp8-per-channel" else "weight_scale_inv"
    for r, out in enumerate(results):
        got = out["tensors"]
        for layer in ("self_attn.qkv_proj", "mlp.gate_up_proj"):  # column-parallel: rows of every part
            name = f"model.layers.0.{layer}"
            w, s = ref[f"{name}.weight"], ref[f"{name}.{scale}"]
            parts = 3 if "qkv" in layer else 2
            expected_w = torch.cat([_rows(x, r, 2) for x in w.chunk(parts)])
            expected_s = torch.cat([_rows(x, r, 2) for x in s.chunk(parts)])
            assert torch.equal(_bytes(got[f"{name}.weight"]), _bytes(expected_w)), (r, name)
            assert torch.equal(got[f"{name}.{scale}"], expected_s), (r, name)
        for layer in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: columns (and block columns)
            name = f"model.layers.0.{layer}"
            assert torch.equal(_bytes(got[f"{name}.weight"]), _bytes(_cols(ref[f"{name}.weight"], r, 2))), (r, name)
            s = ref[f"{name}.{scale}"]  # per channel: every row's scale, reduced over the ranks (global_scales)
            assert torch.equal(got[f"{name}.{scale}"], s if scheme == "fp8-per-channel" else _cols(s, r, 2)), (r, name)
        _close(out["logits"], reference(ids), 1e-5)


def test_a_tp_engine_samples_the_same_tokens_on_every_rank(tp2, hf_checkpoint):
    """Sampling under TP: every rank's global RNG differs, yet all ranks generate the same tokens (the first rank's
    draws), more prompts than slots; a seeded request equals a TP=1 engine's with the same seed."""
    from layerwise.engine import Engine
    from layerwise.sampling_params import SamplingParams

    _, path = hf_checkpoint
    prompts = [[1, 5, 9], [7, 3, 2, 8], [4, 4], [11]]
    ranks = tp2.run(workers.engine_sample, str(path), prompts, True)
    assert ranks[0] == ranks[1]
    single = Engine(layerwise.load_model(path, quantization=None, dtype="float32"), max_batch_size=2, max_seq_len=32)
    seeded = single.generate(prompts[1], SamplingParams(temperature=1.0, max_tokens=8, seed=5))[0].outputs[0]
    assert ranks[0][1] == seeded.token_ids


def test_a_tp_engine_calibrates_the_fp8_kv_cache_as_tp1(tp2, hf_checkpoint):
    """kv_cache_dtype="fp8" under TP: each rank holds some KV heads, and the ranks agree on the amax of all of them,
    so every rank's scales equal a TP=1 engine's (not its own heads' range), and so do the greedy tokens."""
    from layerwise.engine import Engine
    from layerwise.sampling_params import SamplingParams

    _, path = hf_checkpoint
    prompt = [1, 5, 9, 2]
    ranks = tp2.run(workers.engine_kv_scales, str(path), prompt)
    model = layerwise.load_model(path, quantization=None, dtype="float32")
    single = Engine(model, max_batch_size=1, max_seq_len=32, kv_cache_dtype="fp8")
    (out,) = single.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    for scales, tokens in ranks:
        torch.testing.assert_close(scales, single.kv_scales(), rtol=1e-6, atol=0)
        assert tokens == out.outputs[0].token_ids
