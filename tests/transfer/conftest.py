"""Fixtures of the weight-transfer tests: tiny checkpoints, one trainer process and the engines joined to it."""

import pytest

from layerwise.demo import write_checkpoint
from tests.test_errors import TINY
from tests.transfer.harness import Trainer, connect_nccl

TIED = dict(TINY, tie_word_embeddings=True)
GROUP_TIMEOUT_SECONDS = 20.0  # bounds every wait of the shared group, so a broken test fails instead of hanging


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory):
    """{"a", "b", "tied_a", "tied_b"}: tiny Qwen3 checkpoints, b with other weights than a."""
    root = tmp_path_factory.mktemp("transfer")
    return {
        "a": write_checkpoint(root / "a", TINY, seed=0),
        "b": write_checkpoint(root / "b", TINY, seed=1),
        "tied_a": write_checkpoint(root / "ta", TIED, seed=0),
        "tied_b": write_checkpoint(root / "tb", TIED, seed=1),
    }


@pytest.fixture(scope="session")
def trainer():
    """One trainer process shared by the tests (spawned once)."""
    t = Trainer()
    yield t
    t.close()


@pytest.fixture(scope="session")
def nccl_engine(trainer):
    """The "nccl" backend on CPU (gloo), joined to the shared trainer."""
    engine = connect_nccl(trainer, GROUP_TIMEOUT_SECONDS)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def ipc_engine():
    from layerwise.transfer import WeightTransferEngineFactory

    engine = WeightTransferEngineFactory.create_engine("ipc")
    engine.init_transfer_engine({"allow_pickled_handles": True})
    return engine
