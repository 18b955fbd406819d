"""The benchmark scripts run, write the JSON fields they promise where the user asks (timings are not
asserted), and the README's results section is generated from the committed JSON."""

import hashlib
import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

from layerwise import cli
from layerwise.benchmarks import checkpoints, peak_memory, quant_kernels, readme, reload_latency, workers
from layerwise.checkpoint import Checkpoint
from layerwise.errors import MissingDependencyError
from layerwise.kernels import cpu_native

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "benchmarks" / "results"


def _snapshot(folder: Path) -> dict:
    """name -> (mtime_ns, sha256) of every file under ``folder``."""
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _check_provenance(result: dict, device: str, size: str | None) -> None:
    """The fields every results JSON carries (issue 14): device name, versions, commit, date, size and shape."""
    from layerwise.benchmarks.machine import cpu_model

    assert result["device_name"] == (cpu_model() if device == "cpu" else torch.cuda.get_device_name())
    assert result["versions"]["torch"] == torch.__version__
    for package in ("triton", "transformers", "torchao"):
        assert package in result["versions"]
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?|unknown", result["commit"]), result["commit"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", result["date"])
    assert result["size"] == size
    if size is not None:
        assert result["shape"]["hidden_size"] == checkpoints.SIZES[size]["hidden_size"]


@pytest.mark.slow
def test_peak_memory_small_defaults_write_to_cwd_not_the_reference_results(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "cache"))
    reference = _snapshot(REFERENCE)
    methods = "layerwise-fp8-per-tensor,naive-bf16-then-fp8,hf+torchao-quantize_,floor-read-copy"
    assert peak_memory.main(["--size", "small", "--methods", methods]) == 0
    assert _snapshot(REFERENCE) == reference  # a default run leaves the committed results alone
    out = tmp_path / "layerwise-results"
    assert sorted(p.name for p in out.iterdir()) == ["peak_memory_cpu_small.json", "peak_memory_cpu_small.png"]
    assert peak_memory.make_checkpoint("small", tmp_path / "cache" / "bench").parent == tmp_path / "cache" / "bench"
    assert (checkpoints.checkpoint_dir("small", tmp_path / "cache" / "bench") / "config.json").exists()  # default
    result = json.loads((out / "peak_memory_cpu_small.json").read_text())
    assert (out / "peak_memory_cpu_small.png").stat().st_size > 10_000
    assert result["largest_layer_checkpoint_bytes"] > 0 and result["machine"]["torch"]
    assert result["pages"] == "fresh" and result["malloc_env"] == workers.PAGES_ENV["fresh"]  # every method alike
    rows = {r["method"]: r for r in result["results"]}
    assert set(rows) == set(methods.split(","))
    floor = rows["floor-read-copy"]["seconds"]
    for r in rows.values():
        assert "error" not in r, r
        for field in (
            "peak_bytes",
            "final_bytes",
            "peak_over_final",
            "overhead_over_largest_layer",
            "seconds",
            "first_seconds",
            "second_seconds",
            "first_minus_second_seconds",
            "time_over_floor",
            "first_over_floor",
            "timeline",
        ):
            assert field in r, (r["method"], field)
        assert r["peak_bytes"] >= r["final_bytes"] > 0
        assert r["load_seconds"] == [r["first_seconds"], r["second_seconds"]]  # --loads 2 (the default)
        assert r["first_minus_second_seconds"] == r["first_seconds"] - r["second_seconds"]
        assert r["first_minus_best_seconds"] == r["first_seconds"] - r["seconds"]
        assert r["time_over_floor"] == r["seconds"] / floor
        assert r["first_over_floor"] == r["first_seconds"] / floor
        if r["method"].startswith("layerwise-"):
            assert r["first_seconds_with_import"] == r["first_seconds"] + result["import_layerwise_seconds"]
            assert r["first_with_import_over_floor"] == r["first_seconds_with_import"] / floor
    assert 0 < result["import_layerwise_seconds"] < 60
    _check_provenance(result, "cpu", "small")
    # the same tracker sees the naive path hold the whole BF16 model, and layerwise not
    assert rows["naive-bf16-then-fp8"]["peak_bytes"] > rows["layerwise-fp8-per-tensor"]["peak_bytes"]


