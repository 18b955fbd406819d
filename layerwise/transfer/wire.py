"""What the trainer and the engines agree on around each bucket's bytes: its header before, its checksum after.

The update info travels over the user's own control plane and the bytes over the group, so nothing ties one
to the other: a trainer that sends float32 where the update info says bfloat16, skips a tensor or adds one
would start a broadcast whose sizes differ between ranks, which gloo answers by aborting the process
("Received data size doesn't match expected size") and NCCL by reading or writing past a buffer. So before
each bucket (a tensor, unpacked) every rank describes what it is about to send or receive:

    header = [nbytes, tensors, digest, settings]        int64; the end of an update: nbytes = END (-1);
                                                        a side that gives up: nbytes = ABORT (-2)
    digest = crc32 of "name|dtype|shape;" over the bucket's tensors, in order
    settings = verify + 2 x buckets in flight          (they fix where the checksums fall in the order)

and one all-reduce (MAX over ``header`` and ``-header``) gives every rank the largest and the smallest
header. Equal: all agree, and the payload is posted. Different: every rank knows it at once; the trainer
broadcasts its bucket's tensor list (JSON; or why it gave up: its iterator raised) so the engines can name
the first tensor that differs, and every rank raises :class:`WeightTransferError` without posting the
payload. A trainer whose iterator raises sends ABORT where its next header is due, so the engines raise at
once (naming its error) instead of waiting out their timeout. (An engine whose update info does not parse
raises ValueError before the update starts: nothing tells the trainer, whose send times out.) No
collective ever runs with sizes that differ, and the group stays in step: the next update uses it as before.

``verify=True`` (update info and trainer args; vLLM has no such check) adds, after each bucket's bytes
arrive and before they are loaded, a checksum of the bytes computed where they are (sender: the bucket it
broadcast; receiver: the bucket it received, on its device) and compared by the same all-reduce: CRC-32
on the CPU (gloo), Fletcher's two sums over 16-bit words on CUDA (NCCL). Both catch changed, zeroed,
shifted and swapped bytes, not an adversary.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from layerwise.transfer.base import WeightTransferError

END = -1  # header nbytes of the end of an update
ABORT = -2  # header nbytes of a side that gives up the update
_MODULUS = (1 << 31) - 1  # checksum sums stay below 2^31: no int64 overflow on any device
_WEIGHT_PERIOD = 65521  # position weights cycle with Adler's prime: 16-bit word x weight < 2^32
_CHUNK_WORDS = _WEIGHT_PERIOD * 16  # 2 MiB of bucket per step; a multiple of the period: one weight vector


class Group(Protocol):
    """The collectives the agreement needs (``layerwise.transfer.nccl.WeightTransferGroup``)."""

    rank: int
    device: torch.device

    def start_all_reduce_max(self, tensor: torch.Tensor, key: str | None, what: str) -> Any: ...

    def wait(self, work: Any, key: str | None, what: str) -> None: ...

    def broadcast_and_wait(self, tensor: torch.Tensor, src: int, key: str | None, what: str) -> None: ...


Entry = tuple[str, str, list[int]]  # (name, dtype name, shape) of one tensor of a bucket


def header(entries: Sequence[Entry], nbytes: int, verify: bool, slots: int) -> list[int]:
    """The header of a bucket of ``entries`` and ``nbytes`` bytes (``entries`` empty: the end of an update),
    sent with ``slots`` buckets in flight."""
    settings = int(verify) + 2 * slots
    if not entries:
        return [END, 0, 0, settings]
    text = "".join(f"{name}|{dtype}|{','.join(map(str, shape))};" for name, dtype, shape in entries)
    return [nbytes, len(entries), zlib.crc32(text.encode()), settings]


def abort_header() -> list[int]:
    """The header of a side that gives up the update (it differs from every other header)."""
    return [ABORT, 0, 0, 0]


class Agreement:
    """One agreement in flight: the all-reduce (MAX over ``values`` and ``-values``) is started here, so a rank
    can post it early and do other work until it needs :meth:`result`.

    Args:
        values: ints (a header, a checksum), the same count on every rank.
        key / what: the tensor and the step named by a timeout (the group's WeightTransferTimeoutError).
    """

    def __init__(self, group: Group, values: Sequence[int], key: str | None, what: str):
        self.group, self.key, self.what, self.count = group, key, what, len(values)
        self.tensor = torch.tensor([*values, *(-v for v in values)], dtype=torch.int64, device=group.device)
        self.work = group.start_all_reduce_max(self.tensor, key, what)

    def result(self) -> tuple[list[int], list[int]]:
        """(smallest, largest) value per position over the group, once every rank took part (bounded wait)."""
        self.group.wait(self.work, self.key, self.what)
        out = self.tensor.tolist()
        return [-v for v in out[self.count :]], out[: self.count]


def agree(group: Group, values: Sequence[int], key: str | None, what: str) -> tuple[list[int], list[int]]:
    """:class:`Agreement` waited for at once: (smallest, largest) per position."""
    return Agreement(group, values, key, what).result()


def checksums_agree(group: Group, data: torch.Tensor, key: str | None, what: str) -> bool:
    """Whether every rank's :func:`checksum` of its copy of a bucket (``data``, uint8) is the same (one
    all-reduce; ``what`` names the bucket)."""
    lo, hi = agree(group, checksum(data), key, f"{what}'s checksum")
    return lo == hi


def exchange_entries(
    group: Group, entries: Sequence[Entry] | None, key: str | None, what: str, reason: str | None = None
) -> tuple[list[Entry], str | None]:
    """After a disagreement: the trainer (``entries`` given; with ``reason`` when it gives up) broadcasts its
    bucket's tensor list; every rank returns (that list, the trainer's reason or None). Two broadcasts: the
    length, then the JSON bytes."""
    payload = b""
    if entries is not None:
        payload = json.dumps({"entries": [list(e) for e in entries], "reason": reason}).encode()
    length = torch.tensor([len(payload)], dtype=torch.int64, device=group.device)
    group.broadcast_and_wait(length, 0, key, f"{what} (the trainer's tensor list's length)")
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=group.device)
    if entries is not None:
        data.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if data.numel():
        group.broadcast_and_wait(data, 0, key, f"{what} (the trainer's tensor list)")
    sent = json.loads(bytes(data.cpu().tolist()) or b'{"entries": [], "reason": null}')
    return [(name, dtype, list(shape)) for name, dtype, shape in sent["entries"]], sent["reason"]


def trainer_view(ours: list[int], lo: list[int], hi: list[int]) -> list[int]:
    """From the trainer's header and the group's smallest / largest: an engine's header (per position, the
    value that differs from the trainer's; exact with one engine)."""
    return [h if h != o else lo_ for o, lo_, h in zip(ours, lo, hi, strict=True)]


