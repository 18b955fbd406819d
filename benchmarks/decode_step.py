"""Decode step latency: FP8 (every scheme and mode) against BF16, through ``layerwise.Engine``.

One decode step of ``--batch`` sequences (one new token each, positions half-way into a static KV cache
of ``--max-seq-len``), captured in a CUDA graph on CUDA (``Engine``'s own capture) and replayed; eager on
CPU. Per configuration: ``--warmup`` steps (the capture, Triton compiles), then ``--steps`` timed steps,
each synchronized; ``ms`` is their median, ``over_bf16`` its ratio to the BF16 model's (scheme "none").
Configurations (scheme, fp8_mode): none; fp8-per-tensor, fp8-per-channel and fp8-per-block each as
w8a8 and w8a16, and fp8-per-block as auto; torchao:Float8WeightOnlyConfig and
torchao:Float8DynamicActivationFloat8WeightConfig.
A configuration the library refuses (e.g. w8a8 for a scheme without it) or that fails is recorded with
its error; the others still run. All run in one fresh process that prints each row as it is measured.

    python -m layerwise.benchmarks.decode_step [--size small|default|0.9b|8b] [--device cpu|cuda]
        [--configs none,fp8-per-tensor/w8a8,...] [--batch 8] [--steps N] [--timeout S] [--out-dir DIR]

Writes DIR/<name>.json (ms per step, ratio to BF16, where it ran) and prints the table. On CUDA (or with
--profile) each row also breaks one eager step's device time down into GEMMs, activation quantization,
attention and the rest, with its largest kernels (``benchmarks/step_profile.py``).
"""

from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

from layerwise.benchmarks.checkpoints import make_checkpoint
from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import (
    add_output_arguments,
    benchmark_parser,
    default_cache_dir,
    positive_int,
    require,
    write_json,
)
from layerwise.benchmarks.readme import decode_table
from layerwise.benchmarks.step_profile import profile_step
from layerwise.benchmarks.timing import times
from layerwise.benchmarks.workers import WorkerResult, run_worker

# "scheme/fp8_mode"; the BF16 model first: every ratio needs it
CONFIGS = [
    "none",
    "fp8-per-tensor/w8a8",
    "fp8-per-channel/w8a8",
    "fp8-per-block/w8a8",
    "fp8-per-block",  # auto: whichever path the library picks for per-block on this device
    "fp8-per-tensor/w8a16",
    "fp8-per-channel/w8a16",
    "fp8-per-block/w8a16",
    "torchao:Float8WeightOnlyConfig",
    "torchao:Float8DynamicActivationFloat8WeightConfig",
]


def parse_config(config: str) -> tuple[str, str]:
    """(scheme, fp8_mode) of "scheme/mode" ("auto" when no mode is given)."""
    scheme, _, mode = config.partition("/")
    return scheme, mode or "auto"


