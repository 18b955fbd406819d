"""Weight sync from an RL trainer into a live FP8 engine, on one CPU machine.

    python examples/rl_weight_sync.py [--cache-dir DIR] [--tokens N] [--timeout SECONDS]

Two processes, as in an RL system:

* the trainer (a child process, rank 0 of a weight-sync group of its own) holds the model in
  transformers, takes one optimizer step, and broadcasts the new weights: Hugging Face names, BF16
  (checkpoint format), packed into buckets;
* the engine (this process, rank 1) holds layerwise's FP8 ``Engine``, generates, receives the update
  (re-quantized layer by layer into the same kernel tensors: captured CUDA graphs would stay valid),
  and generates again.

Backend "nccl" runs gloo on CPU (NCCL on CUDA); the group meets at 127.0.0.1 on a free port. Every
wait is bounded by --timeout. The same demo, packaged: ``layerwise sync-demo``. Needs transformers
(``pip install -e '.[bench]'``). The checkpoint is layerwise's demo model (random BF16 Qwen3, 8 layers,
52 MiB, generated locally on first use).
"""

import argparse
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

from layerwise import LayerwiseError, load_model
from layerwise.demo import demo_checkpoint
from layerwise.engine import Engine
from layerwise.optional import import_optional
from layerwise.sampling_params import SamplingParams
from layerwise.sync_demo import (
    PROMPT,
    TRAIN_SEQUENCE,
    free_port,
    kernel_pointers,
    quiet_import_notices,
    same_tensors,
    stop_process,
    train_one_step,
    update_nbytes,
    wait_for,
    write_sent_weights,
)
from layerwise.transfer import tensor_metadata
from layerwise.transfer.nccl import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

PACKING = {"packed": True, "packed_buffer_size_bytes": 8 << 20, "packed_num_buffers": 2}  # 8 MiB, double-buffered


def trainer(checkpoint: str, init_info: dict, replies, commands, check_dir: str) -> None:
    """The trainer process: one optimizer step, then send the new weights to the engine."""
    quiet_import_notices()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # float32 master weights, as mixed-precision trainers keep them (AdamW's small steps and moments stay
    # exact from step to step); the engine receives a BF16 copy: the checkpoint's dtype, half the bytes.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    train_one_step(model, TRAIN_SEQUENCE, lr=3e-3)  # AdamW on a language-modeling loss: a stand-in RL step

    # What is sent: (Hugging Face name, BF16 tensor) pairs, in this order. A tied lm_head is listed once.
    weights = [(name, p.detach().to(torch.bfloat16)) for name, p in model.named_parameters()]

    # 1. Announce the update (names, dtypes, shapes, packing) over your own control plane: here a queue;
    #    in an RL system, the request that makes the engine call update_weights.
    update_info = dict(tensor_metadata(weights), is_checkpoint_format=True, **PACKING)
    replies.put(("update", {"update_info": update_info}))

    # 2. Host the group as rank 0 (the engine joins as rank 1) and broadcast the weights.
    group = NCCLWeightTransferEngine.trainer_init(init_info, device="cpu")
    NCCLWeightTransferEngine.trainer_send_weights(iter(weights), NCCLTrainerSendWeightsArgs(group=group, **PACKING))

    # For this demo's check only: write what was sent, so the engine can compare itself with a fresh load.
    write_sent_weights(weights, checkpoint, check_dir)
    replies.put(("sent", None))
    commands.get(timeout=init_info["timeout_seconds"])  # "exit": the engine is done with the group
    group.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default=None, help="where the demo checkpoint is written")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens before and after the update")
    parser.add_argument("--timeout", type=float, default=60.0, help="bound on every wait, in seconds")
    args = parser.parse_args()
    try:
        import_optional("transformers", extra="bench", purpose="examples/rl_weight_sync.py")  # for the trainer
    except LayerwiseError as e:
        print(f"rl_weight_sync: error: {e}", file=sys.stderr)
        return 1

    # The engine: the FP8 model, a static KV cache, greedy decoding.
    checkpoint = demo_checkpoint(args.cache_dir)
    engine = Engine.from_pretrained(
        checkpoint, max_batch_size=1, max_seq_len=len(PROMPT) + args.tokens, quantization="fp8"
    )
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    tokens_before = engine.generate([PROMPT], greedy)[0].outputs[0].token_ids
    pointers = kernel_pointers(engine.model)  # every kernel tensor's (object, data_ptr) before the update

    # The weight-sync group: the trainer (rank 0) hosts it on a free port; the engine is rank 1.
    init_info = {
        "master_address": "127.0.0.1",
        "master_port": free_port(),
        "rank_offset": 1,
        "world_size": 2,
        "timeout_seconds": args.timeout,
    }
    ctx = mp.get_context("spawn")
    replies, commands = ctx.Queue(), ctx.Queue()
    with tempfile.TemporaryDirectory() as check_dir:
        process = ctx.Process(
            target=trainer, args=(str(checkpoint), init_info, replies, commands, check_dir), daemon=True
        )
        process.start()
        try:
            request = wait_for(replies, process, "update", args.timeout)  # the trainer's update info
            engine.init_weight_transfer_engine("nccl", init_info)  # join the group (gloo on CPU)
            start = time.perf_counter()
            report = engine.update_weights(request, atomic=True)  # receive, re-quantize in place
            update_seconds = time.perf_counter() - start
            wait_for(replies, process, "sent", args.timeout)
            commands.put("exit")
        except LayerwiseError as e:  # the trainer died or stalled: one line, exit code 1
            print(f"rl_weight_sync: error: {e}", file=sys.stderr)
            stop_process(process, 1.0)
            return 1
        finally:
            engine.shutdown_weight_transfer()
            stop_process(process, args.timeout)

        tokens_after = engine.generate([PROMPT], greedy)[0].outputs[0].token_ids
        now = kernel_pointers(engine.model)
        kept = sum(now.get(name) == pointer for name, pointer in pointers.items())
        equal = same_tensors(engine.model, load_model(check_dir, quantization="fp8"))

    print(f"tokens before the update: {tokens_before}")
    print(f"tokens after the update:  {tokens_after}")
    print(f"tokens changed: {tokens_after != tokens_before}")
    print(f"update time: {update_seconds:.3f} s")
    print(f"bytes sent: {update_nbytes(request['update_info'])} (BF16, packed)")
    print(f"modules updated: {len(report.updated_modules)} ({len(report.updated_decoder_layers)} decoder layers)")
    print(f"every data_ptr kept: {kept == len(pointers)} ({kept}/{len(pointers)} kernel tensors)")
    print(f"engine == fresh load of the sent weights: {equal}")
    return 0 if tokens_after != tokens_before and kept == len(pointers) and equal else 1


if __name__ == "__main__":
    sys.exit(main())
