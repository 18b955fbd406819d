"""Backend "nccl": the trainer (rank 0) broadcasts every tensor to the engine ranks over a group of their own.

Design after vLLM's ``vllm/distributed/weight_transfer/nccl_engine.py`` and ``packed_tensor.py``. The group
is built without torch.distributed's default group (which a trainer already uses for its own training):
a ``TCPStore`` hosted by the trainer at ``master_address:master_port``, a ``PrefixStore`` on it, and a
``ProcessGroupNCCL`` (CUDA) or ``ProcessGroupGloo`` (CPU) constructed directly on that store, as vLLM's
stateless process groups do.

    trainer (rank 0)                                  engine (rank rank_offset + worker_rank)
    group = trainer_init(init_info)                   engine.init_transfer_engine(init_info)
    send update info (names, dtype_names, shapes, packed settings) over your own control plane
    trainer_send_weights(iterator, args)              update_weights(model, engine, update_info)
      unpacked: broadcast each tensor's bytes            receive each tensor, load_weights([(name, t)])
      packed: copy tensors into bucket b % N,            receive bucket b into slot b % N, posting the
              broadcast it while packing b + 1            next buckets first; load_weights(views of b)

Every wait is bounded by ``timeout_seconds``: a trainer that dies or stalls makes the engine raise
:class:`WeightTransferTimeoutError` naming the tensor it waited for. After a bad tensor, the engine still
receives (and drops) the rest of the update, so the trainer finishes its send and the group stays in step.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from layerwise.transfer import wire
from layerwise.transfer.base import (
    LoadWeights,
    TensorListUpdateInfo,
    WeightTransferEngine,
    WeightTransferError,
    WeightTransferInitInfo,
    WeightTransferTimeoutError,
    dtype_name,
    parse_dataclass,
)
from layerwise.transfer.packed_tensor import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    Bucket,
    BucketLayout,
    flat_bytes,
    packed_broadcast_consumer,
    packed_broadcast_producer,
    plan_buckets,
    unpack_bucket,
)
from layerwise.transfer.rendezvous import first_line, join

DEFAULT_TIMEOUT_SECONDS = 60.0
_GROUP_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CONNECTION_LOST = ("timed out", "timeout", "connection", "closed", "reset", "broken pipe", "aborted")


@dataclass
class NCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """How to reach the trainer.

    Attributes:
        master_address / master_port: where the trainer (rank 0) hosts the group's TCPStore.
        rank_offset: rank of the engine's first worker (the trainer is rank 0, so usually 1).
        world_size: trainer + every engine worker.
        timeout_seconds: bound on every wait: the whole rendezvous, each broadcast (seconds).
        group_id: a token naming this group, the same in the trainer's and the engines' init info (e.g.
            ``secrets.token_hex(8)``, drawn once where the init info is made). Given, an engine refuses a
            trainer that hosts another group (a stale init info); None: the trainer draws one and the
            engines accept it. Either way a rank is admitted once: a second engine with a taken rank, or
            one that comes after the group formed, is refused with a WeightTransferError.
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    group_id: str | None = None

    def __post_init__(self):
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be an int in [1, 65535], got {self.master_port!r}")
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"world_size must be an int >= 2 (trainer + engine), got {self.world_size!r}")
        if not isinstance(self.rank_offset, int) or not 0 < self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset must be an int in [1, world_size), got {self.rank_offset!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive, got {self.timeout_seconds!r}")
        if self.group_id is not None and not (isinstance(self.group_id, str) and _GROUP_ID.match(self.group_id)):
            raise ValueError(f"group_id must be 1-64 letters, digits, '_' or '-', got {self.group_id!r}")


@dataclass(kw_only=True)
class NCCLWeightTransferUpdateInfo(TensorListUpdateInfo):
    """One update: the tensors in send order, and how they are packed.

    Attributes:
        names / dtype_names / shapes / is_checkpoint_format: see TensorListUpdateInfo.
        packed: concatenate tensors into uint8 buckets (see layerwise/transfer/packed_tensor.py).
        packed_buffer_size_bytes: bytes per bucket (a larger tensor travels alone). Must equal the
            trainer's value.
        packed_num_buffers: buckets in flight (2 = double buffering). Must equal the trainer's value.
        verify: compare a checksum of every bucket's bytes, sender's against receiver's, before the bucket
            is loaded (see layerwise/transfer/wire.py). Must equal the trainer's value.
    """

    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    verify: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.verify, bool):
            raise ValueError(f"verify must be a bool, got {self.verify!r}")
        if not isinstance(self.packed_buffer_size_bytes, int) or self.packed_buffer_size_bytes <= 0:
            raise ValueError(f"packed_buffer_size_bytes must be a positive int, got {self.packed_buffer_size_bytes!r}")
        if not isinstance(self.packed_num_buffers, int) or self.packed_num_buffers < 1:
            raise ValueError(f"packed_num_buffers must be an int >= 1, got {self.packed_num_buffers!r}")


