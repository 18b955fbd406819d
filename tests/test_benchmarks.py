"""The benchmark scripts run and write the JSON fields they promise (timings are not asserted)."""

import json

from layerwise.benchmarks import peak_memory, quant_kernels, reload_latency


def test_peak_memory_small_writes_json_and_png(tmp_path):
    methods = "layerwise-fp8-per-tensor,naive-bf16-then-fp8,hf+torchao-quantize_,floor-read-copy"
    assert peak_memory.main(["--size", "small", "--methods", methods, "--out-dir", str(tmp_path),
                             "--cache-dir", str(tmp_path / "cache"), "--name", "pm"]) == 0
    result = json.loads((tmp_path / "pm.json").read_text())
    assert (tmp_path / "pm.png").stat().st_size > 10_000
    assert result["largest_layer_checkpoint_bytes"] > 0 and result["machine"]["torch"]
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == set(methods.split(","))
    for r in rows.values():
        assert "error" not in r, r
        for field in ("peak_bytes", "final_bytes", "peak_over_final", "overhead_over_largest_layer", "seconds",
                      "time_over_floor", "timeline"):
            assert field in r, (r["method"], field)
        assert r["peak_bytes"] >= r["final_bytes"] > 0
    # the same tracker sees the naive path hold the whole BF16 model, and layerwise not
    assert rows["naive-bf16-then-fp8"]["peak_bytes"] > rows["layerwise-fp8-per-tensor"]["peak_bytes"]


def test_reload_latency_small_writes_json(tmp_path):
    out = tmp_path / "rl.json"
    assert reload_latency.main(["--size", "small", "--repeats", "1", "--out", str(out),
                                "--cache-dir", str(tmp_path / "cache")]) == 0
    cases = {r["case"]: r for r in json.loads(out.read_text())["results"]}
    for name in ("fp8-per-tensor: in-memory stream", "none (bf16): in-memory stream",
                 "fp8-per-tensor: from disk (page cache warm)"):
        assert cases[name]["seconds"] > 0 and cases[name]["over_floor"] > 0


def test_quant_kernels_writes_json(tmp_path):
    out = tmp_path / "qk.json"
    assert quant_kernels.main(["--shapes", "64x96", "--repeats", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["scheme"] for r in rows} == {"fp8-per-tensor", "fp8-per-channel", "fp8-per-block"}
    assert all(r["gbps"] > 0 and r["clone_gbps"] > 0 and r["ratio_to_clone"] > 0 for r in rows)
