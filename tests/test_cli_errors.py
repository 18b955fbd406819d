"""Every expected CLI error, run as a user would (a subprocess): one or two lines on stderr naming the
file, key or option, no traceback, exit code 2 for usage and 1 for a failed load."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerwise.demo import write_checkpoint
from tests.test_errors import TINY

KEY = "model.layers.1.mlp.up_proj.weight"


def _run(*args, env_extra=None, cwd=None):
    env = dict(os.environ, **(env_extra or {}))
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.cli", *args], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    if proc.returncode != 0:  # one or two lines, besides the progress bar and the compile notice
        lines = [
            line
            for line in proc.stderr.replace("\r", "\n").splitlines()
            if line.strip() and not line.startswith(("loading", "layerwise: compiling"))
        ]
        assert 1 <= len(lines) <= 2, proc.stderr
    return proc


def _error_lines(proc) -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith("layerwise: error")]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cli") / "ckpt", TINY, max_shard_bytes=8 << 10)


def _copy(ckpt, tmp_path):
    import shutil

    return shutil.copytree(ckpt, tmp_path / "copy")


def _shard_of(path, key):
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]


def test_missing_directory_is_a_usage_error(tmp_path):
    proc = _run("load", str(tmp_path / "nope"))
    assert proc.returncode == 2 and str(tmp_path / "nope") in proc.stderr and "PATH" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2


def test_unknown_scheme_names_the_option_and_the_choices(ckpt):
    proc = _run("load", str(ckpt), "--quantization", "int3")
    assert proc.returncode == 2 and "--quantization" in proc.stderr and "fp8-per-channel" in proc.stderr


def test_scheme_names_are_case_insensitive(ckpt, tmp_path):
    report = tmp_path / "r.json"
    proc = _run("load", str(ckpt), "--quantization", "FP8-Per-Channel", "--report", str(report))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(report.read_text())["quantization"] == "fp8-per-channel"


def test_bad_dtype_and_kernel_are_usage_errors(ckpt):
    proc = _run("load", str(ckpt), "--dtype", "float8")
    assert proc.returncode == 2 and "--dtype" in proc.stderr and "bfloat16" in proc.stderr
    proc = _run("load", str(ckpt), "--kernel", "cutlass")
    assert proc.returncode == 2 and "--kernel" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_cuda_without_a_gpu_is_a_usage_error_before_loading(ckpt):
    proc = _run("load", str(ckpt), "--device", "cuda")
    assert proc.returncode == 2 and "--device cuda" in proc.stderr and "no CUDA GPU" in proc.stderr
    assert "loading" not in proc.stderr  # checked before the load started


def test_bad_device_name_is_a_usage_error(ckpt):
    proc = _run("load", str(ckpt), "--device", "tpu:7")
    assert proc.returncode == 2 and "--device" in proc.stderr


def test_path_to_config_json_uses_its_directory(ckpt):
    proc = _run("load", str(ckpt / "config.json"))
    assert proc.returncode == 0, proc.stderr
    assert "using its checkpoint directory" in proc.stderr and "Qwen3ForCausalLM" in proc.stdout


def test_bad_report_directory_fails_before_loading(ckpt, tmp_path):
    proc = _run("load", str(ckpt), "--report", str(tmp_path / "missing" / "r.json"))
    assert proc.returncode == 2 and "--report" in proc.stderr and str(tmp_path / "missing") in proc.stderr
    assert "loading" not in proc.stderr
    proc = _run("load", str(ckpt), "--report", str(tmp_path))
    assert proc.returncode == 2 and "is a directory" in proc.stderr


@pytest.mark.parametrize(
    "change,words",
    [
        ({"vocab_size": None}, ["lacks the required field(s) vocab_size"]),
        ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention"] * 3}, ["layer_types"]),
    ],
)
def test_config_errors_name_the_file_on_a_line_of_their_own(ckpt, tmp_path, change, words):
    """A config.json the model refuses: one error line naming the field and the file (not a KeyError reported as
    a bug), and not printed onto the progress bar's line (_run counts lines that start with "loading" as the bar)."""
    path = _copy(ckpt, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    proc = _run("load", str(path))
    (line,) = _error_lines(proc)
    assert proc.returncode == 1 and "unexpected" not in line and str(path / "config.json") in line
    assert all(w in line for w in words), line


def test_out_of_device_memory_is_one_line_not_a_bug(ckpt, monkeypatch, capsys):
    from layerwise import cli

    def oom(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity")

    monkeypatch.setattr(cli, "load_model_with_report", oom)
    assert cli.main(["load", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert "out of device memory (CUDA out of memory)" in err and "unexpected" not in err and "Tried" not in err


def test_truncated_shard_says_truncated_and_names_the_file(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    shard = path / _shard_of(path, KEY)
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 64)
    proc = _run("load", str(path))
    assert proc.returncode == 1 and "truncated" in proc.stderr and str(shard) in proc.stderr
    assert len(_error_lines(proc)) == 1


def test_non_finite_weight_names_the_key_and_file(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    shard = path / _shard_of(path, KEY)
    tensors = load_file(str(shard))
    tensors[KEY] = tensors[KEY].clone()
    tensors[KEY].view(-1)[7] = float("nan")
    save_file(tensors, str(shard))
    proc = _run("load", str(path))
    assert proc.returncode == 1 and KEY in proc.stderr and str(shard) in proc.stderr and "NaN" in proc.stderr


def test_unsupported_architecture_lists_the_supported_ones(ckpt, tmp_path):
    path = _copy(ckpt, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    proc = _run("load", str(path))
    assert proc.returncode == 1 and "GPT2LMHeadModel" in proc.stderr and "LlamaForCausalLM" in proc.stderr
    assert str(path / "config.json") in proc.stderr


def _without(tmp_path, package):
    """A PYTHONPATH entry whose sitecustomize hides ``package`` as if it were not installed: find_spec finds
    nothing and its import fails (None in sys.modules)."""
    hide = tmp_path / "hide"
    hide.mkdir(parents=True)
    (hide / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    return {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}


def test_missing_torchao_names_the_pip_line(ckpt, tmp_path):
    proc = _run(
        "load", str(ckpt), "--quantization", "torchao:Float8WeightOnlyConfig", env_extra=_without(tmp_path, "torchao")
    )
    assert proc.returncode == 1 and "torchao" in proc.stderr and "pip install 'torchao" in proc.stderr


def test_missing_bench_dependency_names_the_pip_line(tmp_path):
    proc = _run("bench", "--size", "small", env_extra=_without(tmp_path, "transformers"), cwd=tmp_path)
    assert proc.returncode == 1 and "transformers" in proc.stderr and "pip install" in proc.stderr
    assert ".[bench]" in proc.stderr


def test_reload_needs_both_paths(ckpt):
    proc = _run("reload", str(ckpt))
    assert proc.returncode == 2 and "PATH_B" in proc.stderr


def test_debug_shows_the_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.cli", "--debug", "load", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0 and "Traceback" in proc.stderr