@dataclass
class NCCLTrainerSendWeightsArgs:
    """Trainer-side arguments of :meth:`NCCLWeightTransferEngine.trainer_send_weights`, as vLLM's
    ``NCCLTrainerSendWeightsArgs`` (same fields, order and defaults; ``verify`` is ours, keyword-only).

    Attributes:
        group: the trainer's group, from :meth:`NCCLWeightTransferEngine.trainer_init`.
        src: the sending rank (the trainer: 0).
        post_iter_func: called once per item of the iterator, with the ``(name, tensor)`` pair, before that
            tensor is packed or broadcast; the tensor it returns is what is sent (its dtype and shape are what
            the engines' update info must declare). None: the pair's tensor itself (as vLLM).
        packed: concatenate tensors into uint8 buckets (see layerwise/transfer/packed_tensor.py).
        stream: a ``torch.cuda.Stream`` or None. On CUDA (NCCL) the send runs with it as the current stream, so
            the copies into buckets and the broadcasts are ordered after the work already queued on it. On the
            CPU (gloo) it is accepted and unused. vLLM uses it for unpacked sends only; here it applies to both.
        packed_buffer_size_bytes / packed_num_buffers / verify: must equal the update info's.
    """

    group: WeightTransferGroup
    src: int = 0
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] | None = None
    packed: bool = False
    stream: Any = None
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    verify: bool = field(default=False, kw_only=True)


