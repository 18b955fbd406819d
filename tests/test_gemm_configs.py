"""Tuned GEMM launch configurations: the file the tuner writes, the lookup the GEMMs launch with, and the
tuner itself (benchmarks/gemm_tune.py, run interpreted on CPU: a check of its code path, not of its times)."""

import json

import pytest
import torch

from layerwise.benchmarks import gemm_tune
from layerwise.benchmarks.checkpoints import shape
from layerwise.kernels import gemm_configs
from layerwise.kernels.fp8_gemm import TILES_INTERPRET, GemmTiles, gemm_tiles, launch_tiles, tuned_tiles
from layerwise.kernels.gemm_configs import KINDS, config_path, device_slug, write_configs

GPU = "NVIDIA Test GPU 80GB HBM3"
SMALL = gemm_tune.projections(shape("small"))  # name -> [N, K]
CUDA = torch.device("cuda")  # a device object only: nothing runs on it here


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Configurations stored under tmp_path for a CUDA device named GPU; returns its file's path."""
    monkeypatch.setattr(gemm_configs, "CONFIG_DIR", tmp_path)
    monkeypatch.setattr(gemm_configs, "_device_name", lambda index: GPU)
    gemm_configs.clear_caches()
    yield config_path(GPU)
    gemm_configs.clear_caches()


def test_launch_tiles_take_the_tuned_configuration_of_the_shape_and_m(fake_gpu):
    assert fake_gpu.name == "nvidia-test-gpu-80gb-hbm3.json" == device_slug(GPU) + ".json"
    assert launch_tiles("w8a16", 1, 64, 256, CUDA) == gemm_tiles(1, CUDA, "w8a16")  # no file yet
    best = {
        "w8a16": {"64,256": {1: [16, 64, 128, 2, 4, 3], 8: [16, 32, 256, 4, 8, 4]}},
        "w8a8-block": {"64,256": {16: [16, 128, 128, 8, 4, 4]}},
    }
    write_configs(fake_gpu, GPU, best, {"commit": "abc1234"})
    stored = json.loads(fake_gpu.read_text())
    assert stored["device_name"] == GPU and stored["commit"] == "abc1234"
    assert launch_tiles("w8a16", 1, 64, 256, CUDA) == GemmTiles(16, 64, 128, 2, 4, 3)
    for m in (2, 8):  # the first tuned M at or above M
        assert launch_tiles("w8a16", m, 64, 256, CUDA) == GemmTiles(16, 32, 256, 4, 8, 4)
    assert launch_tiles("w8a8-block", 3, 64, 256, CUDA) == GemmTiles(16, 128, 128, 8, 4, 4)
    # beyond the tuned M, another shape, another kind, the CPU: the heuristic tables
    assert launch_tiles("w8a16", 9, 64, 256, CUDA) == gemm_tiles(9, CUDA, "w8a16")
    assert launch_tiles("w8a16", 1, 64, 512, CUDA) == gemm_tiles(1, CUDA, "w8a16")
    assert launch_tiles("w8a16-block", 1, 64, 256, CUDA) == gemm_tiles(1, CUDA, "w8a16")
    assert launch_tiles("w8a16", 1, 64, 256, torch.device("cpu")) == TILES_INTERPRET


@pytest.mark.parametrize("rows", [{"x": [1, 2, 3, 4, 5, 6]}, {"8": [16, 64, 128, 2]}, {"8": [16, 0, 128, 1, 4, 3]}])
def test_a_malformed_configuration_file_is_named(fake_gpu, rows):
    fake_gpu.write_text(json.dumps({"configs": {"w8a16": {"64,256": rows}}}))
    gemm_configs.clear_caches()
    with pytest.raises(ValueError, match="nvidia-test-gpu-80gb-hbm3.json: not a GEMM configuration file"):
        launch_tiles("w8a16", 1, 64, 256, CUDA)