def describe(entry: Entry) -> str:
    """``'name' bfloat16 [4, 8] (64 bytes)``."""
    name, dtype_name, shape = entry
    dtype = getattr(torch, dtype_name, None)
    size = f" ({math.prod(shape) * dtype.itemsize} bytes)" if isinstance(dtype, torch.dtype) else ""
    return f"{name!r} {dtype_name} {list(shape)}{size}"


def mismatch_error(
    ours: Sequence[Entry], theirs: Sequence[Entry], what: str, later: Sequence[Entry], reason: str | None = None
) -> WeightTransferError:
    """The engine's error for a bucket whose header differs from the trainer's.

    Args:
        ours: the bucket's tensors as the update info declares them ([] = the update info has ended).
        theirs: the tensors the trainer sends in its bucket ([] = its update has ended).
        what: the bucket's label; later: the update info's tensors after this bucket (for "missing").
        reason: the trainer gave up the update (its iterator raised): why.
    """
    after = (
        "nothing of this bucket was received and none of it loaded; the trainer raised too, and the group stays "
        "in step for the next update"
    )
    if reason is not None:
        return WeightTransferError(
            f"weight transfer, {what}: the trainer gave up the update ({reason}); {after}",
            key=ours[0][0] if ours else None,
        )
    expected = [*ours, *later]  # compared past this bucket: a tensor missing shifts the trainer's bucket
    for i in range(max(len(ours), len(theirs))):
        mine = expected[i] if i < len(expected) else None
        sent = theirs[i] if i < len(theirs) else None
        if mine == sent:
            continue
        if sent is None and not theirs:
            rest = [e[0] for e in expected[i:]]
            shown = ", ".join(repr(n) for n in rest[:3]) + (f" and {len(rest) - 3} more" if len(rest) > 3 else "")
            message = f"the trainer's update ends before tensor {describe(mine)}: it never sends {shown}"
            key = mine[0]
        elif sent is None:
            message = f"the trainer's bucket ends before tensor {describe(mine)}, which the update info declares next"
            key = mine[0]
        elif mine is None:
            message = f"the trainer sends tensor {describe(sent)}, which the update info does not declare"
            key = sent[0]
        else:
            message = f"the trainer sends tensor {describe(sent)}, the update info declares {describe(mine)}"
            key = mine[0]
        return WeightTransferError(f"weight transfer, {what}: {message}; {after}", key=key)
    return WeightTransferError(
        f"weight transfer, {what}: the trainer sends these tensors, but its settings differ from this update "
        f"info's (verify, packed, packed_buffer_size_bytes and packed_num_buffers must match), or another "
        f"engine rank's update info differs; {after}",
        key=ours[0][0] if ours else None,
    )


