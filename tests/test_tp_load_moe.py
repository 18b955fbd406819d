"""``python -m layerwise.benchmarks.tp_load --moe`` on the tiny MoE checkpoint at tp=2 (gloo on 127.0.0.1, both
layouts): the JSON's fields, every rank's bytes read within its target (1/tp + the parts every rank reads whole),
and the docs table rendered from it."""

import json

import pytest

from layerwise.benchmarks import moe_load, readme, tp_load
from layerwise.checkpoint import Checkpoint


def test_read_target_counts_norms_routers_and_replicated_kv_heads(tmp_path):
    path = moe_load.make_checkpoint("test", tmp_path, num_hidden_layers=1)
    ckpt = Checkpoint(path)
    sizes = {k: info.nbytes for k, info in ckpt.tensors.items()}
    ckpt.close()
    norms = sum(n for k, n in sizes.items() if k.endswith("norm.weight"))
    router = sizes["model.layers.0.mlp.gate.weight"]
    kv = sizes["model.layers.0.self_attn.k_proj.weight"] + sizes["model.layers.0.self_attn.v_proj.weight"]
    target = tp_load.read_target(path, 2)  # one kv head, two ranks: each reads k_proj and v_proj whole
    assert target["replicated_bytes"] == norms + router + kv
    assert target["sharded_bytes"] + target["replicated_bytes"] == target["checkpoint_bytes"] == sum(sizes.values())
    assert target["target_fraction"] == pytest.approx(0.5 + (norms + router + kv) / sum(sizes.values()))
    assert tp_load.read_target(path, 1)["expected_bytes_read"] == sum(sizes.values())
    assert tp_load.expert_unit_bytes(path, 2, expert_parallel=False) == 2 * 16 * 64 * 2  # gate + up, I/2 rows each
    assert tp_load.expert_unit_bytes(path, 2, expert_parallel=True) == 2 * 32 * 64 * 2


@pytest.mark.slow  # about 15 s: two sets of two spawned ranks, three loads each
def test_moe_benchmark_at_tp2_meets_the_bytes_read_target(tmp_path, monkeypatch):
    monkeypatch.setattr(tp_load, "WAIT_SECONDS", 120.0)  # every wait for a rank's result
    args = ["--moe", "--size", "test", "--layers", "1", "--tp", "2", "--layouts", "tp,ep"]
    assert tp_load.main([*args, "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]) == 0
    result = json.loads((tmp_path / "tp_load_moe_cpu.json").read_text())
    assert result["benchmark"] == "tp_load_moe" and result["device"] == "cpu" and result["backend"] == "gloo"
    for field in ("device_name", "versions", "commit", "date", "machine"):
        assert result[field], field
    assert result["size"] == "test" and result["shape"]["num_hidden_layers"] == 1
    assert result["shape"]["num_experts"] == moe_load.NUM_EXPERTS
    assert result["global_scales"] is True and result["quantization"] == "fp8"
    assert [(run["tp"], run["layout"], run["expert_parallel"]) for run in result["results"]] == [
        (2, "tp", False),
        (2, "ep", True),
    ]
    for run in result["results"]:
        target = run["read_target"]
        assert run["slowest_rank_seconds"] == max(r["seconds"] for r in run["ranks"]) > 0
        assert [r["rank"] for r in run["ranks"]] == [0, 1]
        for r in run["ranks"]:
            assert r["checkpoint_bytes"] == target["checkpoint_bytes"]
            # its share of the sharded tensors plus the replicated ones, no more
            assert target["sharded_bytes"] / 2 <= r["bytes_read"] <= target["target_fraction"] * r["checkpoint_bytes"]
            assert r["bytes_read"] == target["expected_bytes_read"]
            assert r["meets_read_target"] and r["bytes_read_fraction"] == r["bytes_read"] / r["checkpoint_bytes"]
            assert r["peak_bytes"] >= r["model_bytes"] > 0 and r["largest_unit_bytes"] > 0
            assert r["peak_target_bytes"] == run["expert_unit_bytes"] + tp_load.WORK_BUFFER_BYTES
            assert r["meets_peak_target"] == (r["peak_minus_model_bytes"] <= r["peak_target_bytes"])
            assert r["tracked_seconds"] > 0
    table = readme.tp_load_moe_table(result).splitlines()
    assert len(table) == 4 and table[2].startswith("| 2 | tp |") and table[3].startswith("| 2 | ep |")
    assert "### Tensor-parallel load, mixture of experts" in readme._tp_load_moe(result)