def test_weight_copies_outgrow_twice_the_l2_cache(monkeypatch):
    class Properties:
        L2_cache_size = 50 * 2**20  # an H100's

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties)
    assert gemm_tune.weight_copies(4096 * 4096, CUDA) == 7  # o_proj in FP8: 16.8 MB, 7 copies > 100 MiB
    assert gemm_tune.weight_copies(2 * 28672 * 4096, CUDA) == 1  # gate_up_proj in BF16: 235 MB alone
    assert gemm_tune.weight_copies(4096 * 4096, torch.device("cpu")) == 1


def test_the_tuner_keeps_the_fastest_correct_candidate(monkeypatch, tmp_path):
    # a candidate whose output is wrong (here: split in two) is recorded as an error, never chosen, even when
    # it is the fastest
    real = gemm_tune._gemm

    def gemm_wrong_when_split(kind, ops, layout=None):
        call, expected = real(kind, ops, layout)
        return (lambda tiles, i: call(tiles, i) * (2 if tiles.split_k == 2 else 1)), expected

    monkeypatch.setattr(gemm_tune, "_gemm", gemm_wrong_when_split)
    result = gemm_tune.tune("small", "cpu", ms=(8,), kinds=("w8a16",))
    assert [(r["shape"], r["m"]) for r in result["best"]] == [(s, 8) for s in SMALL]
    for row in result["best"]:
        assert row["tiles"] == list(TILES_INTERPRET) == row["default_tiles"] and row["us"] == row["default_us"] > 0
        assert row["weight_gbps"] == pytest.approx(row["n"] * row["k"] / row["us"] / 1e3)
    assert len(result["errors"]) == 4 and all("output off by" in e["error"] for e in result["errors"])
    assert {e["tiles"][3] for e in result["errors"]} == {2}
    refs = result["references"][0]["us"]
    assert refs["bf16 F.linear"] > 0 and refs["act quant token"] > 0
    configs = gemm_tune.best_configs(result)
    assert configs == {"w8a16": {f"{n},{k}": {8: list(TILES_INTERPRET)} for n, k in SMALL.values()}}


@pytest.mark.slow
def test_tuner_command_line(tmp_path, capsys):
    common = ["--device", "cpu", "--size", "small", "--out-dir", str(tmp_path)]
    gemm_tune.main([*common, "--m", "1", "--kinds", "w8a8-block"])
    result = json.loads((tmp_path / "gemm_tune_cpu_small.json").read_text())
    assert result["m"] == [1] and {r["kind"] for r in result["best"]} == {"w8a8-block"}
    assert not result["errors"] and "w8a8-block" in capsys.readouterr().out
    for argv in (["--kinds", "w4a16"], ["--write-configs"]):  # --write-configs: times from a GPU only
        with pytest.raises(SystemExit) as exit_info:
            gemm_tune.main([*common, *argv])
        assert exit_info.value.code == 2


@pytest.mark.slow
def test_the_tuner_times_only_the_defaults_past_its_budget():
    result = gemm_tune.tune("small", "cpu", ms=(8,), kinds=("w8a16",), budget=0)
    assert result["skipped_over_budget"] == len(SMALL)  # the one split candidate of each shape
    assert all(row["tiles"] == row["default_tiles"] and len(row["top"]) == 1 for row in result["best"])


