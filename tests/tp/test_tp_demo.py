"""``torchrun --nproc-per-node 2 -m layerwise.tp_demo``: the same greedy tokens as the single-process model."""

import subprocess
import sys

import pytest

from tests.hf_checkpoints import write_hf_checkpoint
from tests.transfer.harness import free_port

pytestmark = pytest.mark.slow  # the whole module (marker: pyproject.toml)


def test_torchrun_demo_matches_single_process(tmp_path):
    path = write_hf_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM")
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "layerwise.tp_demo",
        "--checkpoint",
        str(path),
        "--prompt",
        "1,5,9",
        "--tokens",
        "6",
        "--compare",
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tp=2 fp8 tokens:" in done.stdout and "same: True" in done.stdout, done.stdout