class WeightTransferGroup:
    """A broadcast group of its own: TCPStore (hosted by rank 0) -> PrefixStore -> Gloo or NCCL backend.

    Never touches torch.distributed's default group. The rendezvous (layerwise/transfer/rendezvous.py)
    admits each rank once and completes, or fails, within ``timeout_seconds``.

    Args:
        master_address / master_port: the store's address; rank 0 listens there.
        rank / world_size: this process's rank in the group, and the group's size.
        device: CUDA -> ProcessGroupNCCL, CPU -> ProcessGroupGloo; broadcast tensors live there.
        timeout_seconds: bound on the rendezvous and on every wait.
        group_id: the init info's group token (None: rank 0 draws one, the others take it).
    Raises:
        WeightTransferTimeoutError: the rendezvous did not complete within the timeout (no trainer, or an
            engine rank missing); the message gives the elapsed seconds.
        WeightTransferError: this rank was admitted already (a second engine, a late one), the trainer hosts
            another group id or world size, or rank 0 cannot listen on the port.
        RuntimeError: NCCL requested but not available in this torch build.
    """

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        device: torch.device | str,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        group_id: str | None = None,
    ):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.timeout_seconds = float(timeout_seconds)
        self.timeout = datetime.timedelta(seconds=self.timeout_seconds)
        self.broken: str | None = None
        if self.device.type == "cuda" and not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL; use a CPU device (gloo)")
        self.store, namespace = join(master_address, master_port, rank, world_size, self.timeout_seconds, group_id)
        prefix_store = dist.PrefixStore(namespace, self.store)
        try:
            if self.device.type == "cuda":
                options = dist.ProcessGroupNCCL.Options()
                options.is_high_priority_stream = False
                options._timeout = self.timeout
                with torch.cuda.device(self.device):
                    self.backend = dist.ProcessGroupNCCL(prefix_store, rank, world_size, options)
            else:
                self.backend = dist.ProcessGroupGloo(prefix_store, rank, world_size, self.timeout)
        except RuntimeError as e:
            if not _is_connection_loss(e):
                raise
            raise WeightTransferTimeoutError(
                f"weight transfer: rank {rank} of {world_size} joined the group at {master_address}:{master_port} "
                f"but could not connect to every rank within {self.timeout_seconds:g} s: {first_line(e)}"
            ) from e

    def broadcast(self, tensor: torch.Tensor, src: int, key: str | None) -> Any:
        """Start broadcasting ``tensor`` (uint8, on ``device``) from ``src``; returns the work to wait on."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        return self._start(lambda: self.backend.broadcast([tensor], opts), key, "starting a broadcast")

    def wait(self, work: Any, key: str | None, what: str) -> None:
        """Wait for ``work`` at most ``timeout_seconds``.

        Raises:
            WeightTransferTimeoutError: timed out, or the peer closed its connection (died); names ``key``.
            WeightTransferError: any other transport failure (e.g. the peer sent another number of bytes).
        """
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            raise self._failure(e, key, what) from e

    def broadcast_and_wait(self, tensor: torch.Tensor, src: int, key: str | None, what: str) -> None:
        """Broadcast ``tensor`` from ``src`` and wait for it (bounded); raises as :meth:`wait`."""
        self.wait(self.broadcast(tensor, src, key), key, what)

    def start_all_reduce_max(self, tensor: torch.Tensor, key: str | None, what: str) -> Any:
        """Start an in-place element-wise max of ``tensor`` (on ``device``) over the group; returns the work
        to pass to :meth:`wait`."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        return self._start(lambda: self.backend.allreduce([tensor], opts), key, what)

    def _start(self, collective: Any, key: str | None, what: str) -> Any:
        """Run ``collective()`` (which starts one on ``backend``) on this group's device; returns its work."""
        self._check_usable(key)
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    return collective()
            return collective()
        except RuntimeError as e:
            raise self._failure(e, key, what) from e

    def _check_usable(self, key: str | None) -> None:
        if self.broken:
            raise WeightTransferError(
                f"weight transfer group is unusable after an earlier failure ({self.broken}); "
                f"shutdown() and init again",
                key=key,
            )

    def _failure(self, e: RuntimeError, key: str | None, what: str) -> WeightTransferError:
        self.broken = first_line(e)
        if self.device.type == "cuda":  # a timed-out NCCL communicator must be aborted, or later ops hang
            try:
                self.backend.abort()
            except Exception:  # noqa: BLE001 -- best effort; the group is unusable either way
                pass
        peer = "the trainer" if self.rank != 0 else "an engine rank"
        after = "the group is now unusable: shutdown() and init the transfer engine again with the trainer"
        if _is_connection_loss(e):
            return WeightTransferTimeoutError(
                f"weight transfer: nothing from {peer} within {self.timeout_seconds:g} s, or it closed the "
                f"connection (it died?), while waiting for {what} ({self.broken}); {after}",
                key=key,
            )
        return WeightTransferError(f"weight transfer failed while waiting for {what} ({self.broken}); {after}", key=key)

    def shutdown(self) -> None:
        """Release the backend and the store (safe to call twice)."""
        backend = self.__dict__.pop("backend", None)
        if backend is not None and hasattr(backend, "shutdown") and not self.broken:
            try:
                backend.shutdown()
            except Exception:  # noqa: BLE001 -- releasing a group whose peer is gone may fail
                pass
        self.__dict__.pop("store", None)


def _is_connection_loss(e: BaseException) -> bool:
    text = str(e).lower()
    return any(s in text for s in _CONNECTION_LOST)


