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
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
