"""Backend "ipc": who removes the shared-memory segments /dev/shm/<prefix>_<n>, and when.

The fault these tests pin: a trainer killed with SIGKILL together with its resource tracker (which would
otherwise unlink a leaked SharedMemory) left its segment in /dev/shm forever. Now the engine removes its
prefix's segments at init, after a failed chunk and at shutdown, and never anything else.
"""

import base64
import json
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from layerwise.transfer import WeightTransferEngineFactory
from layerwise.transfer.ipc import (
    IPCTrainerSendWeightsArgs,
    IPCWeightTransferEngine,
    IPCWeightTransferInitInfo,
    new_segment_prefix,
    segment_names,
)

SHM = "/dev/shm"
WAIT_SECONDS = 20.0  # bound on every wait for a child process; a dead or stuck child fails the test
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A trainer that sends its first chunk and then never returns from send_update: killed mid-update, with its
# segment (4 float32 tensors of 1 KiB, 2 KiB chunks) created, mapped and registered with its resource tracker.
TRAINER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from layerwise.transfer.ipc import IPCWeightTransferEngine

    def send_update(info):
        print(json.dumps(info), flush=True)
        time.sleep(600)  # the engine never answers

    tensors = [(f"t{i}", torch.full((256,), float(i))) for i in range(4)]
    IPCWeightTransferEngine.trainer_send_weights(
        iter(tensors), {"send_update": send_update, "buffer_size_bytes": 2048, "segment_prefix": sys.argv[1]}
    )
    """
)


def _prefixed(prefix: str) -> set[str]:
    """Every /dev/shm entry whose name starts with ``prefix`` (listed independently of the code under test)."""
    return {name for name in os.listdir(SHM) if name.startswith(prefix)}


def _group_members(pgid: int) -> dict[int, str]:
    """pid -> state of every process in process group ``pgid``, from /proc."""
    members = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == pgid:
            members[int(entry)] = state
    return members


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the child's group (it leads it), then reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # already gone
    proc.wait(timeout=WAIT_SECONDS)


def _read_line(proc: subprocess.Popen, timeout: float) -> bytes:
    """One line of the child's stdout, or a failure naming its stderr once ``timeout`` passed or it died."""
    deadline, data = time.monotonic() + timeout, b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        ready, _, _ = select.select([proc.stdout], [], [], max(left, 0))
        chunk = os.read(proc.stdout.fileno(), 1 << 16) if ready else b""
        if not chunk:
            _kill_group(proc)
            pytest.fail(f"trainer sent no chunk within {timeout} s: {proc.stderr.read().decode()[-2000:]}")
        data += chunk
    return data


def _kill_trainer_mid_update(prefix: str) -> dict:
    """Start a trainer in its own session, take its first chunk, SIGKILL its whole process group (resource
    tracker included); returns the chunk's update info. Its segment is then left behind."""
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, prefix],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # setsid: the trainer leads a process group that its resource tracker joins
    )
    try:
        info = json.loads(_read_line(proc, WAIT_SECONDS))
        members = _group_members(proc.pid)
        assert len(members) >= 2, f"no resource tracker in the trainer's process group: {members}"
    finally:
        _kill_group(proc)
    deadline = time.monotonic() + WAIT_SECONDS
    while any(state != "Z" for state in _group_members(proc.pid).values()):  # the tracker: gone or a zombie
        assert time.monotonic() < deadline, f"trainer's group still alive: {_group_members(proc.pid)}"
        time.sleep(0.05)
    proc.stdout.close()
    proc.stderr.close()
    return info


def _segment_of(info: dict) -> str:
    """The segment name of the chunk's (CPU) handles."""
    names = {h["shm_name"] for h in pickle.loads(base64.b64decode(info["ipc_handles_pickled"]))}
    assert len(names) == 1, names
    return names.pop()


@pytest.fixture
def decoys():
    """Entries an engine must never remove: another engine's segment, and names that start like ours but are
    not ``<prefix>_<n>``. Yields a function prefix -> the names it created (removed again at teardown)."""
    created = []

    def make(prefix: str) -> set[str]:
        names = [f"{new_segment_prefix()}_0", prefix, f"{prefix}_x", f"{prefix}0_1", f"{prefix}_1_0", f"{prefix}_2.x"]
        for name in names:
            with open(os.path.join(SHM, name), "x"):
                created.append(name)
        return set(names)

    yield make
    for name in created:
        if os.path.exists(os.path.join(SHM, name)):
            os.unlink(os.path.join(SHM, name))


def _reject(weights):
    raise RuntimeError("the model rejected the chunk")


@pytest.mark.parametrize("cleanup", ["failed_update", "shutdown", "remove_segments", "init_again"])
def test_a_trainer_killed_with_its_resource_tracker_leaves_nothing_after_the_engines_cleanup(decoys, cleanup):
    engine = WeightTransferEngineFactory.create_engine("ipc")
    engine.init_transfer_engine({"allow_pickled_handles": True})  # the engine draws the prefix
    prefix = engine.segment_prefix
    kept = decoys(prefix)
    try:
        info = _kill_trainer_mid_update(prefix)
        segment = _segment_of(info)
        assert re.fullmatch(re.escape(prefix) + r"_[0-9]+", segment), segment
        # the fault: trainer and tracker are gone, nobody removed the segment
        assert os.path.exists(os.path.join(SHM, segment))
        if cleanup == "failed_update":  # the engine receives the dead trainer's chunk, and the update fails
            with pytest.raises(RuntimeError, match="rejected"):
                engine.receive_weights(info, _reject)
        elif cleanup == "shutdown":
            engine.shutdown()
            engine.shutdown()  # twice is safe
        elif cleanup == "remove_segments":  # e.g. the control plane timed out on the trainer
            assert engine.remove_segments() == [segment]
        else:  # both sides restarted: a new engine with the same prefix
            fresh = WeightTransferEngineFactory.create_engine("ipc")
            fresh.init_transfer_engine({"allow_pickled_handles": True, "segment_prefix": prefix})
        assert _prefixed(prefix) == {name for name in kept if name.startswith(prefix)}
        assert all(os.path.exists(os.path.join(SHM, name)) for name in kept)
    finally:
        for name in segment_names(prefix):
            os.unlink(os.path.join(SHM, name))


