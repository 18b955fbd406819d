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

import datetime
import re
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from layerwise.transfer.base import (
    LoadWeights,
    TensorListUpdateInfo,
    WeightTransferEngine,
    WeightTransferError,
    WeightTransferInitInfo,
    WeightTransferTimeoutError,
)
from layerwise.transfer.packed_tensor import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    Bucket,
    BucketLayout,
    flat_bytes,
    plan_buckets,
    unpack_bucket,
)

DEFAULT_TIMEOUT_SECONDS = 60.0
_STORE_PREFIX = "layerwise/weight_transfer"
_CONNECTION_LOST = ("timed out", "timeout", "connection", "closed", "reset", "broken pipe", "aborted")


@dataclass
class NCCLWeightTransferInitInfo(WeightTransferInitInfo):
    """How to reach the trainer.

    Attributes:
        master_address / master_port: where the trainer (rank 0) hosts the group's TCPStore.
        rank_offset: rank of the engine's first worker (the trainer is rank 0, so usually 1).
        world_size: trainer + every engine worker.
        timeout_seconds: bound on every wait: rendezvous, each broadcast (seconds).
    """

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS

    def __post_init__(self):
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be an int in [1, 65535], got {self.master_port!r}")
        if not isinstance(self.world_size, int) or self.world_size < 2:
            raise ValueError(f"world_size must be an int >= 2 (trainer + engine), got {self.world_size!r}")
        if not isinstance(self.rank_offset, int) or not 0 < self.rank_offset < self.world_size:
            raise ValueError(f"rank_offset must be an int in [1, world_size), got {self.rank_offset!r}")
        if not self.timeout_seconds > 0:
            raise ValueError(f"timeout_seconds must be positive, got {self.timeout_seconds!r}")


@dataclass(kw_only=True)
class NCCLWeightTransferUpdateInfo(TensorListUpdateInfo):
    """One update: the tensors in send order, and how they are packed.

    Attributes:
        names / dtype_names / shapes / is_checkpoint_format: see TensorListUpdateInfo.
        packed: concatenate tensors into uint8 buckets (see layerwise/transfer/packed_tensor.py).
        packed_buffer_size_bytes: bytes per bucket (a larger tensor travels alone). Must equal the
            trainer's value.
        packed_num_buffers: buckets in flight (2 = double buffering). Must equal the trainer's value.
    """

    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.packed_buffer_size_bytes, int) or self.packed_buffer_size_bytes <= 0:
            raise ValueError(f"packed_buffer_size_bytes must be a positive int, got {self.packed_buffer_size_bytes!r}")
        if not isinstance(self.packed_num_buffers, int) or self.packed_num_buffers < 1:
            raise ValueError(f"packed_num_buffers must be an int >= 1, got {self.packed_num_buffers!r}")


@dataclass
class NCCLTrainerSendWeightsArgs:
    """Trainer-side arguments of :meth:`NCCLWeightTransferEngine.trainer_send_weights`.

    Attributes:
        group: the trainer's group, from :meth:`NCCLWeightTransferEngine.trainer_init`.
        src: the sending rank (the trainer: 0).
        packed / packed_buffer_size_bytes / packed_num_buffers: must equal the update info's.
    """

    group: WeightTransferGroup
    src: int = 0
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS


