"""Packing tensors into uint8 buckets: the one layout rule that the sender and the receiver share.

Design after vLLM's ``vllm/distributed/weight_transfer/packed_tensor.py``, with two differences: a
bucket never exceeds its capacity unless it holds a single tensor larger than the capacity (vLLM
overfills the last tensor into the bucket), and every tensor starts at an offset aligned to
``ALIGN_BYTES``, so a ``view(dtype)`` of the bucket's bytes is always legal.

    tensors (in update order)  t0 t1 t2 | t3 | t4 t5      capacity C bytes per bucket
    bucket b                   [t0|pad|t1|pad|t2] [t3] [t4|t5]
    tensor i lives at bytes [offset_i, offset_i + nbytes_i) of its bucket; a tensor > C is alone.

The receiver computes the layout from the update info (names, dtypes, shapes) alone; the sender
computes it from the tensors as it iterates, with the same :class:`BucketLayout`.

``packed_broadcast_producer`` / ``packed_broadcast_consumer`` have vLLM's names and arguments and run the nccl
backend's packed send and receive (``layerwise/transfer/nccl.py``) over a ``WeightTransferGroup``: they work
with each other and with ``NCCLWeightTransferEngine``, not with vLLM's own functions (the layout above, and
the header agreed before each bucket, differ from vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30  # 1 GiB, as vLLM
DEFAULT_PACKED_NUM_BUFFERS = 2  # double buffering, as vLLM
ALIGN_BYTES = 16  # start of every tensor in a bucket: enough for any dtype's view and vector loads


def align_up(n: int, alignment: int = ALIGN_BYTES) -> int:
    """Smallest multiple of ``alignment`` that is >= n."""
    return (n + alignment - 1) // alignment * alignment


@dataclass
class Bucket:
    """One packed transfer: ``entries`` are (tensor index, byte offset, nbytes); ``nbytes`` is the
    bucket's length in bytes (end of its last tensor)."""

    entries: list[tuple[int, int, int]] = field(default_factory=list)
    nbytes: int = 0


class BucketLayout:
    """Assigns each tensor, in order, to a bucket and an offset.

    Args:
        capacity: bytes per bucket; None = unpacked (every tensor is a bucket of its own).
    """

    def __init__(self, capacity: int | None):
        if capacity is not None and capacity <= 0:
            raise ValueError(f"packed_buffer_size_bytes must be positive, got {capacity}")
        self.capacity = capacity
        self.current = Bucket()

    def place(self, index: int, nbytes: int) -> Bucket | None:
        """Place tensor ``index`` of ``nbytes`` bytes; returns the bucket it closed, if any."""
        closed = None
        if self.current.entries:
            offset = align_up(self.current.nbytes)
            if self.capacity is None or offset + nbytes > self.capacity:
                closed, self.current = self.current, Bucket()
        offset = align_up(self.current.nbytes) if self.current.entries else 0
        self.current.entries.append((index, offset, nbytes))
        self.current.nbytes = offset + nbytes
        return closed

    def close(self) -> Bucket | None:
        """The last, partly filled bucket (None if empty)."""
        closed, self.current = self.current, Bucket()
        return closed if closed.entries else None