def test_a_failed_update_removes_a_live_trainers_segment_and_the_trainer_ends_cleanly(trainer, ipc_engine):
    """The trainer, waiting in send_update, learns the engine's error, not a FileNotFoundError of its own."""
    prefix = ipc_engine.segment_prefix
    tensors = [(f"t{i}", torch.full((512,), float(i))) for i in range(4)]  # 2 KiB each, 2 chunks
    trainer.send("ipc_send", (tensors, {"buffer_size_bytes": 4096, "segment_prefix": prefix}, "cpu"))
    kind, info = trainer.reply()
    assert kind == "update", info
    assert segment_names(prefix) == [_segment_of(info)]
    with pytest.raises(RuntimeError, match="rejected"):
        ipc_engine.receive_weights(info, _reject)
    assert segment_names(prefix) == []  # removed while the trainer still maps it
    trainer.send("error", "rejected")
    assert trainer.reply() == ("error", "RuntimeError: engine: rejected")


def test_the_prefix_is_drawn_fresh_and_checked():
    a, b = IPCWeightTransferInitInfo(), IPCWeightTransferInitInfo()
    assert re.fullmatch(r"layerwise_[0-9a-f]{16}", a.segment_prefix) and a.segment_prefix != b.segment_prefix
    engines = [WeightTransferEngineFactory.create_engine("ipc") for _ in range(2)]
    for engine in engines:
        assert engine.segment_prefix is None
        engine.init_transfer_engine({"allow_pickled_handles": True})
    assert engines[0].segment_prefix != engines[1].segment_prefix
    engines[0].init_transfer_engine({"allow_pickled_handles": True, "segment_prefix": "job-7.rank_0"})
    assert engines[0].segment_prefix == "job-7.rank_0"
    for bad in ["", "a/b", "../x", ".x", "-x", "a b", "x" * 201, "psm_\n", 7]:
        with pytest.raises(ValueError, match="segment_prefix"):
            IPCWeightTransferInitInfo(allow_pickled_handles=True, segment_prefix=bad)
        with pytest.raises(ValueError, match="segment_prefix"):
            engines[1].init_transfer_engine({"allow_pickled_handles": True, "segment_prefix": bad})
        with pytest.raises(ValueError, match="segment_prefix"):
            IPCTrainerSendWeightsArgs(send_update=print, segment_prefix=bad)
    assert engines[1].segment_prefix is not None and engines[1].allow_pickled_handles  # a refused init changes nothing


def test_init_with_another_prefix_and_shutdown_remove_the_old_prefixs_segments(decoys):
    engine = IPCWeightTransferEngine()
    with pytest.raises(RuntimeError, match="init_transfer_engine"):
        engine.remove_segments()
    engine.shutdown()  # before init: nothing to do
    first, second = new_segment_prefix(), new_segment_prefix()
    kept = decoys(first) | decoys(second)
    try:
        for name in [f"{first}_0", f"{first}_17"]:
            open(os.path.join(SHM, name), "x").close()
        engine.init_transfer_engine({"allow_pickled_handles": True, "segment_prefix": first})
        assert _prefixed(first) == {n for n in kept if n.startswith(first)}  # init removed the leftovers
        open(os.path.join(SHM, f"{first}_3"), "x").close()
        engine.init_transfer_engine({"allow_pickled_handles": True, "segment_prefix": second})
        assert f"{first}_3" not in _prefixed(first)
        open(os.path.join(SHM, f"{second}_0"), "x").close()
        engine.shutdown()
        assert engine.segment_prefix is None and engine.allow_pickled_handles is None
        assert _prefixed(second) == {n for n in kept if n.startswith(second)}
        assert all(os.path.exists(os.path.join(SHM, name)) for name in kept)
    finally:
        for prefix in (first, second):
            for name in segment_names(prefix):
                os.unlink(os.path.join(SHM, name))


def test_trainer_unregisters_a_segment_the_engine_already_removed():
    """Else its resource tracker, at exit, warns of a leak and unlinks the name again (maybe a newer segment)."""
    script = textwrap.dedent(
        """
        import os, sys
        from layerwise.transfer.ipc import _create_segment, _unlink
        segment = _create_segment(sys.argv[1], 64)
        os.unlink("/dev/shm/" + segment.name)  # the engine's cleanup after a failed update
        _unlink(segment)
        print(segment.name)
        """
    )
    prefix = new_segment_prefix()
    done = subprocess.run(
        [sys.executable, "-c", script, prefix], cwd=REPO, capture_output=True, text=True, timeout=WAIT_SECONDS
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{prefix}_0"
    assert "leaked" not in done.stderr and "resource_tracker" not in done.stderr, done.stderr
