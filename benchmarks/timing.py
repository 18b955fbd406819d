"""Wall-clock timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def times(fn: Callable[[], object], device: torch.device, runs: int) -> list[float]:
    """Seconds of each of ``runs`` calls of ``fn`` (CUDA synchronized around each call)."""
    out = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - start)
    return out


def best_of(fn: Callable[[], object], device: torch.device, repeats: int, warmup: bool = True) -> float:
    """Fastest of ``repeats`` calls of ``fn`` in seconds (CUDA synchronized around each call);
    ``warmup`` runs it once first (Triton/Inductor compilation, allocator)."""
    if warmup:
        fn()
    return min(times(fn, device, repeats), default=float("inf"))
