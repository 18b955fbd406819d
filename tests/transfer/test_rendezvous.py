"""Joining a weight-transfer group (issue 32): bounded by timeout_seconds, each rank admitted once.

Before: with no trainer, 1 s took 1.8-2.8 s and 4 s up to 8.3 s (TCPStore's connection back-off, then the
process group's own wait); the port of a formed group took 10 s for 2 s, and a second engine sometimes joined.
Trainer and engines run as threads of this process (gloo); every join has its own free port.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from layerwise.transfer import WeightTransferEngineFactory, WeightTransferError, WeightTransferTimeoutError
from layerwise.transfer.nccl import NCCLWeightTransferEngine
from tests.transfer.harness import free_port, group_in_threads, nccl_init_info


def _engine_join(info: dict) -> float:
    engine = WeightTransferEngineFactory.create_engine("nccl", device="cpu")
    started = time.monotonic()
    try:
        engine.init_transfer_engine(info)
    finally:
        elapsed = time.monotonic() - started
        engine.shutdown()
    return elapsed


@pytest.mark.parametrize("timeout", [1.0, 2.0, 4.0])
def test_an_engine_with_no_trainer_gives_up_within_its_timeout(timeout):
    started = time.monotonic()
    with pytest.raises(WeightTransferTimeoutError) as caught:
        _engine_join(nccl_init_info(free_port(), timeout))
    elapsed = time.monotonic() - started
    assert timeout * 0.9 <= elapsed <= 1.5 * timeout + 1.0, f"{elapsed:.2f} s for a {timeout:g} s timeout"
    message = str(caught.value)
    assert f"timeout_seconds {timeout:g}" in message and "no trainer listening" in message
    reported = float(message.split(" after ")[1].split(" s")[0])
    assert abs(reported - elapsed) < 0.5, (reported, elapsed)  # the true elapsed time, not the timeout


def test_a_trainer_with_no_engine_gives_up_within_its_timeout():
    started = time.monotonic()
    with pytest.raises(WeightTransferTimeoutError, match=r"1 of 2 ranks joined .* in 1\.\d s \(timeout_seconds 1\)"):
        NCCLWeightTransferEngine.trainer_init(nccl_init_info(free_port(), 1.0), device="cpu")
    assert time.monotonic() - started <= 2.5


def _send_one(group, engine) -> torch.Tensor:
    """One tensor through the group: proves it still works."""
    from layerwise.transfer import tensor_metadata

    tensors = [("w", torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))]
    got = []
    thread = threading.Thread(
        target=lambda: NCCLWeightTransferEngine.trainer_send_weights(iter(tensors), {"group": group})
    )
    thread.start()
    engine.receive_weights(tensor_metadata(tensors), lambda batch: got.extend(t.clone() for _, t in batch))
    thread.join(10)
    return got[0]


def test_a_second_engine_on_a_formed_group_is_refused_at_once():
    info = nccl_init_info(free_port(), 4.0)
    group, engine = group_in_threads(info)
    try:
        started = time.monotonic()
        with pytest.raises(WeightTransferError, match="rank 1 of group .* has joined already") as caught:
            _engine_join(info)
        assert not isinstance(caught.value, WeightTransferTimeoutError)
        assert time.monotonic() - started < 1.0
        assert torch.equal(_send_one(group, engine), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    finally:
        engine.shutdown()
        group.shutdown()


def test_a_group_id_or_world_size_other_than_the_trainers_is_refused():
    info = dict(nccl_init_info(free_port(), 4.0), world_size=3, group_id="round-7")
    holder = {}

    def trainer():
        try:
            holder["group"] = NCCLWeightTransferEngine.trainer_init(info, "cpu")
        except WeightTransferTimeoutError as e:  # rank 2 never comes: the trainer gives up in time
            holder["error"] = e

    thread = threading.Thread(target=trainer)
    thread.start()
    with pytest.raises(WeightTransferError, match="hosts group 'round-7', the init info names 'round-6'"):
        _engine_join(dict(info, group_id="round-6"))
    with pytest.raises(WeightTransferError, match="world_size 3, this init info says 2"):
        _engine_join(dict(info, world_size=2))
    thread.join(10)
    assert "1 of 3 ranks joined" in str(holder["error"])


def test_a_matching_group_id_forms_the_group():
    info = dict(nccl_init_info(free_port(), 4.0), group_id="round-7")
    group, engine = group_in_threads(info)
    try:
        assert torch.equal(_send_one(group, engine), torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    finally:
        engine.shutdown()
        group.shutdown()
    with pytest.raises(ValueError, match="group_id must be"):
        NCCLWeightTransferEngine.trainer_init(dict(info, group_id="a/b"), device="cpu")


def test_a_rank_that_gave_up_abandons_the_group_for_everyone():
    """world_size 3: rank 1 gives up before rank 2 comes; rank 2 and the trainer must not form a group
    around the missing rank (which would cost them another timeout), and a retry is told why."""
    info = nccl_init_info(free_port(), 4.0)
    info["world_size"] = 3
    holder = {}

    def trainer():
        try:
            NCCLWeightTransferEngine.trainer_init(info, "cpu")
        except WeightTransferError as e:
            holder["trainer"] = (e, time.monotonic())

    thread = threading.Thread(target=trainer)
    thread.start()
    started = time.monotonic()
    with pytest.raises(WeightTransferTimeoutError):
        _engine_join(dict(info, timeout_seconds=1.0))  # rank 1 gives up after 1 s
    late = WeightTransferEngineFactory.create_engine("nccl", device="cpu", worker_rank=1)  # rank 2
    with pytest.raises(WeightTransferError, match="abandoned"):
        late.init_transfer_engine(info)
    with pytest.raises(WeightTransferError, match="abandoned"):
        _engine_join(info)  # rank 1 again
    thread.join(10)
    error, when = holder["trainer"]
    assert "abandoned" in str(error) and when - started < 2.0, (error, when - started)
