"""Hot-reload latency: an in-memory BF16 stream (as from an RL trainer) and a checkpoint on disk,
into a live FP8 model and a live BF16 model, against the floor of copying the same BF16 tensors.

floor: ``dst.copy_(src)`` of every checkpoint tensor into preallocated BF16 tensors of the same
shapes (the least any in-place reload must do). Each figure is the best of ``--repeats`` runs.

    python -m layerwise.benchmarks.reload_latency [--size default|small] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import layerwise
from layerwise.benchmarks.peak_memory import RESULTS, SIZES, _machine, make_checkpoint
from layerwise.benchmarks.timing import best_of
from layerwise.checkpoint import Checkpoint


def run(size: str, device: str, repeats: int, cache: Path) -> dict:
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
        memory = best_of(lambda: layerwise.reload_weights(model, stream), device, repeats, warmup=False)
        disk = best_of(lambda: layerwise.reload_weights(model, path), device, repeats, warmup=False)
        rows.append({"case": f"{name}: in-memory stream", "seconds": memory, "over_floor": memory / floor})
        rows.append({"case": f"{name}: from disk (page cache warm)", "seconds": disk, "over_floor": disk / floor})
    return {"benchmark": "reload_latency", "size": size, "device": str(device), "checkpoint": str(path),
            "stream_bytes": stream_bytes, "repeats": repeats, "machine": _machine(str(device)), "results": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="default", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/reload_latency_<device>_<size>.json")
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    from layerwise.demo import default_cache_dir

    result = run(args.size, args.device, args.repeats, Path(args.cache_dir) if args.cache_dir else default_cache_dir())
    out = Path(args.out) if args.out else RESULTS / f"reload_latency_{args.device}_{args.size}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print("| case | seconds | / floor |\n|---|---:|---:|")
    for r in result["results"]:
        print(f"| {r['case']} | {r['seconds']:.3f} | {r.get('over_floor', 1.0):.2f} |")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
