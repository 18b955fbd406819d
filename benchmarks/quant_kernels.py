"""Throughput of FP8 weight quantization (amax + scale + quantize) against the clone floor.

GB/s counts the input tensor's bytes once (bf16: 2 bytes an element), for the quantization and
for ``clone`` alike, measured in the same run; ``ratio_to_clone`` = quantize GB/s / clone GB/s.
On CUDA the JSON also gives the fraction of the device's peak memory bandwidth, counting the bytes
actually moved (quantize: read twice, write fp8 once; clone: read and write once).

    python -m layerwise.benchmarks.quant_kernels [--device cpu|cuda] [--shapes 8192x8192,1024x2816] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform

import torch

from layerwise.benchmarks.timing import best_of
from layerwise.kernels import GRANULARITIES, fp8_quantize_weight, resolve_kernel

# HBM bandwidth in GB/s by device name fragment (vendor data sheets)
PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L40S": 864.0, "RTX 4090": 1008.0}


def run(device: str, shapes: list[tuple[int, int]], repeats: int, kernel: str | None = None) -> dict:
    device = torch.device(device)
    kernel = resolve_kernel(kernel, device)
    peak = next((v for k, v in PEAK_GBPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name()),
                None)
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device).to(torch.bfloat16)
        nbytes = w.numel() * w.element_size()
        clone_s = best_of(lambda: w.clone(), device, repeats)
        for granularity in GRANULARITIES:
            seconds = best_of(lambda: fp8_quantize_weight(w, granularity, kernel), device, repeats)
            row = {"shape": [n, k], "scheme": f"fp8-per-{granularity}", "kernel": kernel,
                   "seconds": seconds, "gbps": nbytes / seconds / 1e9,
                   "clone_seconds": clone_s, "clone_gbps": nbytes / clone_s / 1e9,
                   "ratio_to_clone": clone_s / seconds}
            if peak:
                row["fraction_of_peak_bandwidth"] = (2.5 * nbytes / seconds / 1e9) / peak
                row["clone_fraction_of_peak_bandwidth"] = (2 * nbytes / clone_s / 1e9) / peak
            rows.append(row)
    return {"benchmark": "quant_kernels", "device": str(device),
            "device_name": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "repeats": repeats, "results": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernel", default=None, choices=["torch", "triton"])
    parser.add_argument("--shapes", default="8192x8192,4096x1024,1024x2816")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="default: benchmarks/results/quant_kernels_<device>.json")
    args = parser.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    result = run(args.device, shapes, args.repeats, args.kernel)
    out = args.out or os.path.join(os.path.dirname(__file__), "results", f"quant_kernels_{args.device}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{'shape':>12} {'scheme':>16} {'GB/s':>7} {'clone GB/s':>10} {'ratio':>6}")
    for r in result["results"]:
        print(f"{'x'.join(map(str, r['shape'])):>12} {r['scheme']:>16} {r['gbps']:7.2f} {r['clone_gbps']:10.2f} "
              f"{r['ratio_to_clone']:6.2f}")
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
