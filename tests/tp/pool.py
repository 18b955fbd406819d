"""A pool of tensor-parallel worker processes (torch.multiprocessing, spawn) on CPU: gloo on 127.0.0.1.

Each worker joins a gloo process group of ``size`` ranks once, creates an explicit TP group with
``dist.new_group`` and then serves calls ``fn(group, *args)`` (top-level functions of tests/tp/workers.py),
so one process group serves every test of a module. Every wait is bounded: a dead or stuck worker fails
the test instead of hanging it.
"""

from __future__ import annotations

import datetime
import os
import queue

import torch.multiprocessing as mp

from tests.transfer.harness import free_port

WAIT_SECONDS = 120.0  # bound on every wait for a worker's reply


def _worker(rank: int, size: int, port: int, backend: str, commands, replies) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=60),
    )
    group = dist.new_group(list(range(size)))
    replies.put(("ready", rank, os.getpid()))
    while True:
        try:
            command = commands.get(timeout=600)
        except queue.Empty:
            break  # the test process is gone
        if command is None:
            break
        fn, args = command
        try:
            replies.put(("ok", rank, fn(group, *args)))
        except Exception as e:  # noqa: BLE001 -- reported to the test
            replies.put(("error", rank, f"{type(e).__name__}: {e}"))
    dist.destroy_process_group()


class TPPool:
    """``size`` spawned ranks; ``run(fn, *args)`` calls ``fn(group, *args)`` on every rank and returns the
    results in rank order (raises RuntimeError naming the rank when one of them raised).

    backend: "gloo" (CPU) or "nccl" (rank r on cuda:r; needs ``size`` GPUs)."""

    def __init__(self, size: int, backend: str = "gloo"):
        ctx = mp.get_context("spawn")
        self.size = size
        self.commands = [ctx.Queue() for _ in range(size)]
        self.replies = ctx.Queue()
        port = free_port()
        self.processes = [
            ctx.Process(target=_worker, args=(r, size, port, backend, self.commands[r], self.replies), daemon=True)
            for r in range(size)
        ]
        for p in self.processes:
            p.start()
        for _ in range(size):
            kind, rank, _ = self.replies.get(timeout=WAIT_SECONDS)
            assert kind == "ready", (kind, rank)

    def submit(self, fn, *args) -> None:
        for q in self.commands:
            q.put((fn, args))

    def collect(self, timeout: float = WAIT_SECONDS) -> list:
        results, errors = [None] * self.size, []
        for _ in range(self.size):
            kind, rank, payload = self.replies.get(timeout=timeout)
            if kind == "error":
                errors.append(f"rank {rank}: {payload}")
            results[rank] = payload
        if errors:
            raise RuntimeError("; ".join(errors))
        return results

    def run(self, fn, *args, timeout: float = WAIT_SECONDS) -> list:
        self.submit(fn, *args)
        return self.collect(timeout)

    def close(self) -> None:
        for q in self.commands:
            q.put(None)
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
