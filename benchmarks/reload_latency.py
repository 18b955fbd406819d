"""Hot-reload latency: an in-memory BF16 stream (as from an RL trainer) and a checkpoint on disk,
into a live FP8 model and a live BF16 model, against the floor of copying the same BF16 tensors.

floor: ``dst.copy_(src)`` of every checkpoint tensor into preallocated BF16 tensors of the same
shapes (the least any in-place reload must do). Each figure is the best of ``--repeats`` runs.

    python -m layerwise.benchmarks.reload_latency [--size default|small] [--device cpu|cuda] [--out-dir DIR]

Writes DIR/<name>.json (seconds per case and / floor) and prints the table.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import torch

import layerwise
from layerwise.benchmarks.options import (
    RESULTS_NOTE,
    add_output_arguments,
    default_cache_dir,
    positive_int,
    require,
    write_json,
)
from layerwise.benchmarks.peak_memory import SIZES, describe_machine, make_checkpoint
from layerwise.benchmarks.readme import reload_latency_table
from layerwise.benchmarks.timing import best_of
from layerwise.checkpoint import Checkpoint


def run(size: str, device: str, repeats: int, cache: Path) -> dict:
    """Reload the ``size`` checkpoint (generated under ``cache`` if needed) into live FP8 and BF16 models;
    returns the result that main writes as JSON (seconds, ratios to the floor)."""
    device = torch.device(device)
    path = make_checkpoint(size, cache)
    stream = [(k, t.clone()) for k, t in Checkpoint(path)]  # the trainer's BF16 tensors, in host memory
    stream_bytes = sum(t.numel() * t.element_size() for _, t in stream)
    floor_dst = {k: torch.empty_like(t, device=device) for k, t in stream}
    floor = best_of(lambda: [floor_dst[k].copy_(t) for k, t in stream], device, repeats, warmup=False)
    rows = [{"case": "floor: copy_ BF16 tensors", "seconds": floor, "gbps": stream_bytes / floor / 1e9}]
    for quantization in ("fp8", None):
        model = layerwise.load_model(path, quantization=quantization, device=device)
        name = "fp8-per-tensor" if quantization else "none (bf16)"
        memory = best_of(functools.partial(layerwise.reload_weights, model, stream), device, repeats, warmup=False)
        disk = best_of(functools.partial(layerwise.reload_weights, model, path), device, repeats, warmup=False)
        rows.append({"case": f"{name}: in-memory stream", "seconds": memory, "over_floor": memory / floor})
        rows.append({"case": f"{name}: from disk (page cache warm)", "seconds": disk, "over_floor": disk / floor})
    return {
        "benchmark": "reload_latency",
        "size": size,
        "device": str(device),
        "checkpoint": str(path),
        "stream_bytes": stream_bytes,
        "repeats": repeats,
        "machine": describe_machine(str(device)),
        "results": rows,
    }


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/NAME.json, print the table.

    Raises:
        MissingDependencyError: transformers (which generates the checkpoint) is missing; checked first.
    """
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.reload_latency",
        description=__doc__,
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", default="default", choices=sorted(SIZES), help="checkpoint size (as layerwise bench)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="best of this many runs (default: 3)")
    add_output_arguments(parser, default_name="reload_latency_<device>_<size>")
    args = parser.parse_args(argv)
    require(["transformers"], purpose="python -m layerwise.benchmarks.reload_latency")

    result = run(args.size, args.device, args.repeats, args.cache_dir or default_cache_dir())
    path = write_json(result, args.out_dir, args.name or f"reload_latency_{args.device}_{args.size}")
    print(reload_latency_table(result))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
