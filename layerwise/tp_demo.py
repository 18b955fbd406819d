"""Tensor-parallel greedy generation under torchrun: every rank loads its shard, rank 0 prints the tokens.

    torchrun --nproc-per-node 2 -m layerwise.tp_demo [--checkpoint DIR | --moe] [--expert-parallel]
        [--quantization fp8] [--compare]

Process group from torchrun's environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE): NCCL when CUDA is
available (each rank on cuda:LOCAL_RANK), gloo on CPU. The model is sharded over an explicit group of all
ranks (``load_model(..., tp_group=group, global_scales=True)``) and wrapped in an :class:`Engine`; every rank
runs the same generate call. ``--compare``: rank 0 also loads the checkpoint without tensor parallelism and
prints whether its greedy tokens are the same. Default checkpoint: the embedded demo model
(``layerwise.demo``), written by rank 0 on first use; ``--moe``: the embedded mixture-of-experts demo model
(Qwen3-MoE, 8 experts, top-2). ``--expert-parallel``: mixture-of-experts layers hold whole experts per rank instead
of every expert's intermediate slice (``load_model(..., expert_parallel=True)``).
"""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from layerwise.api import load_model, load_model_with_report
from layerwise.engine import Engine
from layerwise.sampling_params import SamplingParams


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m layerwise.tp_demo")
    parser.add_argument("--checkpoint", help="checkpoint directory (default: the embedded demo model)")
    parser.add_argument("--moe", action="store_true", help="the embedded mixture-of-experts demo model")
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="MoE layers: rank r holds experts [r*E/N, (r+1)*E/N) whole (default: every expert's intermediate slice)",
    )
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--dtype", default="float32", help="compute dtype (float32: the same tokens as TP=1)")
    parser.add_argument("--prompt", default="1,17,42,7", help="comma-separated token ids")
    parser.add_argument("--tokens", type=int, default=16, help="new tokens to generate")
    parser.add_argument("--compare", action="store_true", help="rank 0 also runs the single-process model")
    args = parser.parse_args(argv)
    if args.moe and args.checkpoint:
        parser.error("--moe and --checkpoint exclude each other")

    cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(world)))
    try:
        path = args.checkpoint
        if path is None:
            from layerwise.demo import demo_checkpoint, demo_moe_checkpoint

            make = demo_moe_checkpoint if args.moe else demo_checkpoint
            if rank == 0:
                make()  # written once, before the other ranks read it
            dist.barrier()
            path = make()
        prompt = [int(t) for t in args.prompt.split(",")]
        model, report = load_model_with_report(
            path,
            quantization=args.quantization,
            device=device,
            dtype=args.dtype,
            tp_group=group,
            global_scales=True,
            track_memory=False,
            expert_parallel=args.expert_parallel,
        )
        greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
        engine = Engine(model, max_batch_size=1, max_seq_len=len(prompt) + args.tokens)
        tokens = [out.outputs[0].token_ids for out in engine.generate([prompt], greedy)]
        reads = [None] * world
        dist.all_gather_object(reads, report.bytes_read, group=group)
        if rank == 0:
            layout = " (expert parallel)" if args.expert_parallel else ""
            print(f"tp={world}{layout} {args.quantization} tokens: {tokens[0]}")
            print(f"bytes read per rank: {reads} (checkpoint: {report.checkpoint_bytes})")
            if args.compare:
                single = load_model(path, quantization=args.quantization, device=device, dtype=args.dtype)
                reference = Engine(single, max_batch_size=1, max_seq_len=len(prompt) + args.tokens)
                expected = [out.outputs[0].token_ids for out in reference.generate([prompt], greedy)]
                print(f"tp=1 {args.quantization} tokens: {expected[0]}")
                print(f"same: {tokens == expected}")
        dist.barrier(group=group)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