def _step_times(engine, position: int, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps after ``warmup`` untimed ones."""
    tokens = torch.ones(engine.max_batch_size, 1, dtype=torch.long, device=engine.device)
    positions = torch.full((engine.max_batch_size, 1), position, dtype=torch.long, device=engine.device)

    def step():
        engine.decode(tokens, positions)  # the step generate() runs (graph replay on CUDA), under the weights lock

    with torch.inference_mode():
        return times(step, engine.device, warmup + steps)[warmup:]


def worker(
    path: str,
    device: str,
    configs: list[str],
    batch: int,
    max_seq_len: int,
    warmup: int,
    steps: int,
    profile: bool = False,
):
    """Yields one row per configuration: median ms per decode step (or the error that stopped it), and with
    ``profile`` where the step's time goes (``step_profile.profile_step`` of the eager step)."""
    import layerwise
    from layerwise.engine import Engine

    device = torch.device(device)
    bf16_ms = None
    for config in configs:
        scheme, mode = parse_config(config)
        row = {"config": config, "scheme": scheme, "fp8_mode": mode}
        try:
            start = time.perf_counter()
            model = layerwise.load_model(path, quantization=scheme, device=device, fp8_mode=mode)
            row["load_seconds"] = time.perf_counter() - start
            engine = Engine(model, max_batch_size=batch, max_seq_len=max_seq_len)
            seconds = _step_times(engine, max_seq_len // 2, warmup, steps)
            row.update(
                ms=1e3 * statistics.median(seconds),
                min_ms=1e3 * min(seconds),
                steps=steps,
                cuda_graph=engine.use_cuda_graph,
            )
            if scheme == "none":
                bf16_ms = row["ms"]
            if bf16_ms is not None:
                row["over_bf16"] = row["ms"] / bf16_ms
            if profile:  # the captured step run eagerly: the runner's forward over the inputs decode() just set
                with torch.inference_mode(), engine.weight_update_lock():
                    eager = functools.partial(engine.runner._step, batch, max_seq_len)
                    row["profile"] = profile_step(eager, device)
        except Exception as e:  # recorded; the next configuration still runs
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        engine = model = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        yield row


def run(
    size: str,
    device: str,
    cache: Path,
    configs: list[str] | None = None,
    batch: int = 8,
    steps: int = 30,
    warmup: int = 5,
    max_seq_len: int = 256,
    timeout: float | None = None,
    skipped: dict[str, str] | None = None,
    profile: bool | None = None,
) -> dict:
    """Time the decode step of each configuration on the ``size`` checkpoint (generated under ``cache`` if
    needed) in one fresh process cut off after ``timeout`` seconds; returns the result that main writes as
    JSON (``skipped``: configuration -> why it was not run, recorded as such; ``profile``: break each step
    down by kernel category, default on CUDA only)."""
    path = make_checkpoint(size, cache, device=device, verbose=True)
    configs = CONFIGS if configs is None else configs
    skipped = skipped or {}
    todo = [c for c in configs if c not in skipped]
    kwargs = dict(
        path=str(path), device=device, configs=todo, batch=batch, max_seq_len=max_seq_len, warmup=warmup, steps=steps,
        profile=torch.device(device).type == "cuda" if profile is None else profile,
    )  # fmt: skip
    out = run_worker("decode_step", "worker", kwargs, timeout) if todo else WorkerResult()
    rows = out.rows
    done = {r["config"] for r in rows}
    if out.error:
        print(f"  decode_step: did not finish: {out.error}", file=sys.stderr)
        rows += [{"config": c, "error": out.error} for c in todo if c not in done]
    rows += [{"config": c, "error": why} for c, why in skipped.items()]
    shape = checkpoint_shape(size)
    return {
        "benchmark": "decode_step",
        **provenance(device, size, shape),
        "device": device,
        "checkpoint": str(path),
        "batch": batch,
        "max_seq_len": max_seq_len,
        "position": max_seq_len // 2,
        "warmup_steps": warmup,
        "machine": describe_machine(device),
        "results": rows,
    }


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/NAME.json, print the table.

    Raises:
        MissingDependencyError: transformers (config.json of the generated checkpoint) is missing, or
            torchao for a torchao configuration; checked first.
    """
    parser = benchmark_parser("python -m layerwise.benchmarks.decode_step", __doc__)
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), metavar="C1,C2,...", help="scheme[/fp8_mode] list (default: all)"
    )
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per step (default: 8)")
    parser.add_argument("--steps", type=positive_int, default=30, help="timed steps (default: 30)")
    parser.add_argument("--warmup", type=positive_int, default=5, help="untimed steps first (default: 5)")
    parser.add_argument("--max-seq-len", type=positive_int, default=256, help="KV cache length (default: 256)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds the run may take")
    parser.add_argument(
        "--profile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time per kernel category of each step (default: on CUDA)",
    )
    add_output_arguments(parser, default_name="decode_step_<device>_<size>")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    require(
        ["transformers"] + (["torchao"] if any("torchao" in c for c in configs) else []),
        purpose="python -m layerwise.benchmarks.decode_step",
    )
    result = run(
        args.size,
        args.device,
        args.cache_dir or default_cache_dir(),
        configs,
        args.batch,
        args.steps,
        args.warmup,
        args.max_seq_len,
        args.timeout,
        profile=args.profile,
    )
    path = write_json(result, args.out_dir, args.name or f"decode_step_{args.device}_{args.size}")
    print(decode_table(result))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
