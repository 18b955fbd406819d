"""The benchmark suite's CUDA paths on a tiny checkpoint: GPU-drawn generation, the pinned stream and H2D
copy floor, CUDA-graph decode steps, the first/second load on the GPU. Skipped without a GPU; on CPU,
tests/test_benchmarks.py runs the same driver with the GPU-only part recorded as skipped."""

import json
import math

import pytest
import torch

from layerwise.benchmarks import checkpoints, suite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_gpu_drawn_checkpoint_looks_like_weights(tmp_path):
    from safetensors import safe_open

    path = checkpoints.make_checkpoint("small", tmp_path, device="cuda")
    shard = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]["model.embed_tokens.weight"]
    with safe_open(str(path / shard), "pt") as f:
        t = f.get_tensor("model.embed_tokens.weight").float()
    assert 0.75 * 0.02 * 0.95 < t.std().item() < 1.25 * 0.02 * 1.05
    assert len(list(path.glob("*.safetensors"))) > 1


def test_suite_on_cuda_small_records_every_part(tmp_path):
    out = tmp_path / "out"
    args = ["--device", "cuda", "--size", "small", "--out-dir", str(out), "--cache-dir", str(tmp_path / "c")]
    subsets = [
        "--methods",
        "floor-read-copy,layerwise-fp8-per-tensor,layerwise-fp8-per-block",
        "--schemes",
        "none,fp8-per-tensor",
        "--configs",
        "none,fp8-per-tensor/w8a8,fp8-per-tensor/w8a16,fp8-per-channel/w8a8,fp8-per-channel/w8a16",
    ]
    assert suite.main([*args, *subsets, "--budget", "400"]) == 0
    summary = json.loads((out / "suite_cuda_small.json").read_text())
    assert summary["device_name"] == torch.cuda.get_device_name()
    pm = {r["method"]: r for r in json.loads((out / "peak_memory_cuda_small.json").read_text())["results"]}
    for method in ("floor-read-copy", "layerwise-fp8-per-tensor", "layerwise-fp8-per-block"):
        assert "error" not in pm[method], pm[method]
        assert pm[method]["tracker"] == "cuda-allocator" and pm[method]["first_minus_second_seconds"] is not None
    rl = json.loads((out / "reload_latency_cuda_small.json").read_text())["results"]
    floor = next(r for r in rl if r.get("source") == "floor")
    assert floor["pinned"] is True
    assert {r["scheme"] for r in rl if r.get("source") == "stream" and "error" not in r} == {"none", "fp8-per-tensor"}
    ds = {r["config"]: r for r in json.loads((out / "decode_step_cuda_small.json").read_text())["results"]}
    for config in ("none", "fp8-per-tensor/w8a8", "fp8-per-tensor/w8a16", "fp8-per-channel/w8a8"):
        assert "error" not in ds[config], ds[config]
        assert ds[config]["cuda_graph"] is True and math.isfinite(ds[config]["over_bf16"])
    assert set(summary["decode_over_bf16"]) == set(ds) - {"none"}
    assert summary["decode_targets"] == {c: (1.0 if c.endswith("w8a16") else 0.7) for c in set(ds) - {"none"}}
    assert summary["total_seconds"] < 400
