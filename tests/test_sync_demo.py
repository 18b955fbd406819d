"""The weight-sync demo: examples/rl_weight_sync.py and ``layerwise sync-demo`` (two processes, gloo on CPU).

Each run spawns a trainer process (transformers, one AdamW step) that sends its BF16 weights into this
side's FP8 Engine. Checked: the greedy tokens change, every kernel tensor keeps its data_ptr, the engine
equals a fresh load of the sent weights, the update time is printed; a trainer that dies before sending
ends the CLI with one error line naming the timeout, exit code 1, long before the timeout.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from layerwise.cli import EXIT_FAILED, EXIT_USAGE, main
from layerwise.demo import DEMO_CONFIG, write_checkpoint
from layerwise.sync_demo import FAULT_ENV

pytestmark = pytest.mark.slow  # the whole module (marker: pyproject.toml)

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
# A 2-layer Qwen3 (0.7 MiB of BF16) for the CLI tests: loads in a fraction of a second on both sides.
SMALL = dict(
    DEMO_CONFIG,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
)
UPDATE_TIME = re.compile(r"update time:\s+(\d+\.\d+) s")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Where the example writes the demo checkpoint (52 MiB, generated on first use)."""
    return tmp_path_factory.mktemp("sync-demo-cache")


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("sync-demo-small") / "ckpt", SMALL)


def _assert_synced(out: str) -> float:
    """The claims every successful run prints; returns the printed update time (seconds)."""
    assert re.search(r"tokens changed:\s+True", out), out
    assert re.search(r"every data_ptr kept:\s+True", out), out
    assert "engine == fresh load of the sent weights: True" in out, out
    match = UPDATE_TIME.search(out)
    assert match, out
    return float(match.group(1))


def test_example_script(cache_dir):
    """examples/rl_weight_sync.py as a user runs it, on the demo checkpoint (8 layers)."""
    proc = subprocess.run(
        [sys.executable, "examples/rl_weight_sync.py", "--tokens", "3", "--cache-dir", str(cache_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert 0 < _assert_synced(proc.stdout) < 60
    before = re.search(r"tokens before the update: (\[.*\])", proc.stdout).group(1)
    after = re.search(r"tokens after the update:\s+(\[.*\])", proc.stdout).group(1)
    assert before != after and len(json.loads(after)) == 3
    assert re.search(r"modules updated: 66 \(8 decoder layers\)", proc.stdout), proc.stdout


def test_cli_sync_demo(small_checkpoint, capsys):
    """``layerwise sync-demo PATH --tokens 3`` in this process (the trainer is still spawned), on the small
    checkpoint: the demo checkpoint's run is test_example_script's."""
    assert main(["sync-demo", str(small_checkpoint), "--tokens", "3", "--timeout", "60"]) == 0
    out = capsys.readouterr().out
    assert 0 < _assert_synced(out) < 60
    assert re.search(r"bytes sent:\s+722432 ", out), out  # every BF16 tensor of the checkpoint, once
    assert re.search(r"modules updated:\s+18 \(2 decoder layers\)", out), out
    n, total = re.search(r"\((\d+)/(\d+) kernel tensors", out).groups()
    assert n == total and int(total) == 28


def test_cli_dead_trainer_fails_in_one_line(small_checkpoint):
    """The trainer joins the group, then exits (code 3) before sending: exit code 1, one error line that
    names the timeout and the trainer's exit, no traceback, and well within the timeout."""
    timeout = 60
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.cli", "sync-demo", str(small_checkpoint), "--tokens", "2"]
        + ["--timeout", str(timeout)],
        capture_output=True,
        text=True,
        timeout=3 * timeout,
        env=dict(os.environ, **{FAULT_ENV: "die-before-send"}),
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == EXIT_FAILED, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("layerwise: compiling")]
    errors = [line for line in lines if line.startswith("layerwise: error:")]
    assert len(errors) == 1 and len(lines) <= 2, proc.stderr  # the error, then the --debug hint
    assert f"within {timeout} s" in errors[0] and "exited with code 3" in errors[0], errors[0]
    assert elapsed < timeout, f"took {elapsed:.1f} s: the dead trainer was not noticed before the timeout"
    assert "tokens after" not in proc.stdout


@pytest.mark.parametrize(
    "args",
    [["--tokens", "0"], ["--timeout", "0"], ["/nonexistent/checkpoint"]],
    ids=["tokens", "timeout", "path"],
)
def test_cli_usage_errors(args, capsys):
    """Bad options are refused before anything is loaded or spawned (exit 2, one line)."""
    assert main(["sync-demo", *args]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("layerwise: error:"), err


def test_cli_without_transformers(monkeypatch, capsys):
    """No transformers: one line naming it and the pip command, exit 1, before anything is spawned."""
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    assert main(["sync-demo", "--tokens", "1", "--cache-dir", "/nonexistent/never-written"]) == EXIT_FAILED
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("layerwise: error:")]
    assert len(errors) == 1 and "needs transformers" in errors[0] and "pip install" in errors[0], errors
