"""The CPU FP8 W8A16 linear: the native fused GEMM against BF16 ``F.linear`` and the dequantize + ``F.linear`` path.

For each weight shape [N, K] (default: SmolLM-135M's qkv 960x576, o 576x576, gate_up 3072x576 and down 576x1536)
and each number of rows M of x (default 1, 8, 64, 512), the wall time of one call of:

* ``bf16``: ``F.linear(x, w)`` with x and w in bfloat16 (the unquantized model's forward);
* ``dequantize``: ``F.linear(x, dequantize(q, scale, bfloat16))``, the FP8 forward before the fused kernel;
* ``fused``: ``cpu_native.linear_fp8(x, q, scale)`` (bfloat16 x and y).

Each per tensor, per channel and per 128 x 128 block (the FP8 rows). ``speed_vs_bf16`` = bf16 seconds / fused
seconds (above 1: the FP8 forward is faster than BF16), ``speed_vs_dequantize`` = dequantize seconds / fused seconds.
Times are the fastest of ``--repeats`` samples, each the mean of enough calls to last a few milliseconds.

    python -m layerwise.benchmarks.cpu_gemm [--ms 1,8,64,512] [--shapes qkv=960x576,...] [--threads T]
        [--repeats R] [--out-dir DIR] [--name NAME]

Writes DIR/<name>.json (default cpu_gemm_cpu) and prints the table.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
import torch.nn.functional as F

from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import RESULTS_NOTE, add_output_arguments, positive_int, write_json
from layerwise.kernels import GRANULARITIES, cpu_native, reference

# SmolLM-135M: hidden 576, intermediate 1536, 9 query heads and 3 key/value heads of 64
SMOLLM_135M = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
MIN_SAMPLE_SECONDS = 2e-3


def seconds(fn, repeats: int) -> float:
    """Fastest of ``repeats`` samples of the mean time of one call of ``fn`` (each sample at least
    ``MIN_SAMPLE_SECONDS``, after one warm-up call)."""
    fn()
    start = time.perf_counter()
    fn()
    calls = max(1, int(MIN_SAMPLE_SECONDS / max(time.perf_counter() - start, 1e-7)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def _fp8_weight(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scale) of a float32 weight, with torch's own ops."""
    amax = reference.amax(w, granularity)
    scale = reference.scale_from_amax(amax)
    return reference.quantize(w, scale), scale


def _dequantize_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The FP8 forward on CPU before the fused kernel: the whole weight dequantized to x's dtype, then F.linear."""
    return F.linear(x, reference.dequantize(q, scale, x.dtype))


def _load_average() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def run(shapes: dict[str, tuple[int, int]], ms: list[int], repeats: int) -> dict:
    """Time BF16 ``F.linear``, dequantize + ``F.linear`` and the fused kernel for every shape, M and scale layout;
    returns the result that :func:`main` writes as JSON.

    Raises:
        RuntimeError: the native extension is not built (nothing to measure).
    """
    if not cpu_native.available():
        raise RuntimeError("the _cpu_fp8 extension is not built: pip install -e . (needs a C compiler)")
    rows = []
    load_before = _load_average()
    g = torch.Generator().manual_seed(0)
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=g) * 0.05
        w_bf16 = w.to(torch.bfloat16)
        weights = {granularity: _fp8_weight(w, granularity) for granularity in GRANULARITIES}
        for m in ms:
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            bf16_s = seconds(functools.partial(F.linear, x, w_bf16), repeats)
            for granularity, (q, scale) in weights.items():
                old_s = seconds(functools.partial(_dequantize_linear, x, q, scale), repeats)
                fused_s = seconds(functools.partial(cpu_native.linear_fp8, x, q, scale), repeats)
                rows.append(
                    {
                        "layer": name,
                        "n": n,
                        "k": k,
                        "m": m,
                        "scheme": f"fp8-per-{granularity}",
                        "bf16_seconds": bf16_s,
                        "dequantize_seconds": old_s,
                        "fused_seconds": fused_s,
                        "speed_vs_bf16": bf16_s / fused_s,
                        "speed_vs_dequantize": old_s / fused_s,
                        "fused_gflops": 2 * m * n * k / fused_s / 1e9,
                    }
                )
    return {
        "benchmark": "cpu_gemm",
        **provenance("cpu", None, {"shapes": {k: list(v) for k, v in shapes.items()}, "m": ms}),
        "machine": describe_machine("cpu"),
        "gemm_path": cpu_native.gemm_path(),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        # other processes on the machine slow both sides unevenly: the 1-minute load average before and after
        "load_average": [load_before, _load_average()],
        "results": rows,
    }


def table(result: dict) -> str:
    """The results as a Markdown table: microseconds per call and the fused kernel's speed relative to each."""
    lines = [
        f"CPU W8A16 linear, bfloat16 x, {result['threads']} threads, {result['gemm_path']} kernels "
        f"({result['device_name']})",
        "",
        "| layer (N x K) | M | scheme | BF16 us | dequantize us | fused us | fused vs BF16 | fused vs dequantize |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        lines.append(
            f"| {r['layer']} ({r['n']}x{r['k']}) | {r['m']} | {r['scheme']} | {r['bf16_seconds'] * 1e6:.0f} | "
            f"{r['dequantize_seconds'] * 1e6:.0f} | {r['fused_seconds'] * 1e6:.0f} | {r['speed_vs_bf16']:.2f}x | "
            f"{r['speed_vs_dequantize']:.1f}x |"
        )
    return "\n".join(lines)


def _shapes(text: str) -> dict[str, tuple[int, int]]:
    out = {}
    try:
        for item in text.split(","):
            name, _, dims = item.rpartition("=")
            n, k = (int(d) for d in dims.split("x"))
            out[name or dims] = (n, k)
    except ValueError:
        out = {}
    if not out or any(min(v) < 1 for v in out.values()):
        raise argparse.ArgumentTypeError(f"expected [NAME=]NxK[,...], got {text!r}")
    return out


def _ms(text: str) -> list[int]:
    try:
        ms = [int(t) for t in text.split(",")]
    except ValueError:
        ms = []
    if not ms or min(ms) < 1:
        raise argparse.ArgumentTypeError(f"expected M[,M...] (positive integers), got {text!r}")
    return ms


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/NAME.json, print the table."""
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.cpu_gemm",
        description=__doc__,
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    default_shapes = ",".join(f"{k}={n}x{kk}" for k, (n, kk) in SMOLLM_135M.items())
    parser.add_argument("--shapes", type=_shapes, default=default_shapes, help="weights (default: %(default)s)")
    parser.add_argument("--ms", type=_ms, default="1,8,64,512", help="rows of x (default: %(default)s)")
    parser.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=positive_int, default=7, help="best of this many samples (default: 7)")
    add_output_arguments(parser, default_name="cpu_gemm_cpu", checkpoint=False)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        result = run(args.shapes, args.ms, args.repeats)
    finally:
        torch.set_num_threads(threads)
    path = write_json(result, args.out_dir, args.name or "cpu_gemm_cpu")
    print(table(result))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
