"""Hot-reload latency: an in-memory BF16 stream (as from an RL trainer) and a checkpoint on disk,
into a live model of every scheme, against the floor of copying the same BF16 tensors.

floor: ``dst.copy_(src)`` of every stream tensor into preallocated device tensors of the same shapes
(the least any in-place reload must do; on CUDA the host tensors are pinned and the copies
non-blocking: the H2D copy floor). The stream is the same host tensors (pinned on CUDA). Per scheme and
source: the first reload (one-time compiles included), then ``--repeats`` rounds of one floor copy and one
reload, back to back (``rounds``: [floor s, reload s] each). ``over_floor``, the figure the targets are judged
on, is the best reload over the best floor copy of those same rounds. The rounds keep a drift of the machine's
speed out of the ratio (on the shared 2-core CPU VM the floor's best varied from 0.070 to 0.103 s within one
run); the best of each, not a median of per-round ratios, because the noise here only ever adds time, and to
one copy at a time (a floor copy once took 0.36 s between two of 0.13 and 0.20: a median of ratios then read
0.89). ``over_fastest_floor`` divides the best reload by the fastest floor of the whole run instead, the more
pessimistic figure. The floor's destination tensors stay allocated for the whole run (the stream's size again
on the device: 16 GB for the 8b size, beside the live model). Everything runs in one fresh process, which prints
each row as it is measured: a run cut off by ``--timeout`` keeps the rows it finished.

    python -m layerwise.benchmarks.reload_latency [--size small|default|0.9b|8b] [--device cpu|cuda]
        [--schemes none,fp8-per-tensor,...] [--repeats N] [--timeout S] [--out-dir DIR]

Writes DIR/<name>.json (seconds per case and / floor, where it ran) and prints the table.
"""

from __future__ import annotations

import functools
import gc
import sys
from pathlib import Path

import torch

import layerwise
from layerwise.benchmarks.checkpoints import SIZES, checkpoint_bytes, make_checkpoint
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
from layerwise.benchmarks.readme import reload_latency_table
from layerwise.benchmarks.timing import times
from layerwise.benchmarks.workers import WorkerResult, run_worker
from layerwise.checkpoint import Checkpoint

SCHEMES = ["none", "fp8-per-tensor", "fp8-per-channel", "fp8-per-block", "torchao:Float8WeightOnlyConfig"]


def scheme_label(scheme: str) -> str:
    """The scheme as the table names it ("none (bf16)" for the checkpoint dtype)."""
    return "none (bf16)" if scheme == "none" else scheme