class WeightTransferGroup:
    """A broadcast group of its own: TCPStore (hosted by rank 0) -> PrefixStore -> Gloo or NCCL backend.

    Never touches torch.distributed's default group.

    Args:
        master_address / master_port: the store's address; rank 0 listens there.
        rank / world_size: this process's rank in the group, and the group's size.
        device: CUDA -> ProcessGroupNCCL, CPU -> ProcessGroupGloo; broadcast tensors live there.
        timeout_seconds: bound on the rendezvous and on every wait.
    Raises:
        WeightTransferTimeoutError: the rendezvous did not complete within the timeout (no trainer).
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
    ):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.timeout_seconds = float(timeout_seconds)
        self.timeout = datetime.timedelta(seconds=self.timeout_seconds)
        self.broken: str | None = None
        where = f"{master_address}:{master_port}"
        try:
            self.store = dist.TCPStore(
                master_address, master_port, world_size, rank == 0, timeout=self.timeout, wait_for_workers=False
            )
            prefix_store = dist.PrefixStore(_STORE_PREFIX, self.store)
            if self.device.type == "cuda":
                if not dist.is_nccl_available():
                    raise RuntimeError("this torch build has no NCCL; use a CPU device (gloo)")
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
                f"weight transfer: rank {rank} of {world_size} could not form the "
                f"group at {where} within {self.timeout_seconds:g} s: "
                f"{_first_line(e)}"
            ) from e

    def broadcast(self, tensor: torch.Tensor, src: int, key: str | None) -> Any:
        """Start broadcasting ``tensor`` (uint8, on ``device``) from ``src``; returns the work to wait on."""
        if self.broken:
            raise WeightTransferError(
                f"weight transfer group is unusable after an earlier failure ({self.broken}); "
                f"shutdown() and init again",
                key=key,
            )
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    return self.backend.broadcast([tensor], opts)
            return self.backend.broadcast([tensor], opts)
        except RuntimeError as e:
            raise self._failure(e, key, "starting a broadcast") from e

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

    def _failure(self, e: RuntimeError, key: str | None, what: str) -> WeightTransferError:
        self.broken = _first_line(e)
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


def _first_line(e: BaseException) -> str:
    """The backend's message without its C++ source location, cut at the first line / sentence hint."""
    line = (str(e).strip().splitlines() or [type(e).__name__])[0]
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(" This is typically")[0]
    return line[:200]


