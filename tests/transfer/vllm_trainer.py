"""A trainer written against vLLM's weight-transfer API, with only its imports changed to layerwise's.

It runs in a child process (torch.multiprocessing, spawn) and serves commands from a queue; every call below
is spelled as in vLLM's docs and examples (keyword names, positional NCCLTrainerSendWeightsArgs):

    ("init", (master_address, master_port, world_size))  -> trainer_init with vLLM's three-key dict
    ("send", (tensors, packed, bucket_bytes, cast))        -> trainer_send_weights; post_iter_func records each
                                                              name (and casts to BF16 when ``cast``); replies the names
    ("produce", (tensors, bucket_bytes, num_buffers))      -> packed_broadcast_producer
    ("ipc", (tensors, send_mode))                          -> IPC trainer_send_weights with vLLM's send_mode:
                                                              "http:<url>" or "callable" (each chunk replied as
                                                              ("update", info), answered ("ack" | "error", msg))
Replies ("ok", payload) or ("error", message); each queue wait is bounded.
"""

from __future__ import annotations

import queue

import torch

from tests.transfer.harness import WAIT_SECONDS, Trainer


def trainer_main(commands, replies) -> None:
    from layerwise.transfer.ipc import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine
    from layerwise.transfer.nccl import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine
    from layerwise.transfer.packed_tensor import packed_broadcast_producer

    group = None
    replies.put(("ready", None))
    while True:
        try:
            cmd, payload = commands.get(timeout=600)
        except queue.Empty:
            return
        if cmd == "exit":
            return
        try:
            if cmd == "init":
                address, port, world_size = payload
                group = NCCLWeightTransferEngine.trainer_init(
                    dict(master_address=address, master_port=port, world_size=world_size)
                )
                replies.put(("ok", None))
            elif cmd == "send":
                tensors, packed, bucket_bytes, cast = payload
                seen = []

                def post_iter_func(item, seen=seen, cast=cast):
                    seen.append(item[0])
                    return item[1].to(torch.bfloat16) if cast else item[1]

                # vLLM's field order: group, src, post_iter_func, packed, stream, size, num_buffers
                args = NCCLTrainerSendWeightsArgs(group, 0, post_iter_func, packed, None, bucket_bytes, 2)
                NCCLWeightTransferEngine.trainer_send_weights(iterator=iter(tensors), trainer_args=args)
                replies.put(("ok", seen))
            elif cmd == "produce":
                tensors, bucket_bytes, num_buffers = payload
                packed_broadcast_producer(
                    iterator=iter(tensors),
                    group=group,
                    src=0,
                    post_iter_func=lambda item: item[1],
                    buffer_size_bytes=bucket_bytes,
                    num_buffers=num_buffers,
                )
                replies.put(("ok", None))
            elif cmd == "ipc":
                tensors, send_mode = payload
                if send_mode.startswith("http:"):
                    args = IPCTrainerSendWeightsArgs(send_mode="http", url=send_mode.removeprefix("http:"))
                else:

                    def deliver(info):
                        replies.put(("update", info))
                        kind, message = commands.get(timeout=WAIT_SECONDS)
                        if kind != "ack":
                            raise RuntimeError(f"engine: {message}")

                    args = IPCTrainerSendWeightsArgs(send_mode=deliver)
                IPCWeightTransferEngine.trainer_send_weights(iter(tensors), args)
                replies.put(("ok", None))
            else:
                replies.put(("error", f"unknown command {cmd!r}"))
        except Exception as e:  # noqa: BLE001 -- reported to the test
            replies.put(("error", f"{type(e).__name__}: {e}"))


class VLLMTrainer(Trainer):
    """Handle on the vLLM-style trainer process (spawned, :func:`trainer_main`); ``close()`` ends it within a few
    seconds."""

    def __init__(self):
        super().__init__(main=trainer_main)