def host_stream(path: str, device: torch.device | str) -> list[tuple[str, torch.Tensor]]:
    """Every checkpoint tensor copied into host memory, in checkpoint order: the trainer's BF16 weights, as
    views of one buffer, pinned for a CUDA ``device`` (one pinned allocation of the stream's size; pinning
    tensor by tensor would round each up to a power of two)."""
    device = torch.device(device)
    tensors = list(Checkpoint(path))
    align = 256  # bytes: every view starts aligned, as an allocation would
    offsets, total = [], 0
    for _, t in tensors:
        offsets.append(total)
        total += -(-t.numel() * t.element_size() // align) * align
    buffer = torch.empty(total, dtype=torch.uint8, pin_memory=device.type == "cuda")
    stream = []
    for (k, t), offset in zip(tensors, offsets, strict=True):
        view = buffer[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        stream.append((k, view.copy_(t)))
    return stream


def worker(path: str, device: str, schemes: list[str], repeats: int):
    """Yields the floor row, then per scheme its in-memory-stream row and its from-disk row (seconds)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.empty(1, device=device)
    stream = host_stream(path, device)
    stream_bytes = sum(t.numel() * t.element_size() for _, t in stream)
    dst = {k: torch.empty_like(t, device=device) for k, t in stream}
    floor_copy = functools.partial(_copy_all, dst, stream, device.type == "cuda")
    first, *rest = times(floor_copy, device, repeats + 1)  # the first copy touches dst's pages
    yield {
        "case": "floor: copy_ BF16 tensors",
        "source": "floor",
        "seconds": min(rest),
        "first_seconds": first,
        "gbps": stream_bytes / min(rest) / 1e9,
        "stream_bytes": stream_bytes,
        "pinned": device.type == "cuda",
    }
    for scheme in schemes:
        model = layerwise.load_model(path, quantization=scheme, device=device)
        sources = ((stream, "stream", "in-memory stream"), (path, "dir", "from disk (page cache warm)"))
        for source, weights, what in sources:
            reload = functools.partial(layerwise.reload_weights, model, source)
            (first,) = times(reload, device, 1)
            rounds = []
            for _ in range(repeats):  # a floor copy and a reload back to back: the same moment of the machine
                rounds.append(times(floor_copy, device, 1) + times(reload, device, 1))
            yield {
                "case": f"{scheme_label(scheme)}: {what}",
                "scheme": scheme,
                "source": weights,
                "seconds": min(r for _, r in rounds),
                "first_seconds": first,
                "floor_seconds": min(f for f, _ in rounds),
                "rounds": rounds,
                "over_floor": min(r for _, r in rounds) / min(f for f, _ in rounds),
            }
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _copy_all(dst: dict, stream: list, non_blocking: bool) -> None:
    for k, t in stream:
        dst[k].copy_(t, non_blocking=non_blocking)


def run(
    size: str,
    device: str,
    repeats: int,
    cache: Path,
    schemes: list[str] | None = None,
    timeout: float | None = None,
    skipped: dict[str, str] | None = None,
) -> dict:
    """Reload the ``size`` checkpoint (generated under ``cache`` if needed) into a live model of each scheme,
    in one fresh process cut off after ``timeout`` seconds; returns the result that main writes as JSON
    (seconds, ratios to the floor; ``skipped``: scheme -> why it was not run, recorded as such)."""
    path = make_checkpoint(size, cache, device=device, verbose=True)
    schemes = SCHEMES if schemes is None else schemes
    skipped = skipped or {}
    todo = [s for s in schemes if s not in skipped]
    kwargs = dict(path=str(path), device=device, schemes=todo, repeats=repeats)
    out = run_worker("reload_latency", "worker", kwargs, timeout) if todo else WorkerResult()
    rows = out.rows
    if out.error:
        rows.append({"case": "did not finish", "error": out.error})
        print(f"  reload_latency: did not finish: {out.error}", file=sys.stderr)
    rows += [{"case": f"{scheme_label(s)}: not run", "scheme": s, "error": why} for s, why in skipped.items()]
    shape = checkpoint_shape(size)
    floor = next((r for r in rows if r.get("source") == "floor"), {})
    paired = [r["floor_seconds"] for r in rows if "floor_seconds" in r]
    if floor:  # the pessimistic ratio too: over the fastest floor of the whole run
        fastest = min([floor["seconds"], *paired])
        for r in rows:
            if "over_floor" in r:
                r["over_fastest_floor"] = r["seconds"] / fastest
    return {
        "benchmark": "reload_latency",
        **provenance(device, size, shape),
        "device": str(device),
        "checkpoint": str(path),
        "stream_bytes": floor.get("stream_bytes", checkpoint_bytes(SIZES[size])),
        "repeats": repeats,
        "machine": describe_machine(str(device)),
        "results": rows,
    }


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/NAME.json, print the table.

    Raises:
        MissingDependencyError: transformers (which generates the checkpoint) is missing; checked first.
    """
    parser = benchmark_parser("python -m layerwise.benchmarks.reload_latency", __doc__)
    parser.add_argument(
        "--repeats", type=positive_int, default=3, help="best of this many runs after the first (default: 3)"
    )
    parser.add_argument(
        "--schemes",
        default=",".join(SCHEMES),
        metavar="S1,S2,...",
        help=f"schemes of the live model (default: {','.join(SCHEMES)}; torchao ones need torchao)",
    )
    parser.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds the run may take")
    add_output_arguments(parser, default_name="reload_latency_<device>_<size>")
    args = parser.parse_args(argv)
    schemes = args.schemes.split(",")
    require(
        ["transformers"] + (["torchao"] if any("torchao" in s for s in schemes) else []),
        purpose="python -m layerwise.benchmarks.reload_latency",
    )

    result = run(args.size, args.device, args.repeats, args.cache_dir or default_cache_dir(), schemes, args.timeout)
    path = write_json(result, args.out_dir, args.name or f"reload_latency_{args.device}_{args.size}")
    print(reload_latency_table(result))
    print(f"written to {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