def checksum(data: torch.Tensor) -> list[int]:
    """Checksum of ``data`` (uint8 [n], contiguous), computed where it is: two ints.

    CPU: [CRC-32 (zlib, several GB/s), n]. CUDA: :func:`fletcher` on the GPU. A group's ranks are all on
    the CPU (gloo) or all on CUDA (NCCL), so both ends of a bucket always use the same algorithm.
    """
    if data.device.type == "cpu":
        return [zlib.crc32(memoryview(data.contiguous().numpy())), data.numel()]
    return fletcher(data)


def fletcher(data: torch.Tensor) -> list[int]:
    """Fletcher checksum of ``data`` (uint8 [n], any device): [sum of words, sum of position x word], both
    modulo 2^31 - 1, over the bytes read as little-endian 16-bit words (an odd last byte is a word of its
    own), position weights (i mod 65521) + 1.

    Torch ops in chunks of 2 MiB, in float64, which is exact here: a word times its weight is below 2^32 and
    a chunk's sums stay below 2^52 (extra memory: a few float64 copies of a chunk). Bandwidth-bound on a GPU;
    on a CPU about 20x slower than zlib's CRC-32, which :func:`checksum` uses there.
    """
    n = data.numel()
    if n % 2 or data.storage_offset() % 2:
        data = torch.cat([data, data.new_zeros(n % 2)])  # a copy, 2-aligned and of even length
    words = data.view(torch.int16)
    sums = torch.zeros(2, dtype=torch.float64, device=data.device)
    chunk = min(words.numel(), _CHUNK_WORDS)
    weights = torch.arange(chunk, dtype=torch.int64, device=data.device).remainder_(_WEIGHT_PERIOD).add_(1).double()
    for start in range(0, words.numel(), _CHUNK_WORDS):
        w = words[start : start + _CHUNK_WORDS].to(torch.int32).bitwise_and_(0xFFFF).double()
        sums[0] += w.sum()
        sums[1] += torch.dot(w, weights[: w.numel()])
        sums.remainder_(_MODULUS)
    return [int(v) for v in sums.tolist()]
