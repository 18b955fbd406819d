"""Test harness: a trainer in a child process (torch.multiprocessing, spawn) and shared engine-side helpers.

The trainer serves commands from a queue, so one process (and one gloo group) serves many tests:

    ("nccl_init", (init_info, device))                -> joins the group as rank 0, replies ("ok", None)
    ("nccl_send", (tensors, args, die_after, stall_after))
                                                      -> trainer_send_weights over the group; ("ok", None)
    ("ipc_send", (tensors, args, device))             -> trainer_send_weights of the ipc backend; each chunk
                                                         is replied as ("update", info) and answered by the
                                                         test with ("ack", None) or ("error", message)
    ("exit", None)

Every error is replied as ("error", message). Each queue wait is bounded, so a dead peer fails a test
instead of hanging it. ``die_after=k``: the process exits (os._exit) after yielding k tensors;
``stall_after=k``: it sleeps instead (a trainer that hangs).
"""

from __future__ import annotations

import os
import queue
import socket
import time

import torch
import torch.multiprocessing as mp

WAIT_SECONDS = 60.0  # bound on every queue wait of the helpers
SCHEMES = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block", "none"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors(tensors, die_after, stall_after):
    for i, pair in enumerate(tensors):
        if die_after is not None and i == die_after:
            os._exit(3)
        if stall_after is not None and i == stall_after:
            time.sleep(3600)
        yield pair


def trainer_main(commands, replies) -> None:
    """The trainer process: rank 0 of the nccl group, owner of the ipc shared memory."""
    from layerwise.transfer.ipc import IPCWeightTransferEngine
    from layerwise.transfer.nccl import NCCLWeightTransferEngine

    group = None
    replies.put(("ready", os.getpid()))
    while True:
        try:
            cmd, payload = commands.get(timeout=600)
        except queue.Empty:
            return  # the test process is gone
        if cmd == "exit":
            return
        try:
            if cmd == "nccl_init":
                init_info, device = payload
                group = NCCLWeightTransferEngine.trainer_init(init_info, device=device)
                replies.put(("ok", None))
            elif cmd == "nccl_send":
                tensors, args, die_after, stall_after = payload
                NCCLWeightTransferEngine.trainer_send_weights(
                    _tensors(tensors, die_after, stall_after), dict(args, group=group)
                )
                replies.put(("ok", None))
            elif cmd == "ipc_send":
                tensors, args, device = payload
                tensors = [(name, t.to(device)) for name, t in tensors]  # CUDA tensors are shared in place

                def send_update(info):
                    replies.put(("update", info))
                    kind, message = commands.get(timeout=WAIT_SECONDS)
                    if kind != "ack":
                        raise RuntimeError(f"engine: {message}")

                IPCWeightTransferEngine.trainer_send_weights(iter(tensors), dict(args, send_update=send_update))
                replies.put(("ok", None))
            else:
                replies.put(("error", f"unknown command {cmd!r}"))
        except Exception as e:  # noqa: BLE001 -- reported to the test
            replies.put(("error", f"{type(e).__name__}: {e}"))