@pytest.mark.slow
def test_the_budget_is_dealt_to_the_slices_and_cuts_a_candidate_on_every_shape(monkeypatch):
    # a fake clock that advances one second per timing: each slice (M, kind) gets budget / slices, and a
    # candidate past its slice's share is skipped on every projection, so all projections searched the same
    clock = [0.0]

    def one_second_per_timing(fn, device):
        fn()
        clock[0] += 1.0
        return 1e-6

    monkeypatch.setattr(gemm_tune, "graph_seconds", one_second_per_timing)
    monkeypatch.setattr(gemm_tune.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(gemm_tune, "_references", lambda ops, device: {"bf16 F.linear": 1.0})  # not timed here
    splits = [TILES_INTERPRET._replace(split_k=s) for s in (2, 3, 4)]
    monkeypatch.setattr(gemm_tune, "candidates", lambda kind, m, device, quick=False: splits)
    result = gemm_tune.tune("small", "cpu", ms=(8,), kinds=("w8a16", "w8a16-block"), budget=16)
    # slice 1 (deadline 8): the default on the 4 shapes (clock 4), split 2 (8), split 3 (12), split 4 past 8;
    # slice 2 (deadline 16): the default (16), split 2 (20), splits 3 and 4 past 16. One budget for both slices
    # would let slice 1 time split 4 too and leave slice 2 its defaults only
    timings = {(row["kind"], row["shape"]): len(row["top"]) for row in result["best"]}
    assert timings == {**{("w8a16", s): 3 for s in SMALL}, **{("w8a16-block", s): 2 for s in SMALL}}
    assert result["skipped_over_budget"] == 3 * len(SMALL) and result["budget_seconds"] == 16


def test_precompile_runs_every_candidate_side_by_side_on_cuda_only():
    import threading

    barrier, calls = threading.Barrier(2, timeout=30), []

    def call(tiles, i):  # the first two calls meet at the barrier: they run at the same time, or it times out
        calls.append((tiles, i, threading.get_ident()))
        if len(calls) <= 2:
            barrier.wait()
        if tiles == "broken":
            raise RuntimeError("does not compile")  # left to the check that follows

    jobs = [(call, t) for t in ("a", "b", "broken", "c")]
    gemm_tune.precompile(jobs, CUDA, threads=2)
    assert sorted(t for t, _, _ in calls) == ["a", "b", "broken", "c"] and {i for _, i, _ in calls} == {0}
    assert len({thread for _, _, thread in calls}) == 2
    calls.clear()
    gemm_tune.precompile(jobs, torch.device("cpu"), threads=2)  # the interpreter: one kernel at a time, no compile
    gemm_tune.precompile(jobs, CUDA, threads=1)
    gemm_tune.precompile(jobs, CUDA, threads=2, deadline=gemm_tune.time.monotonic() - 1)  # past the slice's share
    assert calls == []


@pytest.mark.slow
def test_compiles_get_half_of_the_slice_at_most(monkeypatch):
    # past its deadline a slice times no candidate, compiled or not: the compiles stop halfway through its share
    seen = []
    monkeypatch.setattr(gemm_tune.time, "monotonic", lambda: 100.0)
    monkeypatch.setattr(gemm_tune, "precompile", lambda jobs, device, threads, deadline: seen.append(deadline))
    monkeypatch.setattr(gemm_tune, "_references", lambda ops, device: {"bf16 F.linear": 1.0})
    monkeypatch.setattr(gemm_tune, "graph_seconds", lambda fn, device: fn() or 1e-6)
    monkeypatch.setattr(gemm_tune, "candidates", lambda kind, m, device, quick=False: [])
    gemm_tune.tune("small", "cpu", ms=(8,), kinds=("w8a16", "w8a16-block"), budget=40)
    assert seen == [110.0, 120.0]  # slices end at 120 and 140; each starts at 100 on the frozen clock


@pytest.mark.slow
def test_the_tuner_reports_after_every_slice(monkeypatch):
    # main writes the JSON (and the configurations) from each report: a run cut off keeps its finished slices
    monkeypatch.setattr(gemm_tune, "candidates", lambda kind, m, device, quick=False: [])  # the defaults only
    reports = []
    result = gemm_tune.tune("small", "cpu", ms=(1, 8), kinds=("w8a16",), progress=lambda r: reports.append(
        (r["complete"], sorted({(row["m"], row["kind"]) for row in r["best"]}))
    ))  # fmt: skip
    assert reports == [(False, [(1, "w8a16")]), (False, [(1, "w8a16"), (8, "w8a16")])]
    assert result["complete"] and len(result["best"]) == 2 * len(SMALL)


def test_candidates_come_in_a_fixed_order_that_samples_the_whole_space():
    first = gemm_tune.candidates("w8a16", 8, CUDA)
    assert first == gemm_tune.candidates("w8a16", 8, CUDA) and len(set(first)) == len(first) == 160
    quarter = first[: len(first) // 4]  # what a budget cut after a quarter has tried
    assert {t.block_n for t in quarter} == {t.block_n for t in first} == {16, 32, 64, 128}
    assert {t.split_k for t in quarter} == {1, 2, 4, 8} and {t.block_k for t in quarter} == {128, 256, 512}
    # x quantized inside the W8A8 GEMM: once per column tile, so wider ones too
    assert {t.block_n for t in gemm_tune.candidates("w8a8", 8, CUDA)} == {16, 32, 64, 128, 256}
    assert {t.block_n for t in gemm_tune.candidates("w8a8-block", 8, CUDA)} == {16, 32, 64, 128}


def test_w8a8_is_stored_only_where_it_beat_scaled_mm():
    def result(w8a8_us, refs):
        rows = [{"kind": kind, "shape": "o_proj", "n": 64, "k": 256, "m": 8, "tiles": [16, 64, 128, 2, 4, 3],
                 "us": us} for kind, us in (("w8a16", 9.0), ("w8a8", w8a8_us))]  # fmt: skip
        return {"best": rows, "references": [{"shape": "o_proj", "m": 8, "us": refs}]}

    # the W8A8 GEMM quantizes x inside: it is judged against _scaled_mm with the activation quantization it needs
    tensor, row = "act quant + scaled_mm per tensor", "act quant + scaled_mm per row"
    both = {tensor: 5.0, row: 6.0, "scaled_mm per tensor": 3.0, "scaled_mm per row": 3.5}
    tiles = [16, 64, 128, 2, 4, 3]

    def w8a8_row(configs):
        return configs["w8a8"]["64,256"][8]

    assert w8a8_row(gemm_tune.best_configs(result(4.0, both))) == tiles
    assert w8a8_row(gemm_tune.best_configs(result(5.5, both))) is None  # slower than the per-tensor one
    assert w8a8_row(gemm_tune.best_configs(result(4.0, {row: 6.0}))) is None  # none per tensor
    no_fp8 = {tensor: "RuntimeError: ...", row: 6.0}
    assert w8a8_row(gemm_tune.best_configs(result(4.0, no_fp8))) is None


def test_an_m_where_w8a8_lost_does_not_take_the_tiles_of_a_larger_m_where_it_won(fake_gpu):
    # the tuner stores a null row where act quant + _scaled_mm won (M = 1 here) and tiles where the Triton GEMM
    # won (M = 8): M = 1 must find the null (the forward then calls _scaled_mm), not the next key's tiles
    win = [16, 128, 128, 4, 4, 3]
    write_configs(fake_gpu, GPU, {"w8a8": {"4096,4096": {1: None, 8: win}}}, {})
    assert json.loads(fake_gpu.read_text())["configs"]["w8a8"]["4096,4096"] == {"1": None, "8": win}
    assert tuned_tiles("w8a8", 1, 4096, 4096, CUDA) is None
    assert tuned_tiles("w8a8", 2, 4096, 4096, CUDA) == tuned_tiles("w8a8", 8, 4096, 4096, CUDA) == GemmTiles(*win)
    assert not list(fake_gpu.parent.glob("*.tmp"))  # written through a temporary file, renamed over it


def test_the_check_rejects_elements_left_unwritten():
    # the check fills the GEMMs' outputs with NaN first: a configuration that writes nothing cannot pass on
    # memory the allocator hands back still holding a correct result
    from layerwise.kernels import fp8_gemm

    cpu, expected, original = torch.device("cpu"), torch.ones(2, 3), fp8_gemm._empty
    writes_nothing = lambda tiles, i: fp8_gemm._empty((2, 3), torch.float32, cpu)  # noqa: E731
    with pytest.raises(ValueError, match="output off by nan"):
        gemm_tune.check(writes_nothing, expected, TILES_INTERPRET)
    assert fp8_gemm._empty is original  # restored after the check
    ops = gemm_tune._operands(24, 300, 3, cpu, seed=0)
    for kind in KINDS:  # the real kernels pass, in both layouts of "w8a8"
        for layout in (None, "tensor") if kind == "w8a8" else (None,):
            call, reference_output = gemm_tune._gemm(kind, ops, layout)
            gemm_tune.check(call, reference_output, TILES_INTERPRET._replace(split_k=2))