def _finish_after_disagreement(
    group: WeightTransferGroup, error: WeightTransferError | None, pending: list, in_flight: deque
) -> None:
    """After a disagreement (``error``, about to be raised): settle the agreements this rank posted and
    complete the broadcasts both sides posted before it, so the group stays in step. If that fails too, the
    group is broken (as its own error says) and ``error`` keeps the first word: its message is extended."""
    if group.broken:
        return
    try:
        for settle in pending:  # posted, so the trainer takes part in them too
            settle()
        while in_flight:
            item = in_flight.popleft()
            group.wait(item[1], None, "a bucket posted before the disagreement")
    except WeightTransferError as cleanup:
        if error is None:
            return  # the group is marked broken; the caller raises its own error
        message = error.message.replace("the group stays in step", "the group is now unusable")
        error.message = f"{message}; then, finishing the buckets in flight: {cleanup.message}"


def _bucket_label(bucket: Bucket, k: int, total: int | None) -> str:
    n = len(bucket.entries)
    of = f" of {total}" if total is not None else ""
    return f"bucket {k + 1}{of} ({n} tensor{'s' if n != 1 else ''}, {bucket.nbytes} bytes)"


class NCCLWeightTransferEngine(WeightTransferEngine[NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo]):
    """Receive weights broadcast by the trainer over a group of their own (NCCL on CUDA, gloo on CPU).

    Design: vLLM's ``NCCLWeightTransferEngine`` (vllm/distributed/weight_transfer/nccl_engine.py).

    Args:
        device: where received tensors land (CUDA -> NCCL, CPU -> gloo); the model's device.
        worker_rank: this engine worker's index; its group rank is ``rank_offset + worker_rank``.
    """

    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, device: torch.device | str = "cpu", worker_rank: int = 0):
        super().__init__(device)
        self.worker_rank = worker_rank
        self.group: WeightTransferGroup | None = None

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo | dict) -> None:
        """Join the trainer's group (blocks until every rank joined, at most ``timeout_seconds``).

        Raises:
            ValueError: bad init info, or a rank outside [1, world_size).
            WeightTransferTimeoutError: the trainer did not show up within the timeout.
        """
        info = self.parse_init_info(init_info)
        rank = info.rank_offset + self.worker_rank
        if not 0 < rank < info.world_size:
            raise ValueError(
                f"engine rank {rank} (rank_offset {info.rank_offset} + worker_rank "
                f"{self.worker_rank}) is outside [1, world_size={info.world_size})"
            )
        self.shutdown()
        self.group = WeightTransferGroup(
            info.master_address,
            info.master_port,
            rank,
            info.world_size,
            self.device,
            info.timeout_seconds,
            info.group_id,
        )

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo | dict, load_weights: LoadWeights) -> None:
        """Receive the update's tensors in the order of ``update_info.names`` and load them.

        Unpacked: each tensor is received into a buffer of its own (two in flight) and passed alone.
        Packed (:func:`~layerwise.transfer.packed_tensor.packed_broadcast_consumer`): bucket k is received into
        slot k % packed_num_buffers (uint8 [<= packed_buffer_size_bytes]); the next buckets' receives are posted
        before bucket k is loaded, and ``load_weights`` gets views of bucket k, which must be consumed or copied
        before it returns (the slot is refilled next).

        Before each bucket's bytes the engine and the trainer compare headers (bytes, tensor count, a digest
        of names, dtypes and shapes: layerwise/transfer/wire.py), and with ``verify`` a checksum of the bytes
        after they arrive; a difference stops both sides before any mismatched collective, with the group
        still in step.

        Raises:
            RuntimeError: init_transfer_engine was not called.
            WeightTransferError: the trainer sends other tensors than the update info declares (another
                dtype, shape or name, one missing, one extra, another packing), or, with ``verify``, bytes
                whose checksum differs; names the first such tensor, with both sizes. Nothing of that bucket
                was loaded; the group stays usable.
            WeightTransferTimeoutError: nothing arrived within ``timeout_seconds`` (or the trainer died);
                names the tensor waited for. The group is then unusable until re-initialized.
            whatever ``load_weights`` raised first; the rest of the update is received and dropped before.
        """
        group = self._require_group()
        info = self.parse_update_info(update_info)
        tensors = list(zip(info.names, info.dtypes, info.shapes, strict=True))
        if info.packed:
            packed_broadcast_consumer(
                iterator=((name, (shape, dtype)) for name, dtype, shape in tensors),
                group=group,
                src=0,
                post_unpack_func=load_weights,
                buffer_size_bytes=info.packed_buffer_size_bytes,
                num_buffers=info.packed_num_buffers,
                verify=info.verify,
            )
        else:
            receive_broadcast(group, tensors, load_weights, verify=info.verify)

    def _require_group(self) -> WeightTransferGroup:
        if self.group is None:
            raise RuntimeError("NCCL weight transfer is not initialized: call init_transfer_engine() first")
        return self.group

    def shutdown(self) -> None:
        """Leave the group (safe to call twice)."""
        if self.group is not None:
            self.group.shutdown()
            self.group = None

    @staticmethod
    def trainer_init(
        init_info: NCCLWeightTransferInitInfo | dict, device: torch.device | str | None = None
    ) -> WeightTransferGroup:
        """Trainer side: host the store and join the group as rank 0, as vLLM's ``trainer_init``.

        Args:
            init_info: vLLM's three keys ``master_address``, ``master_port``, ``world_size`` (a dict or the
                dataclass), and optionally ours: ``timeout_seconds`` (default 60) and ``group_id`` (default None),
                which must equal the engines'. ``rank_offset`` may be present (the engines' init info passed
                as is) and is then only checked; the trainer is always rank 0.
            device: where the trainer's tensors are broadcast from; default: the current CUDA device if
                CUDA is available, else CPU. Must be CUDA exactly when the engines' devices are. (vLLM's has
                no such argument and always uses the current CUDA device.)
        Returns:
            the group to pass as ``NCCLTrainerSendWeightsArgs.group``.
        Raises:
            ValueError: a required key missing or an unknown one (both named), or a bad value.
            WeightTransferTimeoutError: the engines did not join within ``timeout_seconds``.
        """
        if isinstance(init_info, dict):
            fields = dict(init_info)
            fields.setdefault("rank_offset", 1)  # the engines' field: the trainer is rank 0 whatever it says
            init_info = parse_dataclass(
                NCCLWeightTransferInitInfo, fields, "init_info", "NCCLWeightTransferEngine.trainer_init"
            )
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return WeightTransferGroup(
            init_info.master_address,
            init_info.master_port,
            0,
            init_info.world_size,
            device,
            init_info.timeout_seconds,
            init_info.group_id,
        )

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: NCCLTrainerSendWeightsArgs | dict
    ) -> None:
        """Trainer side: broadcast every (name, tensor) of ``iterator`` to the engines, as vLLM's
        ``trainer_send_weights`` (same arguments: ``trainer_args`` is an :class:`NCCLTrainerSendWeightsArgs` or
        a dict of its fields).

        What is sent for an item is ``post_iter_func((name, tensor))`` (default: the tensor), called once per
        item before the tensor is packed or broadcast. The order and the metadata of what is sent must be
        those of the update info the engines were given (use :func:`layerwise.transfer.base.tensor_metadata`
        on the same pairs). Unpacked: each tensor's own bytes are broadcast (no copy when it is contiguous and
        on the group's device). Packed (:func:`~layerwise.transfer.packed_tensor.packed_broadcast_producer`):
        tensors are copied into uint8 buckets of ``packed_buffer_size_bytes`` (a larger tensor alone); bucket
        k + 1 is packed while bucket k is in flight, at most ``packed_num_buffers`` buckets in flight.

        Each bucket's header is compared with the engines' before its bytes go (and with ``verify`` its
        checksum after): see :meth:`NCCLWeightTransferEngine.receive_weights`.

        Raises:
            ValueError: ``src`` is not this process's rank.
            WeightTransferError: the engines' update info declares other tensors than ``iterator`` yields
                (names the trainer's first tensor of the bucket; the engines raise too, naming theirs), or
                a checksum differs; the group stays usable.
            WeightTransferTimeoutError: an engine stopped receiving for ``timeout_seconds`` (or died).
        """
        args = NCCLTrainerSendWeightsArgs(**trainer_args) if isinstance(trainer_args, dict) else trainer_args
        post_iter_func = args.post_iter_func if args.post_iter_func is not None else _tensor_of
        use_stream = args.stream is not None and args.group.device.type == "cuda"
        with torch.cuda.stream(args.stream) if use_stream else contextlib.nullcontext():
            if args.packed:
                packed_broadcast_producer(
                    iterator=iterator,
                    group=args.group,
                    src=args.src,
                    post_iter_func=post_iter_func,
                    buffer_size_bytes=args.packed_buffer_size_bytes,
                    num_buffers=args.packed_num_buffers,
                    verify=args.verify,
                )
            else:
                send_broadcast(iterator, args.group, src=args.src, post_iter_func=post_iter_func, verify=args.verify)


