"""The benchmark scripts run, write the JSON fields they promise where the user asks (timings are not
asserted), and the README's results section is generated from the committed JSON."""

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from layerwise import cli
from layerwise.benchmarks import peak_memory, quant_kernels, readme, reload_latency
from layerwise.errors import MissingDependencyError

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "benchmarks" / "results"


def _snapshot(folder: Path) -> dict:
    """name -> (mtime_ns, sha256) of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_peak_memory_small_defaults_write_to_cwd_not_the_reference_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "cache"))
    reference = _snapshot(REFERENCE)
    methods = "layerwise-fp8-per-tensor,naive-bf16-then-fp8,hf+torchao-quantize_,floor-read-copy"
    assert peak_memory.main(["--size", "small", "--methods", methods]) == 0
    assert _snapshot(REFERENCE) == reference  # a default run leaves the committed results alone
    out = tmp_path / "layerwise-results"
    assert sorted(p.name for p in out.iterdir()) == ["peak_memory_cpu_small.json", "peak_memory_cpu_small.png"]
    assert (tmp_path / "cache" / "bench" / "llama-small" / "config.json").exists()  # the default cache dir
    result = json.loads((out / "peak_memory_cpu_small.json").read_text())
    assert (out / "peak_memory_cpu_small.png").stat().st_size > 10_000
    assert result["largest_layer_checkpoint_bytes"] > 0 and result["machine"]["torch"]
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == set(methods.split(","))
    for r in rows.values():
        assert "error" not in r, r
        for field in (
            "peak_bytes",
            "final_bytes",
            "peak_over_final",
            "overhead_over_largest_layer",
            "seconds",
            "time_over_floor",
            "timeline",
        ):
            assert field in r, (r["method"], field)
        assert r["peak_bytes"] >= r["final_bytes"] > 0
    # the same tracker sees the naive path hold the whole BF16 model, and layerwise not
    assert rows["naive-bf16-then-fp8"]["peak_bytes"] > rows["layerwise-fp8-per-tensor"]["peak_bytes"]


def test_reload_latency_small_writes_json_to_out_dir_and_reuses_the_checkpoint(tmp_path):
    assert (
        reload_latency.main(
            [
                "--size",
                "small",
                "--repeats",
                "1",
                "--out-dir",
                str(tmp_path / "new" / "dir"),
                "--name",
                "rl",
                "--cache-dir",
                str(tmp_path / "cache"),
            ]
        )
        == 0
    )
    cases = {r["case"]: r for r in json.loads((tmp_path / "new" / "dir" / "rl.json").read_text())["results"]}
    for name in (
        "fp8-per-tensor: in-memory stream",
        "none (bf16): in-memory stream",
        "fp8-per-tensor: from disk (page cache warm)",
    ):
        assert cases[name]["seconds"] > 0 and cases[name]["over_floor"] > 0
    config = tmp_path / "cache" / "llama-small" / "config.json"
    written = config.stat().st_mtime_ns
    assert peak_memory.make_checkpoint("small", tmp_path / "cache") == config.parent
    assert config.stat().st_mtime_ns == written  # generated once


def test_quant_kernels_writes_json_to_out_dir(tmp_path):
    assert quant_kernels.main(["--shapes", "64x96", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "quant_kernels_cpu.json").read_text())["results"]
    assert {r["scheme"] for r in rows} == {"fp8-per-tensor", "fp8-per-channel", "fp8-per-block"}
    assert all(r["gbps"] > 0 and r["clone_gbps"] > 0 and r["ratio_to_clone"] > 0 for r in rows)


def test_bench_help_shows_the_public_options_only(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "worker" not in out.lower() and "SUPPRESS" not in out
    for text in (
        "usage: layerwise bench",
        "Peak device memory and load time",
        "--size",
        "--device",
        "--methods",
        "--out-dir",
        "--cache-dir",
        "layerwise-results",
        "benchmarks/results",
    ):
        assert text in out, text


def test_missing_dependency_is_reported_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(MissingDependencyError, match="pip install") as error:
        peak_memory.main(["--size", "small", "--out-dir", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "c")])
    assert "matplotlib" in str(error.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "c").exists()
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingDependencyError, match="pip install"):
        reload_latency.main(["--size", "small", "--cache-dir", str(tmp_path / "c")])
    assert not (tmp_path / "c").exists()


def test_required_modules_follow_the_methods_and_device():
    assert peak_memory.required_modules(["layerwise-fp8-per-tensor"], "cpu") == ["transformers", "matplotlib"]
    assert "torchao" in peak_memory.required_modules(["layerwise-torchao:Float8WeightOnlyConfig"], "cpu")
    assert "accelerate" not in peak_memory.required_modules(["hf-TorchAoConfig"], "cpu")
    assert "accelerate" in peak_memory.required_modules(["hf-TorchAoConfig"], "cuda")


def test_readme_section_is_generated_from_the_committed_results():
    assert readme.main(["--check", "--results", str(REFERENCE), "--readme", str(REPO / "README.md")]) == 0


def test_readme_follows_a_changed_figure(tmp_path):
    results = tmp_path / "benchmarks" / "results"
    shutil.copytree(REFERENCE, results)
    path = results / "reload_latency_cpu_default.json"
    data = json.loads(path.read_text())
    data["results"][0]["seconds"] = 0.1234
    path.write_text(json.dumps(data))
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    before = (tmp_path / "README.md").read_text()
    args = ["--results", str(results), "--readme", str(tmp_path / "README.md")]

    assert readme.main(["--check", *args]) == 1  # stale, and --check writes nothing
    assert (tmp_path / "README.md").read_text() == before
    assert readme.main(args) == 0
    after = (tmp_path / "README.md").read_text()
    assert "| floor: copy_ BF16 tensors | 0.123 | 1.00 |" in after and after != before
    head, tail = before[: readme.BEGIN.search(before).end()], before.split(readme.END, 1)[1]
    assert after.startswith(head) and after.endswith(readme.END + tail)  # only the marked section changed
    assert readme.main(["--check", *args]) == 0


def test_tp_load_small_reads_a_share_per_rank(tmp_path):
    from layerwise.benchmarks import tp_load

    args = ["--size", "small", "--tp", "1,2", "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    assert tp_load.main(args) == 0
    runs = {run["tp"]: run["ranks"] for run in json.loads((tmp_path / "tp_load_cpu_small.json").read_text())["results"]}
    assert len(runs[1]) == 1 and len(runs[2]) == 2
    whole = runs[1][0]["bytes_read"]
    assert whole == runs[1][0]["checkpoint_bytes"]
    for rank in runs[2]:  # half of the sharded weights plus the replicated ones (norms)
        assert 0.5 * whole <= rank["bytes_read"] < 0.55 * whole
        assert rank["model_bytes"] < 0.55 * runs[1][0]["model_bytes"] and rank["peak_bytes"] >= rank["model_bytes"]