class Trainer:
    """Handle on a trainer child process (spawned); ``close()`` ends it within a few seconds. ``main``: the process's
    command loop, ``main(commands, replies)`` (default :func:`trainer_main`), which first replies ("ready", ...)."""

    def __init__(self, main=None):
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=main or trainer_main, args=(self.commands, self.replies), daemon=True)
        self.process.start()
        kind, _ = self.reply()  # imported and listening: a short group timeout starts counting only now
        assert kind == "ready", kind

    def send(self, cmd: str, payload=None) -> None:
        self.commands.put((cmd, payload))

    def reply(self, timeout: float = WAIT_SECONDS):
        """The next reply (kind, payload); raises queue.Empty after ``timeout`` seconds."""
        return self.replies.get(timeout=timeout)

    def expect_ok(self, timeout: float = WAIT_SECONDS):
        """The payload of the next reply, which must be ("ok", payload)."""
        kind, payload = self.reply(timeout)
        assert kind == "ok", f"trainer replied {kind}: {payload}"
        return payload

    def kill(self) -> None:
        """End the process now (a trainer stuck in a send cannot read "exit")."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)

    def close(self) -> None:
        if self.process.is_alive():
            self.send("exit")
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def nccl_init_info(port: int, timeout_seconds: float) -> dict:
    return {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "timeout_seconds": timeout_seconds,
    }


def connect_nccl(trainer: Trainer, timeout_seconds: float, trainer_device: str = "cpu", device: str = "cpu"):
    """Form a 2-rank group (gloo on CPU, NCCL on CUDA): the trainer as rank 0, an engine in this process as 1."""
    from layerwise.transfer import WeightTransferEngineFactory

    info = nccl_init_info(free_port(), timeout_seconds)
    trainer.send("nccl_init", (info, trainer_device))
    engine = WeightTransferEngineFactory.create_engine("nccl", device=device)
    engine.init_transfer_engine(info)
    trainer.expect_ok()
    return engine


def group_in_threads(info: dict):
    """(trainer group, engine): the trainer joins as rank 0 in a thread of this process, the engine as rank 1
    (gloo); both within the init info's timeout."""
    import threading

    from layerwise.transfer import WeightTransferEngineFactory
    from layerwise.transfer.nccl import NCCLWeightTransferEngine

    holder = {}
    thread = threading.Thread(target=lambda: holder.update(group=NCCLWeightTransferEngine.trainer_init(info, "cpu")))
    thread.start()
    engine = WeightTransferEngineFactory.create_engine("nccl", device="cpu")
    engine.init_transfer_engine(info)
    thread.join(info.get("timeout_seconds", WAIT_SECONDS))
    return holder["group"], engine


def share(tensors):
    """Own copies of the (name, tensor) pairs (putting a tensor in a queue moves it to shared memory)."""
    return [(name, t.detach().clone()) for name, t in tensors]


def receive_ipc(trainer: Trainer, model, ipc_engine, *, is_checkpoint_format: bool = True, atomic: bool = False):
    """Engine side of an ipc send: start an update, receive each chunk the trainer announces, finish.

    Returns (report, error, chunks): the ReloadReport or the error the update raised, and the number of chunks.
    """
    from layerwise.transfer import start_weight_update

    update = start_weight_update(model, is_checkpoint_format, atomic=atomic)
    chunks, error = 0, None
    while True:
        kind, payload = trainer.reply()
        if kind != "update":
            assert kind == "ok" or error is not None, f"trainer replied {kind}: {payload}"
            break
        chunks += 1
        try:
            update.receive(ipc_engine, payload)
            trainer.send("ack")
        except Exception as e:  # noqa: BLE001 -- handed to the trainer and to the test
            error = e
            trainer.send("error", str(e))
    if error is not None:
        return None, error, chunks
    return update.finish(), None, chunks


def fresh(value: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, for bit-for-bit comparison (NaN-safe)."""
    t = value.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def kernel_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The model's kernel-format tensors (parameters, then buffers), as a trainer would send them."""
    return [(n, t.detach()) for n, t in list(model.named_parameters()) + list(model.named_buffers())]


def pointers(model) -> dict[str, tuple]:
    """name -> (tensor object id, data_ptr) of every parameter and buffer."""
    return {n: (id(t), t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def assert_same_tensors(model, reference, names=None) -> None:
    """Every parameter and buffer of ``model`` (or those in ``names``) equals ``reference``'s bit for bit."""
    ours, theirs = dict(kernel_tensors(model)), dict(kernel_tensors(reference))
    assert ours.keys() == theirs.keys()
    for name in names if names is not None else ours:
        assert ours[name].dtype == theirs[name].dtype, name
        assert torch.equal(fresh(ours[name]), fresh(theirs[name])), f"{name} differs"


def checkpoint_tensors(path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint's (key, BF16 tensor) pairs in file order: the trainer's weights in HF naming."""
    from layerwise.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    try:
        return share(list(ckpt))
    finally:
        ckpt.close()