def _tensor_of(item: tuple[str, torch.Tensor]) -> torch.Tensor:
    """vLLM's default ``post_iter_func``: the pair's tensor."""
    return item[1]


def receive_broadcast(
    group: WeightTransferGroup,
    tensors: list[tuple[str, torch.dtype, list[int]]],
    load_weights: LoadWeights,
    *,
    src: int = 0,
    capacity: int | None = None,
    num_slots: int = DEFAULT_PACKED_NUM_BUFFERS,
    verify: bool = False,
) -> None:
    """Engine side of one update: receive ``tensors`` (name, dtype, shape; in send order) broadcast by ``src``
    and hand them to ``load_weights`` bucket by bucket (see :meth:`NCCLWeightTransferEngine.receive_weights`).

    Args:
        capacity: bytes per bucket (packed) or None (unpacked: a tensor per bucket, two in flight).
        num_slots: buckets in flight when packed.
        verify: compare each bucket's checksum with the trainer's before loading it.
    Raises:
        as :meth:`NCCLWeightTransferEngine.receive_weights`.
    """
    names = [name for name, _, _ in tensors]
    dtypes = [dtype for _, dtype, _ in tensors]
    shapes = [list(shape) for _, _, shape in tensors]
    num_slots = num_slots if capacity is not None else 2
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in zip(dtypes, shapes, strict=True)]
    buckets = plan_buckets(sizes, capacity)
    declared = [[(names[i], dtype_name(dtypes[i]), shapes[i]) for i, _, _ in b.entries] for b in buckets]
    slot_bytes = max((b.nbytes for b in buckets if capacity is not None and b.nbytes <= capacity), default=0)
    slots: list[torch.Tensor | None] = [None] * num_slots

    def buffer_for(k: int) -> torch.Tensor:
        nbytes = buckets[k].nbytes
        if capacity is None or nbytes > capacity:  # unpacked, or a tensor larger than a bucket
            return torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        s = k % num_slots
        if slots[s] is None:
            slots[s] = torch.empty(slot_bytes, dtype=torch.uint8, device=group.device)
        return slots[s][:nbytes]

    def post_header(h: int) -> wire.Agreement:  # bucket h's header (h == len(buckets): the end)
        ours = declared[h] if h < len(buckets) else []
        what = _bucket_label(buckets[h], h, len(buckets)) if ours else "the end of the update"
        values = wire.header(ours, buckets[h].nbytes if ours else 0, verify, num_slots)
        return wire.Agreement(group, values, ours[0][0] if ours else None, what)

    def settle(h: int, agreement: wire.Agreement) -> None:
        lo, hi = agreement.result()
        if lo != hi:
            theirs, reason = wire.exchange_entries(group, None, agreement.key, agreement.what)
            raise wire.mismatch_error(
                declared[h] if h < len(buckets) else [],
                theirs,
                agreement.what,
                [e for b in declared[h + 1 :] for e in b],
                reason,
            )

    def post_payload(h: int) -> None:
        buf = buffer_for(h)
        in_flight.append((buf, group.broadcast(buf, src, declared[h][0][0])))

    # The collectives in the trainer's order: H(h), P(h) for the first num_slots buckets; then per bucket
    # k: [C(k) with verify], H(k + num_slots), P(k + num_slots), with H(end) where the next H would go;
    # then the remaining C's. The header of bucket k + num_slots is posted right after bucket k arrived and settled
    # only when its payload is due, so its round trip overlaps loading bucket k.
    total = len(buckets)
    in_flight: deque = deque()
    pending: dict[int, wire.Agreement] = {}  # header index -> its agreement in flight
    error = None
    try:
        for h in range(min(num_slots, total + 1)):
            settle(h, post_header(h))
            if h < total:
                post_payload(h)
        for k, bucket in enumerate(buckets):
            h = k + num_slots - 1  # the header and payload due now (at startup for k == 0)
            if k > 0 and h <= total:
                settle(h, pending.pop(h))
                if h < total:
                    post_payload(h)
            buf, work = in_flight.popleft()
            what = _bucket_label(bucket, k, total)
            group.wait(work, declared[k][0][0], what)
            if verify and not wire.checksums_agree(group, buf, declared[k][0][0], what):
                raise WeightTransferError(
                    f"weight transfer, {what}: the checksum of the bytes received differs from the "
                    f"trainer's (changed in transit, or while the trainer sent them); nothing of this "
                    f"bucket was loaded; the trainer raised too, and the group stays in step",
                    key=declared[k][0][0],
                )
            if k + num_slots <= total:
                pending[k + num_slots] = post_header(k + num_slots)
            if error is None:
                try:
                    load_weights(unpack_bucket(buf, bucket, names, dtypes, shapes))
                except Exception as e:  # noqa: BLE001 -- Limitations 3: keep receiving, the trainer stays in step
                    error = e
            del buf
        if total in pending:  # one bucket in flight: H(end) comes after the last C
            settle(total, pending.pop(total))
    except WeightTransferError as e:
        if error is not None and e.__cause__ is None:
            e.__cause__ = error  # what load_weights raised before
        _finish_after_disagreement(group, e, [a.result for a in pending.values()], in_flight)
        raise
    except BaseException as e:  # out of the protocol's order: the trainer cannot be followed any more
        group.broken = group.broken or f"{type(e).__name__} in the middle of an update: {e}"
        raise
    if error is not None:
        raise error


