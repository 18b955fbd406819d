"""Tensor-parallel load: per-rank peak bytes, bytes read from disk and load time at tp = 1, 2, 4.

Every tp size runs in its own set of processes (torch.multiprocessing spawn; gloo on 127.0.0.1 on CPU,
one thread per process), each rank loading the benchmark checkpoint with
``load_model_with_report(path, quantization, tp_group=group, global_scales=True)``: an untimed warm-up
load (imports, the one-time compile), then the measured load under the live-storage tracker. Per rank:
``bytes_read`` (checkpoint bytes this rank read), ``model_bytes``, ``peak_bytes``, ``seconds``; the JSON
also gives each rank's share of the TP=1 model and the largest decoder layer's bytes divided by tp.

    python -m layerwise.benchmarks.tp_load [--size default|small] [--tp 1,2,4] [--quantization fp8]

``--moe``: the Qwen3-30B-A3B-shaped mixture-of-experts checkpoint of ``layerwise.benchmarks.moe_load`` (128
experts, top-8; ``--size`` one of its sizes, default "cpu", ``--layers`` decoder layers), loaded in each layout of
``--layouts`` (tp: every expert's intermediate dimension sharded; ep: whole experts per rank, ``expert_parallel=True``)
at each tp size (default 1,2; at tp=1 the layouts coincide and run once); ``seconds`` comes from a third load,
without the memory tracker (on CPU its dispatch mode costs Python work per tensor operation, several times the load
of a checkpoint of many small experts: ``tracked_seconds``). NCCL with rank r on cuda:r when there are
as many GPUs as the largest tp size, else gloo on the CPU. Per rank besides the above: ``largest_unit_bytes`` and two
targets, ``bytes_read / checkpoint_bytes <= 1/tp + replicated share`` (the bytes every rank reads whole, from the
checkpoint's tensor shapes: norms, routers, and the k/v projections' one head per rank when tp exceeds the kv heads)
and ``peak_bytes - model_bytes <= one expert unit (an expert's w13 on this rank, in BF16) + the FP8 work buffer``
(``largest_unit_bytes``, which may be the embedding's or an attention unit, beside it). Written to
tp_load_moe_<device>.json.

    python -m layerwise.benchmarks.tp_load --moe [--size cpu] [--layers 8] [--tp 1,2] [--layouts tp,ep]
"""

from __future__ import annotations

import argparse
import datetime
import math
import queue
import socket
from pathlib import Path

from layerwise.benchmarks import moe_load
from layerwise.benchmarks.checkpoints import SIZES, make_checkpoint
from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import RESULTS_NOTE, add_output_arguments, default_cache_dir, require, write_json
from layerwise.kernels.reference import CHUNK_NUMEL

