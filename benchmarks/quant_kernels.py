"""Throughput of FP8 weight quantization (amax + scale + quantize) against the clone floor.

GB/s counts the input tensor's bytes once (bf16: 2 bytes an element), for the quantization and
for ``clone`` alike, measured in the same run; ``ratio_to_clone`` = quantize GB/s / clone GB/s.
On CUDA the JSON also gives the fraction of the device's peak memory bandwidth, counting the bytes
actually moved (quantize: read twice, write fp8 once; clone: read and write once).

    python -m layerwise.benchmarks.quant_kernels [--device cpu|cuda] [--shapes 8192x8192,1024x2816]
        [--out-dir DIR]

Writes DIR/<name>.json (seconds and GB/s per shape and scheme) and prints the table.
"""

from __future__ import annotations

import argparse
import functools

import torch

from layerwise.benchmarks.machine import provenance
from layerwise.benchmarks.options import RESULTS_NOTE, add_output_arguments, positive_int, write_json
from layerwise.benchmarks.readme import quant_kernels_table
from layerwise.benchmarks.timing import best_of
from layerwise.kernels import GRANULARITIES, cpu_native, fp8_quantize_weight, resolve_kernel

# HBM bandwidth in GB/s by device name fragment (vendor data sheets)
PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0, "A100": 2039.0, "L40S": 864.0, "RTX 4090": 1008.0}


def run(device: str, shapes: list[tuple[int, int]], repeats: int, kernel: str | None = None) -> dict:
    """Time clone and the three FP8 granularities on a random BF16 tensor of each shape; returns the result
    that main writes as JSON (seconds, GB/s, ratios)."""
    device = torch.device(device)
    kernel = resolve_kernel(kernel, device)
    peak = next((v for k, v in PEAK_GBPS.items() if device.type == "cuda" and k in torch.cuda.get_device_name()), None)
    rows = []
    for n, k in shapes:
        w = torch.randn(n, k, device=device).to(torch.bfloat16)
        nbytes = w.numel() * w.element_size()
        clone_s = best_of(w.clone, device, repeats)
        for granularity in GRANULARITIES:
            seconds = best_of(functools.partial(fp8_quantize_weight, w, granularity, kernel), device, repeats)
            row = {
                "shape": [n, k],
                "scheme": f"fp8-per-{granularity}",
                "kernel": kernel,
                "seconds": seconds,
                "gbps": nbytes / seconds / 1e9,
                "clone_seconds": clone_s,
                "clone_gbps": nbytes / clone_s / 1e9,
                "ratio_to_clone": clone_s / seconds,
            }
            if peak:
                row["fraction_of_peak_bandwidth"] = (2.5 * nbytes / seconds / 1e9) / peak
                row["clone_fraction_of_peak_bandwidth"] = (2 * nbytes / clone_s / 1e9) / peak
            rows.append(row)
    return {
        "benchmark": "quant_kernels",
        **provenance(device, None, {"shapes": [list(r["shape"]) for r in rows]}),
        "device": str(device),
        "threads": torch.get_num_threads(),
        "cpu_native": device.type == "cpu" and cpu_native.available(),
        "cpu_table_path": device.type == "cpu" and cpu_native.table_path(),
        "torch": torch.__version__,
        "repeats": repeats,
        "results": rows,
    }


def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS[,ROWSxCOLS...], got {text!r}")
    return shapes


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/NAME.json, print the table."""
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.quant_kernels",
        description=__doc__,
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--kernel", default=None, choices=["torch", "triton"], help="default: triton on cuda if installed, else torch"
    )
    parser.add_argument(
        "--shapes",
        type=_shapes,
        default="8192x8192,4096x1024,1024x2816",
        metavar="RxC,...",
        help="weight shapes to quantize (default: %(default)s)",
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="best of this many runs (default: 3)")
    add_output_arguments(parser, default_name="quant_kernels_<device>", checkpoint=False)
    args = parser.parse_args(argv)

    result = run(args.device, args.shapes, args.repeats, args.kernel)
    path = write_json(result, args.out_dir, args.name or f"quant_kernels_{args.device}")
    print(quant_kernels_table(result))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
