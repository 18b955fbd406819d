from collections import Counter

import pytest

from tests.hf_checkpoints import write_hf_checkpoint

ARCHS = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@pytest.fixture(scope="session", params=ARCHS)
def hf_checkpoint(request, tmp_path_factory):
    """(architecture, path) of a 2-layer BF16 checkpoint saved by transformers, sharded."""
    arch = request.param
    return arch, write_hf_checkpoint(tmp_path_factory.mktemp(arch), arch)


@pytest.fixture(scope="session")
def qwen3_8_layers(tmp_path_factory):
    """An 8-layer Qwen3 checkpoint whose decoder layers outweigh its embedding."""
    return write_hf_checkpoint(
        tmp_path_factory.mktemp("qwen3-8"),
        "Qwen3ForCausalLM",
        num_layers=8,
        hidden=128,
        intermediate=384,
        vocab=256,
        max_shard_size="200KB",
    )


@pytest.fixture(scope="session")
def qwen3_pair(tmp_path_factory):
    """Two 3-layer Qwen3 checkpoints of the same shapes and different values (seeds 0 and 1): load A, reload B."""
    root = tmp_path_factory.mktemp("qwen3-pair")
    return (
        write_hf_checkpoint(root / "a", "Qwen3ForCausalLM", seed=0, num_layers=3),
        write_hf_checkpoint(root / "b", "Qwen3ForCausalLM", seed=1, num_layers=3),
    )


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_terminal_summary(terminalreporter):
    """One line that says why tests were skipped, grouped by reason (most skips here need a CUDA GPU), so a few
    hundred "s" do not read as gaps; `-rs` still lists them one by one."""
    skipped = terminalreporter.stats.get("skipped", [])
    if skipped:
        reasons = Counter(_skip_reason(r) for r in skipped)
        grouped = "; ".join(f"{n} {reason}" for reason, n in reasons.most_common())
        terminalreporter.write_line(f"{len(skipped)} skipped: {grouped}")
