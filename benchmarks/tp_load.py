"""Tensor-parallel load: per-rank peak bytes, bytes read from disk and load time at tp = 1, 2, 4.

Every tp size runs in its own set of processes (torch.multiprocessing spawn; gloo on 127.0.0.1 on CPU,
one thread per process), each rank loading the benchmark checkpoint with
``load_model_with_report(path, quantization, tp_group=group, global_scales=True)``: an untimed warm-up
load (imports, the one-time compile), then the measured load under the live-storage tracker. Per rank:
``bytes_read`` (checkpoint bytes this rank read), ``model_bytes``, ``peak_bytes``, ``seconds``; the JSON
also gives each rank's share of the TP=1 model and the largest decoder layer's bytes divided by tp.

    python -m layerwise.benchmarks.tp_load [--size default|small] [--tp 1,2,4] [--quantization fp8]
"""

from __future__ import annotations

import argparse
import datetime
import queue
import socket
from pathlib import Path

from layerwise.benchmarks.checkpoints import SIZES, make_checkpoint
from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import RESULTS_NOTE, add_output_arguments, default_cache_dir, require, write_json

WAIT_SECONDS = 600.0  # bound on every wait for a rank's result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, size: int, port: int, path: str, quantization: str, results) -> None:
    import torch
    import torch.distributed as dist

    from layerwise.api import load_model_with_report

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=WAIT_SECONDS),
    )
    try:
        group = dist.new_group(list(range(size))) if size > 1 else None
        load_model_with_report(path, quantization, tp_group=group, global_scales=True)  # warm-up
        _, report = load_model_with_report(path, quantization, tp_group=group, global_scales=True)
        keys = ("bytes_read", "model_bytes", "peak_bytes", "seconds", "checkpoint_bytes")
        row = {k: getattr(report, k) for k in keys}
        row["largest_layer_checkpoint_bytes"] = report.largest_layer_checkpoint_bytes  # unsharded
        results.put((rank, row))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_tp(path: Path, size: int, quantization: str) -> list[dict]:
    """Load ``path`` on ``size`` ranks; returns one dict per rank (bytes, seconds).

    Raises:
        TimeoutError: a rank sent nothing within WAIT_SECONDS (it died or hung).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = (size, port, str(path), quantization, results)
    procs = [ctx.Process(target=_rank_main, args=(r, *args)) for r in range(size)]
    for p in procs:
        p.start()
    rows = {}
    try:
        while len(rows) < size:
            try:
                rank, row = results.get(timeout=WAIT_SECONDS)
            except queue.Empty as e:
                raise TimeoutError(f"tp={size}: no result from every rank within {WAIT_SECONDS:.0f} s") from e
            rows[rank] = dict(row, rank=rank)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return [rows[r] for r in range(size)]


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status (writes JSON to --out-dir)."""
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.tp_load",
        description=__doc__,
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--tp", default="1,2,4", help="comma-separated tensor-parallel sizes")
    parser.add_argument("--quantization", default="fp8")
    add_output_arguments(parser, "tp_load_cpu_<size>")
    args = parser.parse_args(argv)
    require(["transformers"])
    sizes = [int(t) for t in args.tp.split(",")]
    path = make_checkpoint(args.size, args.cache_dir or default_cache_dir())
    runs = []
    for size in sizes:
        ranks = run_tp(path, size, args.quantization)
        runs.append({"tp": size, "ranks": ranks})
        worst = max(ranks, key=lambda r: r["peak_bytes"])
        print(
            f"tp={size}: bytes read per rank {[r['bytes_read'] for r in ranks]}, peak {worst['peak_bytes']:,} B, "
            f"model {worst['model_bytes']:,} B, load {max(r['seconds'] for r in ranks):.2f} s"
        )
    result = {
        "benchmark": "tp_load",
        **provenance("cpu", args.size, checkpoint_shape(args.size)),
        "device": "cpu",
        "machine": describe_machine("cpu"),
        "checkpoint": {"size": args.size, **checkpoint_shape(args.size)},
        "quantization": args.quantization,
        "global_scales": True,
        "results": runs,
    }
    out = write_json(result, args.out_dir, args.name or f"tp_load_cpu_{args.size}")
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
