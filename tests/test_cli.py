"""The CLI on checkpoints written by transformers, and the demo."""

import json
import re

import pytest

from layerwise.cli import main

REPORT_FIELDS = {
    "architecture",
    "num_layers",
    "device",
    "quantization",
    "checkpoint_bytes",
    "model_bytes",
    "largest_layer_checkpoint_bytes",
    "peak_bytes",
    "seconds",
}


def test_load_writes_report(hf_checkpoint, tmp_path, capsys):
    arch, path = hf_checkpoint
    out = tmp_path / "r.json"
    assert main(["load", str(path), "--quantization", "fp8", "--device", "cpu", "--report", str(out)]) == 0
    report = json.loads(out.read_text())
    assert REPORT_FIELDS <= set(report)
    assert report["architecture"] == arch and report["quantization"] == "fp8-per-tensor"
    assert report["num_layers"] == 2 and report["device"] == "cpu"
    assert 0 < report["model_bytes"] < report["checkpoint_bytes"]
    printed = capsys.readouterr().out
    assert f"{report['overhead_per_layer']:.2f} x largest layer" in printed


def test_demo_runs(tmp_path, capsys):
    assert main(["demo", "--cache-dir", str(tmp_path), "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3ForCausalLM" in out and "greedy tokens" in out


def test_unknown_quantization_is_rejected(hf_checkpoint):
    with pytest.raises(SystemExit):
        main(["load", str(hf_checkpoint[1]), "--quantization", "int3"])


@pytest.mark.slow
def test_reload_command_shows_outputs_follow_b_in_place(tmp_path, capsys):
    assert main(["reload", "--cache-dir", str(tmp_path), "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "outputs follow B:          True" in out
    n, total = re.search(r"tensors kept in place:\s+(\d+)/(\d+)", out).groups()
    assert n == total and int(total) > 50