@pytest.mark.slow
def test_reload_latency_small_writes_json_to_out_dir_and_reuses_the_checkpoint(tmp_path):
    assert (
        reload_latency.main(
            [
                "--size",
                "small",
                "--repeats",
                "3",
                "--out-dir",
                str(tmp_path / "new" / "dir"),
                "--name",
                "rl",
                "--cache-dir",
                str(tmp_path / "cache"),
                "--schemes",
                "none,fp8-per-tensor,fp8-per-block",
            ]
        )
        == 0
    )
    result = json.loads((tmp_path / "new" / "dir" / "rl.json").read_text())
    _check_provenance(result, "cpu", "small")
    cases = {r["case"]: r for r in result["results"]}
    floor = cases["floor: copy_ BF16 tensors"]
    assert floor["stream_bytes"] == result["stream_bytes"] == checkpoints.checkpoint_bytes(checkpoints.SIZES["small"])
    assert floor["pinned"] is False  # pinned host memory is for CUDA
    for name in (
        "fp8-per-tensor: in-memory stream",
        "none (bf16): in-memory stream",
        "fp8-per-tensor: from disk (page cache warm)",
        "fp8-per-block: from disk (page cache warm)",
    ):
        row = cases[name]
        assert row["seconds"] > 0 and row["first_seconds"] > 0 and len(row["rounds"]) == 3  # --repeats
        floors, reloads = zip(*row["rounds"], strict=True)
        assert row["seconds"] == min(reloads) and row["floor_seconds"] == min(floors) and min(floors) > 0
        # the best reload over the best floor copy of the same rounds; and over the fastest floor of the run
        assert row["over_floor"] == min(reloads) / min(floors)
        fastest = min([floor["seconds"]] + [r["floor_seconds"] for r in result["results"] if "floor_seconds" in r])
        assert row["over_fastest_floor"] == row["seconds"] / fastest
    assert {(r["scheme"], r["source"]) for r in result["results"] if "scheme" in r} == {
        (s, source) for s in ("none", "fp8-per-tensor", "fp8-per-block") for source in ("stream", "dir")
    }
    stream = reload_latency.host_stream(
        str(config_dir := checkpoints.checkpoint_dir("small", tmp_path / "cache")), "cpu"
    )

    reference = list(Checkpoint(config_dir))
    assert [k for k, _ in stream] == [k for k, _ in reference]
    assert all(torch.equal(t, r) and t.shape == r.shape for (_, t), (_, r) in zip(stream, reference, strict=True))
    assert len({t.untyped_storage().data_ptr() for _, t in stream}) == 1  # views of one buffer
    base = stream[0][1].untyped_storage().data_ptr()
    assert all((t.data_ptr() - base) % 256 == 0 for _, t in stream)  # each view starts 256-byte aligned
    config = config_dir / "config.json"
    written = config.stat().st_mtime_ns
    assert peak_memory.make_checkpoint("small", tmp_path / "cache") == config.parent
    assert config.stat().st_mtime_ns == written  # generated once


def test_quant_kernels_writes_json_to_out_dir(tmp_path):
    assert quant_kernels.main(["--shapes", "64x96", "--repeats", "1", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "quant_kernels_cpu.json").read_text())
    _check_provenance(result, "cpu", None)
    rows = result["results"]
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


def test_required_modules_follow_the_methods_and_device(monkeypatch):
    assert peak_memory.required_modules(["layerwise-fp8-per-tensor"], "cpu") == ["transformers", "matplotlib"]
    assert "torchao" in peak_memory.required_modules(["layerwise-torchao:Float8WeightOnlyConfig"], "cpu")
    # device_map needs accelerate; without it the HF methods load on the CPU and move the model
    assert "accelerate" not in peak_memory.required_modules(["hf-TorchAoConfig"], "cuda")
    monkeypatch.setitem(sys.modules, "accelerate", None)  # find_spec raises ValueError for None entries

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in ("accelerate", "torchao") else real(name, *a)
    )
    assert peak_memory._hf_placement(torch.device("cuda")) == ({}, torch.device("cuda"))
    assert "accelerate is not installed" in peak_memory.hf_placement_note(torch.device("cuda"))
    assert peak_memory.missing_modules(peak_memory.METHODS) == {
        "layerwise-torchao:Float8WeightOnlyConfig": "skipped: torchao is not installed",
        "hf+torchao-quantize_": "skipped: torchao is not installed",
        "hf-TorchAoConfig": "skipped: torchao is not installed",
    }


