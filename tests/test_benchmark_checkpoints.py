"""The benchmark checkpoint generator (benchmarks/checkpoints.py) and the worker runner (benchmarks/workers.py):
shapes against transformers' own Llama, values that look like weights, shards, reuse; rows kept on timeout."""

import json
import time

import pytest
import torch
from safetensors import safe_open

from layerwise.benchmarks import checkpoints, workers


@pytest.mark.parametrize("size", sorted(checkpoints.SIZES))
def test_tensor_shapes_are_those_of_transformers_llama(size):
    transformers = pytest.importorskip("transformers")
    spec = {k: v for k, v in checkpoints.SIZES[size].items() if k != "max_shard_size"}
    with torch.device("meta"):  # shapes only: even the 8B model costs nothing here
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**spec, tie_word_embeddings=False))
    expected = {k: tuple(t.shape) for k, t in model.state_dict().items()}
    assert dict(checkpoints.tensor_shapes(checkpoints.SIZES[size])) == expected


def test_sizes_match_what_they_are_named_after():
    gib = checkpoints.checkpoint_bytes(checkpoints.SIZES["8b"]) / 2**30
    assert 14.9 < gib < 15.0  # Llama-3-8B: 8.03e9 parameters in BF16 ("15 GiB" in issue 14)
    assert 1.75e9 < checkpoints.checkpoint_bytes(checkpoints.SIZES["0.9b"]) < 1.8e9  # issue 14's "1.8 GB"


def test_small_checkpoint_values_shards_and_reuse(tmp_path):
    start = time.perf_counter()
    path = checkpoints.make_checkpoint("small", tmp_path)
    assert time.perf_counter() - start < 60
    spec = checkpoints.SIZES["small"]
    limit = checkpoints.shard_bytes(spec["max_shard_size"])
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = {}
    for shard in shards:
        assert (path / shard).stat().st_size <= limit + 64 * 1024  # data plus the JSON header
        with safe_open(str(path / shard), "pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    assert {k: tuple(t.shape) for k, t in tensors.items()} == dict(checkpoints.tensor_shapes(spec))
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in tensors.values())
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is False
    for key, t in tensors.items():
        if key.endswith("norm.weight"):
            assert torch.equal(t, torch.ones_like(t)), key
            continue
        std = t.float().std().item()
        assert 0.75 * 0.02 * 0.95 < std < 1.25 * 0.02 * 1.05, (key, std)  # normal(0, 0.02) times [0.75, 1.25]
        assert abs(t.float().mean().item()) < 0.1 * std, key
    q = tensors["model.layers.0.self_attn.q_proj.weight"].float()
    row_amax = q.abs().amax(dim=1)
    assert row_amax.std() > 0.02 * row_amax.mean()  # per-channel scales differ from row to row
    assert not torch.equal(q, tensors["model.layers.1.self_attn.q_proj.weight"].float())
    # generated once, reused: the same folder, untouched
    written = (path / shards[0]).stat().st_mtime_ns
    assert checkpoints.make_checkpoint("small", tmp_path) == path
    assert (path / shards[0]).stat().st_mtime_ns == written
    assert not list(tmp_path.glob(".*partial"))


def test_checkpoint_folder_is_keyed_by_shape(tmp_path, monkeypatch):
    before = checkpoints.checkpoint_dir("small", tmp_path)
    monkeypatch.setitem(checkpoints.SIZES, "small", {**checkpoints.SIZES["small"], "intermediate_size": 768})
    after = checkpoints.checkpoint_dir("small", tmp_path)
    assert after != before and after.name.startswith("llama-small-")


def test_the_cpu_tiling_period_covers_big_tensors_without_repeating_rows():
    weights = checkpoints._Weights(torch.device("cpu"))
    shape = (3 * checkpoints.BLOCK_NUMEL // 1024 + 5, 1024)  # longer than three periods
    t = weights("model.layers.0.mlp.up_proj.weight", shape)
    assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
    flat = t.reshape(-1)
    period = checkpoints.BLOCK_NUMEL
    assert torch.equal(flat[:period], flat[period : 2 * period])  # tiled: one period repeats...
    assert not torch.equal(t[0], t[period // 1024])  # ...but a prime period never lines rows up


def rows_then_sleep(n: int, sleep: float):
    """A worker for the test below: ``n`` rows, then a long sleep."""
    for i in range(n):
        yield {"i": i}
    time.sleep(sleep)
    yield {"i": "late"}


def rows_then_fail():
    """A worker for the test below: one row, then an error."""
    yield {"i": 0}
    raise RuntimeError("boom in the worker")


def environment(names: list[str]):
    """A worker for the test below: the values of the environment variables ``names`` in its process."""
    import os

    yield {name: os.environ.get(name) for name in names}


@pytest.mark.slow
def test_run_worker_sets_each_pages_regime_in_the_worker_only(monkeypatch):
    import os
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "123")  # the caller's own environment still reaches the worker
    names = ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "PYTHONPATH"]
    before = dict(os.environ)
    for pages, env in workers.PAGES_ENV.items():
        out = workers.run_worker("tests.test_benchmark_checkpoints", "environment", {"names": names}, 60, env=env)
        (row,) = out.rows
        assert row["MALLOC_MMAP_THRESHOLD_"] == env["MALLOC_MMAP_THRESHOLD_"], pages
        assert row["MALLOC_TRIM_THRESHOLD_"] == env.get("MALLOC_TRIM_THRESHOLD_", "123"), pages
        assert row["PYTHONPATH"]
    assert int(workers.PAGES_ENV["fresh"]["MALLOC_MMAP_THRESHOLD_"]) == 128 * 1024  # below any weight's size
    assert dict(os.environ) == before  # this process is left as it was


@pytest.mark.slow
def test_run_worker_keeps_the_rows_of_a_worker_that_times_out_or_fails(monkeypatch):
    from pathlib import Path

    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))  # so that "tests..." imports
    out = workers.run_worker("tests.test_benchmark_checkpoints", "rows_then_sleep", {"n": 2, "sleep": 60}, timeout=12)
    assert out.rows == [{"i": 0}, {"i": 1}] and out.error == "timed out after 12 s"
    out = workers.run_worker("tests.test_benchmark_checkpoints", "rows_then_fail", {})
    assert out.rows == [{"i": 0}] and out.error == "RuntimeError: boom in the worker"