def plan_buckets(sizes: list[int], capacity: int | None) -> list[Bucket]:
    """Buckets for tensors of ``sizes`` bytes (in order); ``capacity`` None = one tensor per bucket."""
    layout, buckets = BucketLayout(capacity), []
    for i, n in enumerate(sizes):
        closed = layout.place(i, n)
        if closed is not None:
            buckets.append(closed)
    last = layout.close()
    if last is not None:
        buckets.append(last)
    return buckets


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a 1-D uint8 tensor (a view when it is contiguous, else a copy)."""
    t = tensor.detach().contiguous()
    return t.reshape(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def unpack_bucket(
    buffer: torch.Tensor, bucket: Bucket, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]]
) -> list[tuple[str, torch.Tensor]]:
    """(name, view) for each tensor of ``bucket`` in ``buffer`` (uint8 [>= bucket.nbytes]).

    The results are views of ``buffer``: consume or copy them before the buffer is refilled.
    """
    out = []
    for i, offset, nbytes in bucket.entries:
        view = buffer[offset : offset + nbytes].view(dtypes[i]).view(shapes[i])
        out.append((names[i], view))
    return out


def packed_broadcast_producer(
    iterator: Iterator[tuple[str, torch.Tensor]],
    group: Any,
    src: int,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    *,
    verify: bool = False,
) -> None:
    """Trainer side of a packed update, with the name and arguments of vLLM's ``packed_broadcast_producer``.

    ``post_iter_func((name, tensor))`` is called once per item, before that tensor is packed, and the tensor it
    returns is copied into bucket ``b % num_buffers`` (uint8 [<= buffer_size_bytes], the layout of this
    module); bucket b + 1 is packed while bucket b is in flight. This is what
    ``NCCLWeightTransferEngine.trainer_send_weights`` runs with ``packed=True``.

    Args:
        iterator: (name, tensor) pairs in the order of the engines' update info.
        group: the trainer's ``WeightTransferGroup`` (``NCCLWeightTransferEngine.trainer_init``), not vLLM's
            PyNcclCommunicator.
        src: the sending rank (this process's rank in ``group``: 0 for the trainer).
        buffer_size_bytes / num_buffers: as the engines' ``packed_buffer_size_bytes`` / ``packed_num_buffers``.
        verify: ours, keyword-only: compare each bucket's checksum with the engines' (see wire.py).
    Raises:
        ValueError: ``buffer_size_bytes`` or ``num_buffers`` not positive, or ``src`` is not this rank.
        WeightTransferError / WeightTransferTimeoutError: as ``NCCLWeightTransferEngine.trainer_send_weights``.
    """
    from layerwise.transfer.nccl import send_broadcast  # nccl imports this module

    _check_packing(buffer_size_bytes, num_buffers)
    send_broadcast(
        iterator,
        group,
        src=src,
        post_iter_func=post_iter_func,
        capacity=buffer_size_bytes,
        num_slots=num_buffers,
        verify=verify,
    )


def packed_broadcast_consumer(
    iterator: Iterator[tuple[str, tuple[list[int], torch.dtype | str]]],
    group: Any,
    src: int,
    post_unpack_func: Callable[[list[tuple[str, torch.Tensor]]], None],
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
    *,
    verify: bool = False,
) -> None:
    """Engine side of a packed update, with the name and arguments of vLLM's ``packed_broadcast_consumer``.

    Receives the buckets :func:`packed_broadcast_producer` sends and calls ``post_unpack_func`` once per bucket
    with its (name, tensor) views (valid until ``post_unpack_func`` returns: the slot is refilled next). This is
    what ``NCCLWeightTransferEngine.receive_weights`` runs for a packed update.

    Args:
        iterator: (name, (shape, dtype)) of every tensor, in send order; dtype a torch.dtype or its name
            ("bfloat16"). Read whole before the first bucket (the layout needs every size).
        group: the engine's ``WeightTransferGroup`` (``NCCLWeightTransferEngine.group``); buckets land on its
            device.
        src: the trainer's rank (0).
        buffer_size_bytes / num_buffers / verify: must equal the producer's.
    Raises:
        ValueError: ``buffer_size_bytes`` or ``num_buffers`` not positive, or an unknown dtype name.
        WeightTransferError / WeightTransferTimeoutError: as ``NCCLWeightTransferEngine.receive_weights``.
        whatever ``post_unpack_func`` raised first (the rest of the update is received and dropped before).
    """
    from layerwise.transfer.base import parse_dtype_name
    from layerwise.transfer.nccl import receive_broadcast  # nccl imports this module

    _check_packing(buffer_size_bytes, num_buffers)
    tensors = [
        (name, dtype if isinstance(dtype, torch.dtype) else parse_dtype_name(dtype, name), list(shape))
        for name, (shape, dtype) in iterator
    ]
    receive_broadcast(
        group,
        tensors,
        post_unpack_func,
        src=src,
        capacity=buffer_size_bytes,
        num_slots=num_buffers,
        verify=verify,
    )


#: the names newer vLLM gives the same two functions (``packed_nccl_broadcast_producer`` / ``_consumer``); a trainer
#: importing either spelling runs unchanged
packed_nccl_broadcast_producer = packed_broadcast_producer
packed_nccl_broadcast_consumer = packed_broadcast_consumer


def _check_packing(buffer_size_bytes: int, num_buffers: int) -> None:
    if isinstance(buffer_size_bytes, bool) or not isinstance(buffer_size_bytes, int) or buffer_size_bytes <= 0:
        raise ValueError(f"buffer_size_bytes must be a positive int, got {buffer_size_bytes!r}")
    if isinstance(num_buffers, bool) or not isinstance(num_buffers, int) or num_buffers < 1:
        raise ValueError(f"num_buffers must be an int >= 1, got {num_buffers!r}")
