"""Mixture-of-experts under tensor parallelism on CPU (gloo, 127.0.0.1), both of vLLM's layouts: TP over the
experts' intermediate dimension and expert parallelism. A TP=N model equals the TP=1 model: logits in float32
within 1e-5 relative, FP8 shards with global scales byte for byte, reloads and weight sync as a fresh load.
Workers: tests/tp/workers.py."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.checkpoint import Checkpoint
from tests.hf_checkpoints import MOE_ARCHS, write_hf_checkpoint
from tests.tp import workers

IDS = torch.tensor([[1, 5, 9, 33, 70, 2, 127, 64, 3, 100, 17, 8]])
LAYOUTS = {"tp": False, "ep": True}
#: Qwen3-MoE sizes that split into whole 128-blocks at TP=2: attention, the dense layer and the experts
BLOCK_SIZES = dict(
    hidden=128,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=128,
    intermediate_size=256,
    moe_intermediate_size=256,
)


def _close(a, b, rtol):
    err = (a.double() - b.double()).abs().max() / b.double().abs().max()
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


def _bytes(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def _expected_slice(full: torch.Tensor, name: str, r: int, n: int, expert_parallel: bool) -> torch.Tensor:
    """Rank r's part of a TP=1 expert tensor [E, ...]: its experts, or its gate and up rows / down columns."""
    e = full.shape[0]
    if expert_parallel:
        return full[r * e // n : (r + 1) * e // n]
    if full.dim() == 1:  # per-tensor scale [E]
        return full
    if name.startswith("w13"):  # [E, 2I, ...]: gate rows then up rows, each sharded
        gate, up = full.chunk(2, dim=1)
        return torch.cat([gate.chunk(n, dim=1)[r], up.chunk(n, dim=1)[r]], dim=1)
    if name.startswith("w2_weight_scale") and full.dim() == 3 and full.shape[-1] == 1:  # per-row scale [E, H, 1]
        return full
    return full.chunk(n, dim=2)[r]  # w2 [E, H, I]: columns (block scales: block columns)


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_moe")
    return {arch: write_hf_checkpoint(root / arch, arch) for arch in MOE_ARCHS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_equal_tp1(tp2, moe_checkpoints, arch, layout):
    _assert_logits_equal_tp1(tp2, moe_checkpoints[arch], LAYOUTS[layout])


def _assert_logits_equal_tp1(pool, path, expert_parallel: bool) -> None:
    """Every rank's float32 logits equal the TP=1 model's within 1e-5 relative."""
    logits = layerwise.load_model(path, quantization=None, dtype="float32")(IDS)
    for out in pool.run(
        workers.load_and_forward, str(path), IDS, None, "float32", False, False, "cpu", expert_parallel
    ):
        _close(out["logits"], logits, 1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_moe_logits_equal_tp1_at_tp4(tp4, moe_checkpoints, arch, layout):
    _assert_logits_equal_tp1(tp4, moe_checkpoints[arch], LAYOUTS[layout])


@pytest.fixture(scope="module")
def block_moe(tmp_path_factory):
    """Qwen3-MoE whose experts split into whole 128-blocks at TP=2 (moe intermediate 256, hidden 128)."""
    root = tmp_path_factory.mktemp("tp_moe_block")
    return write_hf_checkpoint(root / "m", "Qwen3MoeForCausalLM", **BLOCK_SIZES)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("scheme", ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"])
def test_fp8_global_scales_expert_shards_are_slices_of_tp1(tp2, block_moe, scheme, layout):
    """global_scales: every rank's FP8 experts and scales are the matching experts (EP) or slices (TP) of the TP=1
    model's, byte for byte."""
    reference = {n: t.detach() for n, t in layerwise.load_model(block_moe, quantization=scheme).named_parameters()}
    expert_parallel = LAYOUTS[layout]
    results = tp2.run(workers.load_and_forward, str(block_moe), IDS, scheme, None, True, False, "cpu", expert_parallel)
    checked = 0
    for r, out in enumerate(results):
        for name, t in out["tensors"].items():
            if ".experts." not in name:
                continue
            expected = _expected_slice(reference[name], name.rsplit(".", 1)[1], r, 2, expert_parallel)
            assert t.shape == expected.shape and torch.equal(_bytes(t), _bytes(expected)), (r, name)
            checked += 1
    assert checked == 2 * 4  # 2 ranks x (w13, w2, and their scales) of the one MoE layer


def _expert_bytes(path) -> tuple[int, int]:
    """(bytes of the experts' tensors, bytes of the rest) of a checkpoint."""
    ckpt = Checkpoint(path)
    try:
        sizes = {k: info.nbytes for k, info in ckpt.tensors.items()}
    finally:
        ckpt.close()
    experts = sum(n for k, n in sizes.items() if ".experts." in k)
    return experts, sum(sizes.values()) - experts


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bytes_read_and_peak_per_rank(tp2, moe_checkpoints, layout):
    """Each rank reads half of the experts' bytes (half of every expert, or half of the experts) and at most the
    rest of the checkpoint; its peak above its model stays within one expert unit plus the quantization's work
    buffer."""
    path = moe_checkpoints["Qwen3MoeForCausalLM"]
    experts, rest = _expert_bytes(path)
    results = tp2.run(workers.load_and_forward, str(path), IDS, "fp8", None, False, True, "cpu", LAYOUTS[layout])
    tp1 = layerwise.load_model_with_report(path, quantization="fp8")[1]
    for out in results:
        report = out["report"]
        non_expert = report["bytes_read"] - experts // 2
        assert rest // 2 <= non_expert <= rest, report["bytes_read"]  # dense parts: sharded or replicated
        assert report["largest_unit_bytes"] <= tp1.largest_unit_bytes
        assert report["peak_bytes"] - report["model_bytes"] <= report["largest_unit_bytes"] + (1 << 20)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reload_under_tp_equals_fresh_load(tp2, tmp_path, layout):
    paths = [str(write_hf_checkpoint(tmp_path / f"m{seed}", "MixtralForCausalLM", seed=seed)) for seed in (0, 1)]
    for out in tp2.run(workers.reload_keeps_pointers, *paths, "fp8", LAYOUTS[layout]):
        assert out["ptrs_kept"] and out["equal"] and out["updated"] > 0, out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_partial_stream_changes_only_the_experts_sent(tp2, tmp_path, layout):
    a = write_hf_checkpoint(tmp_path / "a", "Qwen3MoeForCausalLM", seed=0)
    b = write_hf_checkpoint(tmp_path / "b", "Qwen3MoeForCausalLM", seed=1)
    sent = {1, 6}
    ckpt = Checkpoint(b)
    try:
        stream = [(k, t.clone()) for k, t in ckpt if any(f".experts.{e}." in k for e in sent)]
    finally:
        ckpt.close()
    assert len(stream) == 2 * 3  # one MoE layer: gate, up, down of two experts
    results = tp2.run(workers.partial_expert_reload, str(a), stream, LAYOUTS[layout])
    owned = [set(changed) for changed in results]
    if LAYOUTS[layout]:  # expert parallelism: rank 0 holds experts 0-3, rank 1 experts 4-7
        assert [sorted(e for _, e in keys) for keys in owned] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for changed in results:
        for (_, expert), did in changed.items():
            assert did == (expert in sent), (expert, did)


def test_unsplittable_moe_layers_fail_before_loading(tp2, tmp_path):
    five = write_hf_checkpoint(tmp_path / "five", "Qwen3MoeForCausalLM", num_experts=5)
    for kind, message in tp2.run(workers.load_error, str(five), "fp8", True):
        assert kind == "TensorParallelError" and "num_experts" in message and "5" in message, message
    # per-block scales and a moe intermediate size of 128 / 2 = 64 rows per rank: a block would be split (the
    # attention and dense layers split into whole blocks)
    path = write_hf_checkpoint(
        tmp_path / "small", "Qwen3MoeForCausalLM", **dict(BLOCK_SIZES, moe_intermediate_size=128)
    )
    for kind, message in tp2.run(workers.load_error, str(path), "fp8-per-block", False):
        assert kind == "TensorParallelError" and "128" in message and "experts" in message, message


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_weight_sync_into_a_tp2_moe_engine(tp2, tmp_path, layout):
    """A trainer (rank 0) broadcasts the full BF16 tensors; each engine rank keeps its experts or slices (the others
    are skipped) and ends equal to a fresh TP=2 load of the trainer's weights, data_ptrs kept."""
    from layerwise.transfer import tensor_metadata
    from tests.transfer.harness import Trainer, checkpoint_tensors, free_port

    a = str(write_hf_checkpoint(tmp_path / "a", "Qwen3MoeForCausalLM", seed=0))
    b = str(write_hf_checkpoint(tmp_path / "b", "Qwen3MoeForCausalLM", seed=1))
    trainer = Trainer()
    try:
        info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 3}
        info["timeout_seconds"] = 60
        tp2.submit(workers.engine_join_transfer, a, info, LAYOUTS[layout])
        trainer.send("nccl_init", (info, "cpu"))
        assert tp2.collect() == [0, 1]
        trainer.expect_ok()
        tensors = checkpoint_tensors(b)
        args = {"packed": True, "packed_buffer_size_bytes": 1 << 16}
        update_info = dict(tensor_metadata(tensors), is_checkpoint_format=True, **args)
        tp2.submit(workers.engine_update_and_compare, update_info, b, [1, 5, 9], LAYOUTS[layout])
        trainer.send("nccl_send", (tensors, args, None, None))
        results = tp2.collect()
        trainer.expect_ok()
    finally:
        trainer.close()
    for out in results:
        assert out["equal"] and out["ptrs_kept"]
    assert results[0]["tokens"] == results[1]["tokens"]


def _expert_stream(path, experts, corrupt=None):
    ckpt = Checkpoint(path)
    try:
        stream = [(k, t.clone()) for k, t in ckpt if any(f".experts.{e}." in k for e in experts)]
    finally:
        ckpt.close()
    return [(k, corrupt(k, t) if corrupt else t) for k, t in stream]


def test_a_nan_in_one_ranks_slice_fails_every_rank(tp2, moe_checkpoints):
    """TP over the experts with global scales, per channel (w13's scales are not reduced): a NaN in rank 0's rows of
    an expert's gate fails both ranks at that expert, instead of leaving rank 1 waiting in a later reduction."""
    path = moe_checkpoints["Qwen3MoeForCausalLM"]

    def nan_row_0(key, t):
        if key.endswith("experts.2.gate_proj.weight"):
            t = t.clone()
            t[0, 0] = float("nan")
        return t

    stream = _expert_stream(path, [2, 3], nan_row_0)
    for out in tp2.run(workers.reload_error, str(path), stream, "fp8-per-channel", False):
        assert out is not None and out[0] == "NonFiniteWeightError", out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_misshapen_expert_fails_every_rank(tp2, moe_checkpoints, layout):
    """Expert parallelism: the ranks that skip an expert still check its shape and dtype (from its metadata), so a bad
    tensor fails every rank alike."""
    path = moe_checkpoints["Qwen3MoeForCausalLM"]
    stream = _expert_stream(path, [1], lambda k, t: t[:-1] if k.endswith("gate_proj.weight") else t)
    for out in tp2.run(workers.reload_error, str(path), stream, "fp8", LAYOUTS[layout]):
        assert out is not None and out[0] == "WeightShapeError" and "experts.1.gate_proj" in out[1], out
