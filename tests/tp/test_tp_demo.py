"""``torchrun --nproc-per-node 2 -m layerwise.tp_demo``: the same greedy tokens as the single-process model, for a
dense checkpoint and for the embedded mixture-of-experts demo in both layouts (experts' intermediate dimension
sharded, or whole experts per rank)."""

import os
import subprocess
import sys

import pytest

from tests.hf_checkpoints import write_hf_checkpoint
from tests.transfer.harness import free_port

pytestmark = pytest.mark.slow  # the whole module (marker: pyproject.toml)


def _torchrun(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 -m layerwise.tp_demo ARGS`` on 127.0.0.1, bounded at 180 s."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(free_port()), "-m", "layerwise.tp_demo", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)


def test_torchrun_demo_matches_single_process(tmp_path):
    path = write_hf_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM")
    done = _torchrun(["--checkpoint", str(path), "--prompt", "1,5,9", "--tokens", "6", "--compare"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tp=2 fp8 tokens:" in done.stdout and "same: True" in done.stdout, done.stdout


@pytest.mark.parametrize("layout", ["tp", "ep"])
def test_torchrun_moe_demo_matches_single_process(tmp_path, layout):
    """The embedded Qwen3-MoE demo (written by rank 0 into an empty cache) gives TP=1's tokens in either layout, and
    each rank reads about half of the checkpoint."""
    args = ["--moe", "--tokens", "8", "--compare"] + (["--expert-parallel"] if layout == "ep" else [])
    done = _torchrun(args, env={**os.environ, "LAYERWISE_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    label = "tp=2 (expert parallel) fp8 tokens:" if layout == "ep" else "tp=2 fp8 tokens:"
    assert label in done.stdout and "same: True" in done.stdout, done.stdout
    assert (tmp_path / "cache" / "demo-qwen3-moe-4l" / "generation_config.json").exists()
    reads = next(line for line in done.stdout.splitlines() if line.startswith("bytes read per rank:"))
    per_rank, total = reads.removeprefix("bytes read per rank: [").split("] (checkpoint: ")
    total = int(total.rstrip(")"))
    for n in per_rank.split(","):  # half of the sharded tensors plus the replicated norms and routers
        assert total / 2 <= int(n) < 0.51 * total, reads