WAIT_SECONDS = 600.0  # bound on every wait for a rank's result
LAYOUTS = {"tp": False, "ep": True}  # --layouts name -> load_model's expert_parallel
#: the online FP8 quantization's float32 work buffer (CHUNK_NUMEL float32 elements), the most a load holds on the
#: device besides the model and one unit in the checkpoint dtype (LoadReport.largest_unit_bytes)
WORK_BUFFER_BYTES = CHUNK_NUMEL * 4
MOE_LAYERS = 8  # --moe default: 8 of moe_load's "cpu" layers (646 MB of BF16) load in about a second per rank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    rank: int,
    size: int,
    port: int,
    path: str,
    quantization: str,
    expert_parallel: bool,
    device: str,
    untracked_seconds: bool,
    results,
) -> None:
    import torch
    import torch.distributed as dist

    from layerwise.api import load_model_with_report

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if device == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=WAIT_SECONDS),
    )
    try:
        group = dist.new_group(list(range(size))) if size > 1 else None
        kwargs = dict(tp_group=group, global_scales=True, expert_parallel=expert_parallel)
        if device == "cuda":
            kwargs["device"] = f"cuda:{rank}"
        load_model_with_report(path, quantization, **kwargs)  # warm-up
        _, report = load_model_with_report(path, quantization, **kwargs)
        keys = ("bytes_read", "model_bytes", "peak_bytes", "seconds", "checkpoint_bytes", "largest_unit_bytes")
        row = {k: getattr(report, k) for k in keys}
        row["largest_layer_checkpoint_bytes"] = report.largest_layer_checkpoint_bytes  # unsharded
        if untracked_seconds:  # the CPU tracker's Python work per tensor operation is left out of the time
            row["tracked_seconds"] = row["seconds"]
            row["seconds"] = load_model_with_report(path, quantization, **kwargs, track_memory=False)[1].seconds
        results.put((rank, row))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_tp(
    path: Path,
    size: int,
    quantization: str,
    expert_parallel: bool = False,
    device: str = "cpu",
    untracked_seconds: bool = False,
) -> list[dict]:
    """Load ``path`` on ``size`` ranks; returns one dict per rank (bytes, seconds).

    Args:
        expert_parallel: mixture-of-experts layers hold whole experts per rank (``load_model``'s argument).
        device: "cpu" (gloo) or "cuda" (NCCL, rank r on cuda:r; needs ``size`` GPUs).
        untracked_seconds: ``seconds`` from a third load without the memory tracker (the tracked load's time
            becomes ``tracked_seconds``); False: the tracked load's.
    Raises:
        TimeoutError: a rank sent nothing within WAIT_SECONDS (it died or hung).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = (size, port, str(path), quantization, expert_parallel, device, untracked_seconds, results)
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


def read_target(path: Path, tp: int) -> dict:
    """What one of ``tp`` ranks may read of the checkpoint at ``path``, from its tensor shapes (bytes).

    The parts every rank reads whole (the dense tensor-parallel rule, for either MoE layout): norms, routers
    (``mlp.gate.weight``) and, when ``tp`` exceeds the kv heads, one kv head of k_proj / v_proj each. Every other
    tensor (attention, dense MLP, embeddings, every expert) is split ``tp`` ways: by rows or columns, or by experts.

    Returns:
        {"checkpoint_bytes", "replicated_bytes" (read whole by each rank), "sharded_bytes" (the rest, unsharded),
        "expected_bytes_read" (sharded / tp + replicated: what a rank reads when the vocabulary splits evenly),
        "target_fraction" (1/tp + replicated / checkpoint: the bound of bytes_read / checkpoint_bytes)}.
    """
    from layerwise.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    try:
        kv_heads = int(ckpt.config["num_key_value_heads"])
        sizes = {key: info.nbytes for key, info in ckpt.tensors.items()}
    finally:
        ckpt.close()
    replicated = sharded = 0
    for key, nbytes in sizes.items():
        if key.endswith("norm.weight") or key.endswith(".mlp.gate.weight"):  # norms, routers
            replicated += nbytes
        elif tp > kv_heads and key.endswith((".k_proj.weight", ".v_proj.weight")):  # one kv head per rank
            replicated += nbytes // kv_heads
        else:
            sharded += nbytes
    total = sum(sizes.values())
    return {
        "checkpoint_bytes": total,
        "replicated_bytes": replicated,
        "sharded_bytes": sharded,
        "expected_bytes_read": math.ceil(sharded / tp) + replicated,
        "target_fraction": 1 / tp + replicated / total,
    }


def expert_unit_bytes(path: Path, tp: int, expert_parallel: bool) -> int:
    """Checkpoint-dtype bytes of one expert's fused gate + up (w13) on one rank: the MoE layer's processing unit
    (bytes; the intermediate dimension split ``tp`` ways unless ``expert_parallel``)."""
    from layerwise.checkpoint import Checkpoint

    ckpt = Checkpoint(path)
    try:
        gate = next(info for key, info in ckpt.tensors.items() if key.endswith((".0.gate_proj.weight", ".0.w1.weight")))
    finally:
        ckpt.close()
    return 2 * gate.nbytes // (1 if expert_parallel else tp)


def moe_runs(path: Path, sizes: list[int], layouts: list[str], quantization: str, device: str) -> list[dict]:
    """Every (tp size, layout) load of the MoE checkpoint at ``path`` (tp=1 once: the layouts coincide), with each
    rank's bytes-read and peak targets; returns one dict per run (bytes, seconds)."""
    runs = []
    for size in sizes:
        target = read_target(path, size)
        for layout in layouts if size > 1 else layouts[:1]:
            expert_parallel = LAYOUTS[layout] and size > 1
            ranks = run_tp(path, size, quantization, expert_parallel, device, untracked_seconds=True)
            unit = expert_unit_bytes(path, size, expert_parallel)
            for r in ranks:
                r["bytes_read_fraction"] = r["bytes_read"] / r["checkpoint_bytes"]
                r["meets_read_target"] = r["bytes_read_fraction"] <= target["target_fraction"]
                r["peak_minus_model_bytes"] = r["peak_bytes"] - r["model_bytes"]
                r["peak_minus_model_over_largest_unit"] = r["peak_minus_model_bytes"] / r["largest_unit_bytes"]
                r["peak_target_bytes"] = unit + WORK_BUFFER_BYTES
                r["meets_peak_target"] = r["peak_minus_model_bytes"] <= r["peak_target_bytes"]
            run = {
                "tp": size,
                "layout": layout if size > 1 else "single",
                "expert_parallel": expert_parallel,
                "read_target": target,
                "expert_unit_bytes": unit,
                "slowest_rank_seconds": max(r["seconds"] for r in ranks),
                "ranks": ranks,
            }
            runs.append(run)
            print(
                f"tp={size} {run['layout']}: bytes read / checkpoint "
                f"{[round(r['bytes_read_fraction'], 4) for r in ranks]}"
                f" (target <= {target['target_fraction']:.4f}), peak - model "
                f"{max(r['peak_minus_model_bytes'] for r in ranks):,} B (target: one expert unit + work buffer "
                f"{unit + WORK_BUFFER_BYTES:,} B; largest unit {max(r['largest_unit_bytes'] for r in ranks):,} B), "
                f"load {run['slowest_rank_seconds']:.2f} s (slowest rank)"
            )
    return runs