def test_readme_and_benchmarks_page_are_generated_from_the_committed_results():
    pages = ["--readme", str(REPO / "README.md"), "--benchmarks", str(REPO / "docs" / "benchmarks.md")]
    assert readme.main(["--check", "--results", str(REFERENCE), *pages]) == 0


def _copies(tmp_path):
    """The committed results, README and benchmarks page under tmp_path, and the generator's arguments for them."""
    results = tmp_path / "benchmarks" / "results"
    shutil.copytree(REFERENCE, results)
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    shutil.copy(REPO / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks.md")
    args = ["--results", str(results), "--readme", str(tmp_path / "README.md")]
    return results, args + ["--benchmarks", str(tmp_path / "docs" / "benchmarks.md")]


def test_benchmarks_page_follows_a_changed_figure(tmp_path):
    results, args = _copies(tmp_path)
    path = results / f"{readme.latest_results(results)[('reload_latency', 'cpu')][0]}.json"  # the one shown
    data = json.loads(path.read_text())
    data["results"][0]["seconds"] = 0.1234
    path.write_text(json.dumps(data))
    page = tmp_path / "docs" / "benchmarks.md"
    before, readme_before = page.read_text(), (tmp_path / "README.md").read_text()

    assert readme.main(["--check", *args]) == 1  # stale, and --check writes nothing
    assert page.read_text() == before
    assert readme.main(args) == 0
    after = page.read_text()
    assert "| floor: copy_ BF16 tensors | 0.123 |" in after and after != before
    head, tail = before[: readme.BEGIN.search(before).end()], before.split(readme.END, 1)[1]
    assert after.startswith(head) and after.endswith(readme.END + tail)  # only the marked section changed
    assert (tmp_path / "README.md").read_text() == readme_before  # not a headline figure
    assert readme.main(["--check", *args]) == 0


def test_readme_headline_follows_a_changed_figure(tmp_path):
    results, args = _copies(tmp_path)
    stem, data = readme.latest_results(results)[("suite", "cpu")]
    data["reload_stream_over_copy_floor"][readme.HEADLINE_SCHEME] = 1.2345
    (results / f"{stem}.json").write_text(json.dumps(data))
    before = (tmp_path / "README.md").read_text()

    assert readme.main(["--check", *args]) == 1
    assert readme.main(args) == 0
    after = (tmp_path / "README.md").read_text()
    row = next(line for line in after.splitlines() if line.startswith("| reload from a trainer's tensors"))
    assert row.endswith("| 1.23x |"), row  # the CPU column, last
    head = before[: readme.HEADLINE_BEGIN.search(before).end()]
    tail = before.split(readme.HEADLINE_END, 1)[1]
    assert after.startswith(head) and after.endswith(readme.HEADLINE_END + tail)
    assert f"{data['date'][:10]}, commit {data['commit']}" in after


@pytest.mark.slow
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


@pytest.mark.slow
def test_decode_step_small_median_ms_and_ratio_to_bf16(tmp_path):
    from layerwise.benchmarks import decode_step

    args = ["--size", "small", "--configs", "none,fp8-per-tensor/w8a16", "--steps", "2", "--warmup", "1", "--profile"]
    assert decode_step.main([*args, "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]) == 0
    result = json.loads((tmp_path / "decode_step_cpu_small.json").read_text())
    _check_provenance(result, "cpu", "small")
    assert result["batch"] == 8 and result["position"] == result["max_seq_len"] // 2
    rows = {r["config"]: r for r in result["results"]}
    assert set(rows) == {"none", "fp8-per-tensor/w8a16"}
    bf16, fp8 = rows["none"], rows["fp8-per-tensor/w8a16"]
    assert "error" not in bf16 and "error" not in fp8, (bf16, fp8)
    assert (fp8["scheme"], fp8["fp8_mode"], fp8["steps"], fp8["cuda_graph"]) == ("fp8-per-tensor", "w8a16", 2, False)
    assert fp8["ms"] >= fp8["min_ms"] > 0 and bf16["over_bf16"] == 1.0
    assert fp8["over_bf16"] == fp8["ms"] / bf16["ms"]
    for row in (bf16, fp8):  # --profile: the eager step's CPU operators (4 layers x 4 projections, lm_head)
        profile = row["profile"]
        assert profile["source"] == "CPU operators, self time"
        assert set(profile["ms_per_step"]) == {"gemm", "act_quant", "attention", "other"}
        assert profile["ms_per_step"]["gemm"] > 0 and profile["ms_per_step"]["act_quant"] == 0
        assert profile["total_ms"] == pytest.approx(sum(profile["ms_per_step"].values()))
        calls = {t["name"]: (t["calls"], t["category"]) for t in profile["top"]}
        if row is fp8 and cpu_native.available():  # the projections run the native FP8 GEMM, lm_head BF16
            assert calls["layerwise::linear_fp8"] == (4 * 4, "gemm") and calls["aten::mm"] == (1, "gemm")
        else:
            assert calls["aten::mm"] == (4 * 4 + 1, "gemm")
    assert readme.decode_table(result).splitlines()[0].endswith("GEMM / act quant / attention / other, ms |")


def test_step_profile_categories_of_real_kernel_names():
    from layerwise.benchmarks.step_profile import category

    names = {  # kernel names of an H100 trace (cuBLAS, cuBLASLt FP8, CUTLASS, Triton, SDPA, elementwise)
        "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT": "gemm",
        "sm90_xmma_gemm_e4m3bf16_e4m3f32_f32_tn_n_tilesize64x64x128_warpgroupsize1x1x1": "gemm",
        "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>": "gemm",
        "_w8a16_gemm_kernel": "gemm",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false>": "gemm",
        "_split_k_reduce_kernel": "gemm",
        "_act_quant_token_kernel": "act_quant",
        "_act_amax_kernel": "act_quant",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)": "attention",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4>>(Flash_fwd_params)": "attention",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "other",
        "void at::native::index_elementwise_kernel<128, 4>": "other",
        "aten::rms_norm": "other",
    }
    assert {name: category(name) for name in names} == names


@pytest.mark.slow
def test_suite_runs_end_to_end_on_cpu_and_the_readme_shows_it_per_device(tmp_path, monkeypatch):
    """The suite driver on a tiny checkpoint, as if torchao were not installed: every JSON written, the
    torchao parts and the GPU-only part recorded as skipped, the issue's ratios as explicit fields; then the
    README section from those results, as CPU results and relabelled as a GPU's (the GPU part, without a GPU)."""
    from layerwise.benchmarks import suite

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    out = tmp_path / "out"
    args = ["--size", "small", "--out-dir", str(out), "--cache-dir", str(tmp_path / "cache"), "--budget", "300"]
    methods = "floor-read-copy,layerwise-fp8-per-tensor,layerwise-torchao:Float8WeightOnlyConfig,hf-TorchAoConfig"
    subsets = ["--methods", methods, "--schemes", "none,fp8-per-tensor,torchao:Float8WeightOnlyConfig"]
    subsets += ["--parts", "peak_memory,reload_latency,decode_step"]  # rollout: tests/test_rollout_benchmark.py
    assert suite.main([*args, *subsets]) == 0
    names = ["decode_step", "peak_memory", "reload_latency", "suite"]
    assert sorted(p.name for p in out.glob("*.json")) == [f"{n}_cpu_small.json" for n in names]
    data = {n: json.loads((out / f"{n}_cpu_small.json").read_text()) for n in names}
    for result in data.values():
        _check_provenance(result, "cpu", "small")
    summary = data["suite"]
    assert summary["total_seconds"] < summary["budget_seconds"] and summary["generation_seconds"] >= 0
    assert all(r["error"].startswith("skipped: GPU-only") for r in data["decode_step"]["results"])
    pm = {r["method"]: r for r in data["peak_memory"]["results"]}
    no_torchao = "skipped: torchao is not installed"
    assert summary["torchao"] == no_torchao
    warmed = summary["compile_caches_warmed"]  # one throwaway load per layerwise scheme that can run here
    assert [r["scheme"] for r in warmed["rows"]] == ["fp8-per-tensor"] and warmed["error"] is None
    assert [r["error"] for r in data["reload_latency"]["results"] if r.get("scheme", "").startswith("torchao")] == [
        no_torchao
    ]
    for method in ("layerwise-torchao:Float8WeightOnlyConfig", "hf-TorchAoConfig"):
        pm_row = next(r for r in data["peak_memory"]["results"] if r["method"] == method)
        assert pm_row == {"method": method, "error": no_torchao}
    rl = {(r.get("scheme"), r.get("source")): r for r in data["reload_latency"]["results"]}
    ours = pm["layerwise-fp8-per-tensor"]
    assert summary["load_over_floor"] == {"fp8-per-tensor": ours["seconds"] / pm["floor-read-copy"]["seconds"]}
    assert summary["first_load_over_floor"] == {"fp8-per-tensor": ours["first_over_floor"]}
    assert summary["first_load_with_import_over_floor"] == {"fp8-per-tensor": ours["first_with_import_over_floor"]}
    assert summary["first_minus_second_load_seconds"] == {
        "fp8-per-tensor": ours["first_seconds"] - ours["second_seconds"]
    }
    for scheme in ("none", "fp8-per-tensor"):  # the best reload over the best floor copy of its own rounds
        for source in ("dir", "stream"):
            floors, reloads = zip(*rl[(scheme, source)]["rounds"], strict=True)
            assert summary[f"reload_{source}_over_copy_floor"][scheme] == min(reloads) / min(floors)
        floors, reloads = zip(*rl[(scheme, "stream")]["rounds"], strict=True)
        assert summary["met"][f"reload stream {scheme}"] == (min(reloads) / min(floors) <= 2.0)
    assert summary["peak_minus_final_over_largest_layer"] == {"fp8-per-tensor": ours["overhead_over_largest_layer"]}
    assert summary["met"]["peak fp8-per-tensor"] == (ours["overhead_over_largest_layer"] <= 1.0)
    assert summary["met"]["load fp8-per-tensor"] == (summary["load_over_floor"]["fp8-per-tensor"] <= 1.5)
    assert summary["decode_over_bf16"] == {}
    again = suite.summarize(out, "cpu", "small")  # the same ratios from the part files alone (separate jobs)
    for field in ("load_over_floor", "first_minus_second_load_seconds", "reload_stream_over_copy_floor", "met"):
        assert again[field] == summary[field], field
    assert again["date"] == max(data[n]["date"] for n in names[:3]) and again["total_seconds"] is None
    assert "the parts ran in separate jobs" in readme._targets(again, "CPU")

    # the README section: the newest CPU results win over the committed ones, and a GPU gets its own part
    results = tmp_path / "results"
    shutil.copytree(REFERENCE, results)
    for name in names:
        shutil.copy(out / f"{name}_cpu_small.json", results)
        gpu = dict(data[name], device="cuda", device_name="NVIDIA H100 80GB HBM3")
        (results / f"{name}_cuda_small.json").write_text(json.dumps(gpu))
    text = readme.section(results, tmp_path / "README.md")
    cpu_part, gpu_part = text.split("### On NVIDIA H100 80GB HBM3")
    assert readme.peak_memory_table(data["peak_memory"]) in cpu_part  # newest CPU table, first-load columns
    assert "| first load s |" in cpu_part and "#### Targets (CPU)" in cpu_part
    assert readme.targets_table(summary) in cpu_part
    for table in ("peak_memory", "reload_latency"):
        assert getattr(readme, f"{table}_table")(data[table]) in gpu_part
    assert readme.decode_table(data["decode_step"]) in gpu_part and "#### Targets" in gpu_part
    assert f"commit {summary['commit']}" in gpu_part


def test_a_torchao_schemes_first_load_cost_is_judged_without_torchaos_own_import():
    from layerwise.benchmarks import suite

    def row(scheme, first_minus_second, **extra):
        return dict(
            method=f"layerwise-{scheme}",
            time_over_floor=1.2,
            first_over_floor=3.0,
            first_minus_second_seconds=first_minus_second,
            overhead_over_largest_layer=0.0,
            **extra,
        )

    torchao = "torchao:Float8WeightOnlyConfig"
    rows = [
        row("fp8-per-tensor", 1.2),  # no import to take off: over the 1.0 s target
        row(torchao, 1.6, torchao_import_seconds=1.45, first_minus_second_less_torchao_import_seconds=0.15),
    ]
    out = suite.targets("cpu", {"results": rows}, None, None)
    assert out["met"]["first-load cost fp8-per-tensor"] is False
    assert out["met"][f"first-load cost {torchao}"] is True
    assert out["first_minus_second_load_seconds"] == {"fp8-per-tensor": 1.2, torchao: 1.6}  # raw, as measured
    assert out["first_minus_second_less_torchao_import_seconds"] == {torchao: 0.15}
    table = readme.targets_table(dict(out, device="cpu"))
    assert f"| first - second load, seconds | {torchao} | 1.60 |  |  |" in table  # no verdict on the raw figure
    assert f"| first - second load less torchao's own import, seconds | {torchao} | 0.15 | 1 | yes |" in table


@pytest.mark.slow
def test_first_load_profile_small(tmp_path):
    from layerwise.benchmarks import first_load_profile

    args = ["--size", "small", "--out-dir", str(tmp_path), "--cache-dir", str(tmp_path / "cache")]
    assert first_load_profile.main(args) == 0
    result = json.loads((tmp_path / "first_load_profile_cpu_small.json").read_text())
    _check_provenance(result, "cpu", "small")
    (row,) = result["rows"]
    assert row["scheme"] == "fp8-per-channel" and row["first_profiled_seconds"] > 0 and row["second_seconds"] > 0
    assert "layerwise" in row["own_seconds_by_package"]
    assert any("load_model" in e["function"] for e in row["cumulative"][:5])  # the load is what was profiled
    cumulative = [e["cumulative_seconds"] for e in row["cumulative"]]
    assert cumulative == sorted(cumulative, reverse=True) and len(row["own"]) == len(row["cumulative"])


def test_first_load_profile_packages():
    from layerwise.benchmarks.first_load_profile import package_of

    assert package_of("/usr/lib/python3.12/site-packages/triton/runtime/jit.py") == "triton"
    assert package_of("/venv/lib/python3.11/dist-packages/safetensors/torch.py") == "safetensors"
    assert package_of("/work/main/kernels/fp8_tiles.py") == "layerwise"
    assert package_of("/usr/lib/python3.12/importlib/__init__.py") == "stdlib:importlib"
    assert package_of("~") == "builtins" and package_of("<frozen importlib._bootstrap>") == "builtins"


def test_readme_keeps_a_reused_pages_run_apart_from_the_default_one(tmp_path):
    # a --pages reused run of peak_memory is newer but must not replace the default (fresh pages) table: it is its
    # own benchmark for the README, shown as one more line under the table
    committed = json.loads((REFERENCE / "peak_memory_cpu_0.9b.json").read_text())
    reused = dict(committed, pages="reused", date="9999-01-01")
    (tmp_path / "peak_memory_cpu_0.9b.json").write_text(json.dumps(committed))
    (tmp_path / "peak_memory_cpu_0.9b_reused.json").write_text(json.dumps(reused))
    latest = readme.latest_results(tmp_path)
    assert latest[("peak_memory", "cpu")][0] == "peak_memory_cpu_0.9b"
    assert latest[("peak_memory_reused", "cpu")][0] == "peak_memory_cpu_0.9b_reused"
    line = readme._reused_pages_line(committed, latest[("peak_memory_reused", "cpu")])
    assert "peak_memory_cpu_0.9b_reused.json" in line and "fp8-per-tensor" in line
