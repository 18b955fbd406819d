"""Wall-clock timing shared by the benchmarks."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def best_of(fn: Callable[[], object], device: torch.device, repeats: int, warmup: bool = True) -> float:
    """Fastest of ``repeats`` calls of ``fn`` in seconds (CUDA synchronized around each call);
    ``warmup`` runs it once first (Triton/Inductor compilation, allocator)."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best