def _moe_main(args) -> int:
    import torch

    size = args.size or "cpu"
    if size not in moe_load.SIZES:
        raise SystemExit(f"--moe --size must be one of {sorted(moe_load.SIZES)}, got {size!r}")
    layouts = [name.strip() for name in args.layouts.split(",")]
    if not layouts or any(name not in LAYOUTS for name in layouts):
        raise SystemExit(f"--layouts takes a comma-separated subset of {sorted(LAYOUTS)}, got {args.layouts!r}")
    sizes = [int(t) for t in (args.tp or "1,2").split(",")]
    device = "cuda" if torch.cuda.device_count() >= max(sizes) else "cpu"  # NCCL on as many GPUs, else gloo
    layers = args.layers if args.layers is not None else MOE_LAYERS
    path = moe_load.make_checkpoint(size, args.cache_dir or default_cache_dir(), num_hidden_layers=layers)
    runs = moe_runs(path, sizes, layouts, args.quantization, device)
    experts = dict(num_experts=moe_load.NUM_EXPERTS, num_experts_per_tok=moe_load.TOP_K)
    shape = dict(moe_load.SIZES[size], num_hidden_layers=layers, **experts)
    result = {
        "benchmark": "tp_load_moe",
        **provenance(device, size, shape),
        "device": device,
        "backend": "nccl" if device == "cuda" else "gloo",
        "machine": describe_machine(device),
        "checkpoint": {"size": size, **shape, "checkpoint_bytes": runs[0]["read_target"]["checkpoint_bytes"]},
        "quantization": args.quantization,
        "global_scales": True,
        "layouts": layouts,
        "work_buffer_bytes": WORK_BUFFER_BYTES,
        "results": runs,
    }
    out = write_json(result, args.out_dir, args.name or f"tp_load_moe_{device}")
    print(f"results written to {out}")
    return 0


def main(argv=None) -> int:
    """Run the benchmark; returns the exit status (writes JSON to --out-dir)."""
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.tp_load",
        description=__doc__,
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--size",
        choices=sorted(set(SIZES) | set(moe_load.SIZES)),
        default=None,
        help="checkpoint size (default: default; with --moe, one of moe_load's sizes, default cpu)",
    )
    parser.add_argument("--tp", default=None, help="comma-separated tensor-parallel sizes (default 1,2,4; --moe: 1,2)")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts checkpoint, in each of --layouts")
    parser.add_argument("--layouts", default="tp,ep", help="--moe: comma-separated MoE layouts, tp and/or ep")
    parser.add_argument(
        "--layers", type=int, default=None, help=f"--moe: decoder layers of the checkpoint (default {MOE_LAYERS})"
    )
    add_output_arguments(parser, "tp_load_cpu_<size>; --moe: tp_load_moe_<device>")
    args = parser.parse_args(argv)
    require(["transformers"])
    if args.moe:
        return _moe_main(args)
    size_name = args.size or "default"
    if size_name not in SIZES:
        raise SystemExit(f"--size must be one of {sorted(SIZES)} (without --moe), got {size_name!r}")
    args.size = size_name
    sizes = [int(t) for t in (args.tp or "1,2,4").split(",")]
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