def _is_connection_loss(e: BaseException) -> bool:
    text = str(e).lower()
    return any(s in text for s in _CONNECTION_LOST)


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
            info.master_address, info.master_port, rank, info.world_size, self.device, info.timeout_seconds
        )

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo | dict, load_weights: LoadWeights) -> None:
        """Receive the update's tensors in the order of ``update_info.names`` and load them.

        Unpacked: each tensor is received into a buffer of its own (two in flight) and passed alone.
        Packed: bucket k is received into slot k % packed_num_buffers (uint8 [<= packed_buffer_size_bytes]);
        the next buckets' receives are posted before bucket k is loaded, and ``load_weights`` gets views
        of bucket k, which must be consumed or copied before it returns (the slot is refilled next).

        Raises:
            RuntimeError: init_transfer_engine was not called.
            WeightTransferTimeoutError: nothing arrived within ``timeout_seconds`` (or the trainer died);
                names the tensor waited for. The group is then unusable until re-initialized.
            whatever ``load_weights`` raised first; the rest of the update is received and dropped before.
        """
        group = self._require_group()
        info = self.parse_update_info(update_info)
        capacity = info.packed_buffer_size_bytes if info.packed else None
        num_slots = info.packed_num_buffers if info.packed else 2
        buckets = plan_buckets([info.nbytes(i) for i in range(len(info.names))], capacity)
        slot_bytes = max((b.nbytes for b in buckets if capacity is not None and b.nbytes <= capacity), default=0)
        slots: list[torch.Tensor | None] = [None] * num_slots

        def buffer_for(k: int) -> torch.Tensor:
            nbytes = buckets[k].nbytes
            if capacity is None or nbytes > capacity:  # unpacked, or a tensor larger than a bucket
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            s = k % num_slots
            if slots[s] is None:
                slots[s] = torch.empty(slot_bytes, dtype=torch.uint8, device=self.device)
            return slots[s][:nbytes]

        in_flight: deque = deque()
        posted, error = 0, None
        for k, bucket in enumerate(buckets):
            while posted < len(buckets) and posted < k + num_slots:  # slot of bucket `posted` was consumed
                buf = buffer_for(posted)
                in_flight.append((buf, group.broadcast(buf, 0, info.names[buckets[posted].entries[0][0]])))
                posted += 1
            buf, work = in_flight.popleft()
            group.wait(work, info.names[bucket.entries[0][0]], _bucket_label(bucket, k, len(buckets)))
            if error is None:
                try:
                    load_weights(unpack_bucket(buf, bucket, info.names, info.dtypes, info.shapes))
                except Exception as e:  # noqa: BLE001 -- Limitations 3: keep receiving, the trainer stays in step
                    error = e
            del buf
        if error is not None:
            raise error

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
        """Trainer side: host the store and join the group as rank 0.

        Args:
            init_info: the same init info the engines get (rank_offset is theirs, not the trainer's).
            device: where the trainer's tensors are broadcast from; default: the current CUDA device if
                CUDA is available, else CPU. Must be CUDA exactly when the engines' devices are.
        Returns:
            the group to pass as ``NCCLTrainerSendWeightsArgs.group``.
        Raises:
            WeightTransferTimeoutError: the engines did not join within ``timeout_seconds``.
        """
        if isinstance(init_info, dict):
            init_info = NCCLWeightTransferInitInfo(**init_info)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        return WeightTransferGroup(
            init_info.master_address, init_info.master_port, 0, init_info.world_size, device, init_info.timeout_seconds
        )

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: NCCLTrainerSendWeightsArgs | dict
    ) -> None:
        """Trainer side: broadcast every (name, tensor) of ``iterator`` to the engines.

        The order and the metadata must be those of the update info the engines were given (use
        :func:`layerwise.transfer.base.tensor_metadata` on the same pairs). Unpacked: each tensor's own
        bytes are broadcast (no copy when it is contiguous and on the group's device). Packed: tensors are
        copied into uint8 buckets of ``packed_buffer_size_bytes`` (a larger tensor alone); bucket k + 1 is
        packed while bucket k is in flight, at most ``packed_num_buffers`` buckets in flight.

        Raises:
            ValueError: ``src`` is not this process's rank.
            WeightTransferTimeoutError: an engine stopped receiving for ``timeout_seconds`` (or died).
        """
        args = NCCLTrainerSendWeightsArgs(**trainer_args) if isinstance(trainer_args, dict) else trainer_args
        group = args.group
        if group.rank != args.src:
            raise ValueError(
                f"trainer_send_weights runs on the sending rank: src={args.src}, this is rank {group.rank}"
            )
        capacity = args.packed_buffer_size_bytes if args.packed else None
        num_slots = args.packed_num_buffers if args.packed else 2
        layout = BucketLayout(capacity)
        slots: list[torch.Tensor | None] = [None] * num_slots
        pending: dict[int, tuple[str, torch.Tensor]] = {}  # index -> (name, flat bytes) of the open bucket
        in_flight: deque = deque()  # (work, buffer kept alive, key, label)
        sent = 0

        def send(bucket: Bucket) -> None:
            nonlocal sent
            if len(in_flight) >= num_slots:  # the slot of bucket `sent` is free once its last user is done
                work, _, key, label = in_flight.popleft()
                group.wait(work, key, label)
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
            key = pending[first][0]
            for i, _, _ in bucket.entries:
                del pending[i]
            in_flight.append(
                (
                    group.broadcast(buf, args.src, key),
                    buf,
                    key,
                    _bucket_label(bucket, sent, None),
                )
            )
            sent += 1

        for index, (name, tensor) in enumerate(iterator):
            if tensor.device != group.device:
                tensor = tensor.to(group.device)
            flat = flat_bytes(tensor)
            closed = layout.place(index, flat.numel())
            if closed is not None:
                send(closed)
            pending[index] = (name, flat)
        last = layout.close()
        if last is not None:
            send(last)
        while in_flight:
            work, _, key, label = in_flight.popleft()
            group.wait(work, key, label)
