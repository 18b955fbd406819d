"""Where the first FP8 load in a fresh process spends its one-time cost: a cProfile of that load.

On the H100 the first load of the 8B shape took 0.8-1.3 s longer than the second (issue 14's first-load
target is 1.5x the floor; the second load is near 1.0x). This runs, in a fresh process, one load of
``--scheme`` under cProfile, then an unprofiled second load, and records the profile three ways: own
(exclusive) time summed per package (triton, torch, safetensors, layerwise, ...), and the functions with the
most cumulative and the most own time. cProfile slows Python-heavy code, so read shares, not seconds.

    python -m layerwise.benchmarks.first_load_profile [--size 8b] [--device cuda] [--scheme fp8-per-channel]

Writes DIR/first_load_profile_<device>_<size>.json and prints the per-package table.
"""

from __future__ import annotations

import gc
import re
import sys
import time

import torch

from layerwise.benchmarks.checkpoints import make_checkpoint
from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import provenance
from layerwise.benchmarks.options import (
    add_output_arguments,
    benchmark_parser,
    default_cache_dir,
    positive_int,
    write_json,
)
from layerwise.benchmarks.workers import run_worker

TOP = 25


def package_of(filename: str) -> str:
    """The package a profiled function belongs to: the first folder after site-packages / dist-packages, the
    layerwise package for this checkout's sources, "builtins" for C functions ("~" or "<built-in>")."""
    if filename in ("~", "") or filename.startswith("<"):
        return "builtins"
    match = re.search(r"[/\\](?:site|dist)-packages[/\\]([^/\\]+)", filename)
    if match:
        return match.group(1).removesuffix(".py")
    if re.search(r"[/\\](layerwise|kernels|quant|benchmarks)[/\\]", filename):
        return "layerwise"
    match = re.search(r"[/\\]python3\.\d+[/\\]([^/\\]+)", filename)
    return f"stdlib:{match.group(1).removesuffix('.py')}" if match else "other"


def _label(func: tuple) -> str:
    filename, line, name = func
    parts = filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{line}({name})" if filename not in ("~", "") else name


def summarize(stats, top: int = TOP) -> dict:
    """Own seconds per package and the ``top`` functions by cumulative and by own seconds of a pstats.Stats."""
    rows = [(func, calls, own, cum) for func, (_, calls, own, cum, _) in stats.stats.items()]
    packages: dict[str, float] = {}
    for func, _, own, _ in rows:
        package = package_of(func[0])
        packages[package] = packages.get(package, 0.0) + own
    entry = lambda r: {"function": _label(r[0]), "calls": r[1], "own_seconds": r[2], "cumulative_seconds": r[3]}
    return {
        "own_seconds_by_package": dict(sorted(packages.items(), key=lambda kv: -kv[1])),
        "cumulative": [entry(r) for r in sorted(rows, key=lambda r: -r[3])[:top]],
        "own": [entry(r) for r in sorted(rows, key=lambda r: -r[2])[:top]],
    }


def worker(path: str, device: str, scheme: str, top: int = TOP):
    """Yields one row: the profiled first load and the unprofiled second load of ``path`` (fresh process)."""
    import cProfile
    import pstats

    import layerwise
    import layerwise.api  # noqa: F401  (layerwise imports its API at first use: import it here, not in the profile)

    device = torch.device(device)

    def load():
        start = time.perf_counter()
        model = layerwise.load_model(path, quantization=scheme, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return model, time.perf_counter() - start

    if device.type == "cuda":
        torch.empty(1, device=device)  # the CUDA context: not a load cost (as in peak_memory)
    profile = cProfile.Profile()
    profile.enable()
    model, first = load()
    profile.disable()
    del model
    gc.collect()
    model, second = load()
    yield {
        "scheme": scheme,
        "first_profiled_seconds": first,
        "second_seconds": second,
        **summarize(pstats.Stats(profile), top),
    }


def run(size: str, device: str, cache, scheme: str, timeout: float | None = None) -> dict:
    """Profile the first load of the ``size`` checkpoint in a fresh process; the result main writes as JSON."""
    path = make_checkpoint(size, cache, device=device, verbose=True)
    out = run_worker("first_load_profile", "worker", dict(path=str(path), device=device, scheme=scheme), timeout)
    return {
        "benchmark": "first_load_profile",
        **provenance(device, size, checkpoint_shape(size)),
        "rows": out.rows,
        "error": out.error,
    }


def main(argv=None) -> int:
    """Parse ``argv``, profile, write DIR/NAME.json, print own seconds per package."""
    parser = benchmark_parser("python -m layerwise.benchmarks.first_load_profile", __doc__)
    parser.add_argument("--scheme", default="fp8-per-channel", help="quantization scheme (default: fp8-per-channel)")
    parser.add_argument("--timeout", type=positive_int, default=None, metavar="S", help="seconds the run may take")
    add_output_arguments(parser, default_name="first_load_profile_<device>_<size>")
    args = parser.parse_args(argv)
    result = run(args.size, args.device, args.cache_dir or default_cache_dir(), args.scheme, args.timeout)
    path = write_json(result, args.out_dir, args.name or f"first_load_profile_{args.device}_{args.size}")
    for row in result["rows"]:
        print(f"first load (profiled) {row['first_profiled_seconds']:.2f} s, second {row['second_seconds']:.2f} s")
        for package, seconds in list(row["own_seconds_by_package"].items())[:12]:
            print(f"  {package:<28}{seconds:8.3f} s own")
    if result["error"]:
        print(f"did not finish: {result['error']}", file=sys.stderr)
    print(f"written to {path}")
    return 0 if result["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