def send_broadcast(
    iterator: Iterable[tuple[str, torch.Tensor]],
    group: WeightTransferGroup,
    *,
    src: int = 0,
    post_iter_func: Callable[[tuple[str, torch.Tensor]], torch.Tensor] = _tensor_of,
    capacity: int | None = None,
    num_slots: int = DEFAULT_PACKED_NUM_BUFFERS,
    verify: bool = False,
) -> None:
    """Trainer side of one update: broadcast ``post_iter_func(item)`` for every item of ``iterator`` from ``src``
    (see :meth:`NCCLWeightTransferEngine.trainer_send_weights`).

    Args:
        post_iter_func: called once per item, with the (name, tensor) pair, before its tensor is packed; returns
            the tensor sent. If it raises, the engines are told as when the iterator raises.
        capacity: bytes per bucket (packed) or None (unpacked: each tensor's own bytes, two in flight).
        num_slots: buckets in flight when packed.
        verify: compare each bucket's checksum with the engines'.
    Raises:
        as :meth:`NCCLWeightTransferEngine.trainer_send_weights`.
    """
    if group.rank != src:
        raise ValueError(f"trainer_send_weights runs on the sending rank: src={src}, this is rank {group.rank}")
    num_slots = num_slots if capacity is not None else 2
    layout = BucketLayout(capacity)
    slots: list[torch.Tensor | None] = [None] * num_slots
    pending: dict[int, tuple[wire.Entry, torch.Tensor]] = {}  # index -> ((name, dtype, shape), flat bytes)
    in_flight: deque = deque()  # (buffer kept alive, work, key, label)
    sent = 0

    def agree_on(entries: list[wire.Entry], nbytes: int, what: str) -> None:
        key = entries[0][0] if entries else None
        ours = wire.header(entries, nbytes, verify, num_slots)
        lo, hi = wire.agree(group, ours, key, what)
        if lo == hi:
            return
        wire.exchange_entries(group, entries, key, what)
        theirs = wire.trainer_view(ours, lo, hi)
        sending = f"from tensor {wire.describe(entries[0])}" if entries else "nothing more (its end)"
        if theirs[:3] == ours[:3]:
            problem = (
                f"an engine's settings differ (verify, packed, packed_buffer_size_bytes and "
                f"packed_num_buffers must match the trainer's: verify={verify}, {num_slots} in flight)"
            )
        else:
            expected = "the end of the update" if theirs[0] == wire.END else f"{theirs[1]} tensor(s)"
            expected += "" if theirs[0] == wire.END else f", {theirs[0]} bytes"
            problem = (
                f"an engine expects {expected}, the trainer sends {sending}: the update info the engines "
                f"hold differs from the tensors given to trainer_send_weights (names, dtypes, shapes and "
                f"order must match)"
            )
        raise WeightTransferError(
            f"weight transfer, {what}: {problem}; nothing of this bucket was sent, and the group stays in step",
            key=key,
        )

    def give_up(e: BaseException) -> None:  # the iterator raised: tell the engines where a header is due
        if len(in_flight) >= num_slots:
            complete_oldest()
        what = f"bucket {sent + 1} (the trainer's iterator raised)"
        lo, hi = wire.agree(group, wire.abort_header(), None, what)
        if lo != hi:
            wire.exchange_entries(group, [], None, what, reason=f"{type(e).__name__}: {e}")

    def complete_oldest() -> None:
        buf, work, key, label = in_flight.popleft()
        group.wait(work, key, label)
        if verify and not wire.checksums_agree(group, buf, key, label):
            raise WeightTransferError(
                f"weight transfer, {label}: an engine received bytes whose checksum differs from the "
                f"trainer's; it loaded nothing of this bucket, and the group stays in step",
                key=key,
            )

    def send(bucket: Bucket) -> None:
        nonlocal sent
        if len(in_flight) >= num_slots:  # the slot of bucket `sent` is free once its last user is done
            complete_oldest()
        entries = [pending[i][0] for i, _, _ in bucket.entries]
        label = _bucket_label(bucket, sent, None)
        agree_on(entries, bucket.nbytes, label)
        first = bucket.entries[0][0]
        if capacity is None:
            buf = pending[first][1]
        else:
            if bucket.nbytes > capacity:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
            else:
                s = sent % num_slots
                if slots[s] is None or slots[s].numel() < bucket.nbytes:
                    slots[s] = torch.empty(
                        max(bucket.nbytes, min(capacity, 2 * bucket.nbytes)), dtype=torch.uint8, device=group.device
                    )
                buf = slots[s][: bucket.nbytes]
            for i, offset, nbytes in bucket.entries:
                buf[offset : offset + nbytes].copy_(pending[i][1])
        for i, _, _ in bucket.entries:
            del pending[i]
        in_flight.append((buf, group.broadcast(buf, src, entries[0][0]), entries[0][0], label))
        sent += 1

    items = enumerate(iterator)
    gave_up: BaseException | None = None
    try:
        while True:
            try:
                index, item = next(items)
                name, tensor = item[0], post_iter_func(item)
                if tensor.device != group.device:
                    tensor = tensor.to(group.device)
                flat = flat_bytes(tensor)
            except StopIteration:
                break
            except Exception as e:  # the caller's iterator or tensor: the engines learn it and stay in step
                give_up(e)
                _finish_after_disagreement(group, None, [], in_flight)
                gave_up = e
                raise
            closed = layout.place(index, flat.numel())
            if closed is not None:
                send(closed)
            pending[index] = ((name, dtype_name(tensor.dtype), list(tensor.shape)), flat)
        last = layout.close()
        if last is not None:
            send(last)
        if len(in_flight) >= num_slots:  # the end's header goes where the next bucket's would
            complete_oldest()
        agree_on([], 0, "the end of the update")
        while in_flight:
            complete_oldest()
    except WeightTransferError as e:
        _finish_after_disagreement(group, e, [], in_flight)
        raise
    except BaseException as e:
        if e is not gave_up:  # out of the protocol's order: the engines cannot be followed any more
            group.broken = group.broken or f"{type(e).__name__} in the middle of an update: {e}"
        raise
