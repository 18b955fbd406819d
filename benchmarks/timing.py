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


def graph_seconds(fn: Callable[[], object], device: torch.device, calls: int = 20, repeats: int = 3) -> float:
    """Device seconds of one call of ``fn``, as a decode step's CUDA graph replays it (no launch overhead):
    ``calls`` calls captured in one graph, replayed ``repeats`` times, fastest replay / ``calls``.

    ``fn`` runs once eagerly first (Triton compiles, the allocator warms). On CPU: the wall time of one
    call after that first one.
    """
    fn()
    if device.type != "cuda":
        return best_of(fn, device, 1, warmup=False)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):  # the warmed-up stream, as the Engine captures
        for _ in range(calls):
            fn()
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best
