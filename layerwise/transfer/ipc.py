"""Backend "ipc": a trainer and an engine on the same machine share memory instead of sending bytes.

Design after vLLM's ``vllm/distributed/weight_transfer/ipc_engine.py`` (CUDA IPC handles from
``torch.multiprocessing.reductions.reduce_tensor``, carried by the update info) and its packed IPC
producer (``packed_tensor.py``: one reusable buffer, one chunk per request).

    trainer                                                    engine
    trainer_send_weights(iterator, args):
      CUDA tensor -> reduce_tensor(tensor) (no copy)
      CPU tensor  -> copied into a shared-memory segment
      every buffer_size_bytes: args.send_update(update info) --> receive_weight_update(model, engine, info)
                               (blocks until the engine is done)     maps each tensor, load_weights([(name, t)])

Security: a handle names memory of the trainer process, and mapping it reads that memory; pickled
(``ipc_handles_pickled``, base64 of a pickle: what travels over JSON/HTTP), unpickling it can run arbitrary
code. Handles must never come from, or travel through, an untrusted process. The engine unpickles only with
an explicit opt-in: ``allow_pickled_handles=True`` in its init info, or vLLM's environment flag
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (an integer, non-zero = on, read when each update arrives, as vLLM).
Handles given as objects (``ipc_handles``, e.g. through Ray, which vLLM's "ray" mode uses) need no opt-in,
as in vLLM; a CUDA one is rebuilt only by ``rebuild_cuda_tensor``, never by a function it names.

vLLM compatibility (``vllm/distributed/weight_transfer/ipc_engine.py``): init info ``{}`` is accepted (vLLM's
has no fields); a CUDA handle may be vLLM's per-tensor ``{gpu_uuid: (rebuild_cuda_tensor, args)}`` or
``{gpu_uuid: args}``; the trainer takes vLLM's ``mode`` / ``send_mode`` ("ray", "http" or a callable),
``llm_handle``, ``url``, ``packed`` and ``packed_buffer_size_bytes`` (see IPCTrainerSendWeightsArgs).

Shared-memory segments (CPU tensors; CUDA tensors are shared in place and need none). One engine and one
trainer at a time share a *segment prefix*, ``IPCWeightTransferInitInfo.segment_prefix``
(``layerwise_<16 hex digits>`` drawn fresh by default, or one of your own: file-name characters only).
The trainer names each segment it creates ``<prefix>_<n>`` (n a decimal number), and the engine removes
exactly the names ``/dev/shm/<prefix>_<n>``, nothing else (no other prefix, no other shape of name):

    init_info = IPCWeightTransferInitInfo(allow_pickled_handles=True)    # draws segment_prefix
    engine:  engine.init_transfer_engine(dataclasses.asdict(init_info))
    trainer: trainer_send_weights(weights, {"send_update": ..., "segment_prefix": init_info.segment_prefix})

An engine given init info without ``segment_prefix`` draws its own at ``init_transfer_engine``: read it
from ``engine.segment_prefix`` and hand it to the trainer with the rest of your control plane.

Who removes a segment, and when:
  1. the trainer, when ``trainer_send_weights`` returns or raises (its ``finally``);
  2. the trainer's multiprocessing resource tracker, when the trainer process ends without (1) (a SIGKILL
     of the trainer alone, os._exit) while the tracker lives on; the tracker ignores SIGINT and SIGTERM,
     so only a SIGKILL of the tracker too (of the process group, the container, the OOM killer) stops it;
  3. the engine, every ``<prefix>_<n>``: at ``init_transfer_engine`` (leftovers of an earlier engine with
     this prefix), when ``receive_weights`` raises (the update failed: the trainer is waiting for that
     answer, and a trainer killed mid-update left its segment), at ``shutdown()``, and when you call
     ``remove_segments()`` (e.g. after your control plane timed out on a trainer that died between chunks,
     which the engine cannot see). The engine removes segments only at these points, so it must not run
     them while a trainer still fills a segment for another chunk: one trainer per prefix, and init /
     shutdown / remove_segments between updates.
What still leaks:
  - trainer, tracker and engine all killed with SIGKILL (a container or process group killed, the OOM
    killer): the segment stays until an engine with the same prefix inits, or the machine reboots;
  - a trainer that passed no ``segment_prefix`` (older call sites): it names its segments with a prefix of
    its own, which no engine removes, so only (1) and (2) apply.
Find leftovers with ``ls /dev/shm/<prefix>_*`` (all of layerwise's: ``ls /dev/shm/layerwise_*``); remove
them with ``rm`` once no trainer or engine of that prefix runs.
"""

from __future__ import annotations

import base64
import itertools
import os
import pickle
import re
import secrets
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from layerwise.transfer.base import (
    LoadWeights,
    TensorListUpdateInfo,
    WeightTransferEngine,
    WeightTransferInitInfo,
    dtype_name,
)
from layerwise.transfer.packed_tensor import DEFAULT_PACKED_BUFFER_SIZE_BYTES, Bucket, BucketLayout, flat_bytes

_SHM_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,250}$")  # a file name in /dev/shm, no path
_SHM_DIR = "/dev/shm"
_SEGMENT_PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")  # <prefix>_<n> stays a valid _SHM_NAME
_SEGMENT_NUMBERS = itertools.count()  # the <n> of this process's segments, never reused by it
_ONE_CHUNK = 1 << 62  # chunk capacity of an update sent in one call (vLLM's unpacked IPC transfer)


def new_segment_prefix() -> str:
    """A fresh segment prefix, ``layerwise_<16 hex digits>`` (64 random bits)."""
    return f"layerwise_{secrets.token_hex(8)}"


def check_segment_prefix(prefix: str) -> str:
    """``prefix`` itself if it can name segments ``/dev/shm/<prefix>_<n>``.

    Raises:
        ValueError: not a str of 1-200 file-name characters (letters, digits, ``_.-``; not starting with
            ``.`` or ``-``; no ``/``).
    """
    if not isinstance(prefix, str) or not _SEGMENT_PREFIX.fullmatch(prefix):
        raise ValueError(
            f"segment_prefix {prefix!r} must be 1-200 characters of [A-Za-z0-9_.-], not starting with '.' "
            f"or '-' (it names files /dev/shm/<prefix>_<n>)"
        )
    return prefix


def segment_names(prefix: str) -> list[str]:
    """The names in /dev/shm of the form ``<prefix>_<n>`` (n decimal digits), sorted; [] without /dev/shm."""
    own = re.compile(re.escape(check_segment_prefix(prefix)) + r"_[0-9]+")
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return []
    return sorted(name for name in entries if own.fullmatch(name))


@dataclass
class IPCWeightTransferInitInfo(WeightTransferInitInfo):
    """Init info of the ipc backend.

    Every field is optional: ``{}`` is accepted, as vLLM's IPC init info (which has none).

    Attributes:
        allow_pickled_handles: opt in to unpickling the trainer's handles (``ipc_handles_pickled``); the
            environment flag ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (vLLM's) opts in too. Set either only when
            the trainer, and everything the update info passes through, is trusted (see the module docstring).
        segment_prefix: the trainer names its shared-memory segments ``<segment_prefix>_<n>`` and the
            engine removes those (see the module docstring). Drawn fresh by default
            (``new_segment_prefix()``), so build this info once and give its prefix to the trainer too.
    Raises (on construction):
        ValueError: a segment_prefix that is not a file-name prefix (see ``check_segment_prefix``).
    """

    allow_pickled_handles: bool = False
    segment_prefix: str = field(default_factory=new_segment_prefix)

    def __post_init__(self):
        check_segment_prefix(self.segment_prefix)


@dataclass(kw_only=True)
class IPCWeightTransferUpdateInfo(TensorListUpdateInfo):
    """One chunk of an update: the tensors, and one handle per tensor.

    Attributes:
        names / dtype_names / shapes / is_checkpoint_format: see TensorListUpdateInfo.
        ipc_handles: one handle per tensor, as objects: ``{"shm_name": str, "offset": int}`` (bytes
            [offset, offset + nbytes) of a shared-memory segment), ``{"gpu_uuid": str, "cuda":
            (rebuild_cuda_tensor, args)}`` (``reduce_tensor`` of a CUDA tensor), or vLLM's per-tensor map of
            physical GPU UUID to ``(rebuild_cuda_tensor, args)`` or to ``args`` (the engine takes its GPU's).
        ipc_handles_pickled: the same list as base64 of its pickle (for JSON control planes, as vLLM's HTTP mode).
        Exactly one of the two is given; the pickled form is decoded only by an engine that opted in.
    """

    ipc_handles: list | None = None
    ipc_handles_pickled: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if (self.ipc_handles is None) == (self.ipc_handles_pickled is None):
            raise ValueError("update info: give exactly one of ipc_handles and ipc_handles_pickled")
        if self.ipc_handles is not None and len(self.ipc_handles) != len(self.names):
            raise ValueError(
                f"update info: ipc_handles has {len(self.ipc_handles)} entries, names has {len(self.names)}"
            )


@dataclass
class IPCTrainerSendWeightsArgs:
    """Trainer-side arguments of :meth:`IPCWeightTransferEngine.trainer_send_weights`: ours, and vLLM's.

    How each chunk's update info reaches the engine: exactly one of ``send_update`` (ours), ``send_mode`` or
    ``mode`` (vLLM's IPCTrainerSendWeightsArgs; ``mode`` in vLLM up to 0.21, ``send_mode`` after).

    Attributes:
        send_update: delivers one update-info dict (JSON-able, with ``ipc_handles_pickled``) to the engine,
            which passes it to ``receive_weight_update`` (or ``WeightUpdate.receive``); must return only once
            the engine is done with it, since the trainer then reuses the memory. Raises what the engine raised.
            Chunks of ``buffer_size_bytes``.
        send_mode / mode: as vLLM's. A callable: called as ``send_update`` is, once per chunk, with the chunk's
            update-info dict (vLLM passes its dataclass). "ray": ``ray.get(h.update_weights.remote({"update_info":
            info}))`` for each handle of ``llm_handle`` (one or a list), with ``ipc_handles`` as objects (Ray
            carries them; no opt-in needed). "http": POST ``{"update_info": info}`` as JSON to
            ``{url}/update_weights`` (handles pickled: the server's engine needs the opt-in); layerwise ships no
            such server: the endpoint is yours, calling ``Engine.update_weights(request)``. As vLLM, everything
            goes in one update unless ``packed``.
        llm_handle: Ray actor handle(s) with an ``update_weights`` method ("ray" only).
        url: the HTTP server's base URL ("http" only).
        packed / packed_buffer_size_bytes: as vLLM's: with ``send_mode`` or ``mode``, split the update into
            chunks of ``packed_buffer_size_bytes`` (one update call each: the receiver must keep one weight
            update open across them, e.g. ``start_weight_update`` ... ``finish_weight_update``).
        buffer_size_bytes: bytes of tensors per chunk with ``send_update``; a larger tensor is alone. CPU
            tensors are copied into one shared-memory segment of up to a chunk's size, reused for every chunk.
        is_checkpoint_format: written into every chunk's update info.
        segment_prefix: the engine's ``segment_prefix`` (its init info's); segments are named
            ``<segment_prefix>_<n>``, so the engine removes what a killed trainer left. None (older call
            sites, and vLLM's trainers): a fresh prefix per call, which no engine removes (see the module
            docstring).
    Raises (on construction):
        ValueError: no transport or more than one, "ray" without ``llm_handle``, "http" without ``url``,
            another mode string, or a segment_prefix that is not a file-name prefix (see
            ``check_segment_prefix``).
    """

    send_update: Callable[[dict], Any] | None = None
    buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    is_checkpoint_format: bool = True
    segment_prefix: str | None = None
    send_mode: str | Callable[[dict], Any] | None = None
    mode: str | None = None
    llm_handle: Any = None
    url: str | None = None
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES

    def __post_init__(self):
        given = [n for n in ("send_update", "send_mode", "mode") if getattr(self, n) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of send_update, send_mode and mode (vLLM's), got {given or 'none'}")
        transport = self.transport
        if not callable(transport):
            if transport not in ("ray", "http"):
                raise ValueError(f"{given[0]} must be 'ray', 'http' or a callable, got {transport!r}")
            if transport == "ray" and self.llm_handle is None:
                raise ValueError(f"{given[0]}='ray' needs llm_handle (a Ray actor handle, or a list of them)")
            if transport == "http" and not self.url:
                raise ValueError(f"{given[0]}='http' needs url (the server's base URL)")
        if self.segment_prefix is not None:
            check_segment_prefix(self.segment_prefix)

    @property
    def transport(self) -> str | Callable[[dict], Any]:
        """The callable, "ray" or "http": whichever of send_update / send_mode / mode is given."""
        return next(t for t in (self.send_update, self.send_mode, self.mode) if t is not None)

    @property
    def chunk_bytes(self) -> int | None:
        """Bytes per chunk; None: one chunk (vLLM's unpacked transfer)."""
        if self.send_update is not None:
            return self.buffer_size_bytes
        return self.packed_buffer_size_bytes if self.packed else None


def insecure_serialization_allowed() -> bool:
    """vLLM's opt-in to unpickling: the environment variable ``VLLM_ALLOW_INSECURE_SERIALIZATION`` holds a
    non-zero integer (read now; unset, empty or not an integer: off)."""
    value = os.environ.get("VLLM_ALLOW_INSECURE_SERIALIZATION", "0").strip()
    try:
        return int(value) != 0
    except ValueError:
        return False


def _send_over_ray(llm_handle: Any, info: dict) -> None:
    import ray  # only a trainer that asks for "ray" needs it

    handles = llm_handle if isinstance(llm_handle, list) else [llm_handle]
    ray.get([handle.update_weights.remote({"update_info": info}) for handle in handles])


def _send_over_http(url: str, info: dict) -> None:
    import json
    import urllib.request

    body = json.dumps({"update_info": info}).encode()
    request = urllib.request.Request(
        f"{url.rstrip('/')}/update_weights", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=300) as response:  # raises HTTPError on a 4xx/5xx answer
        response.read()


def _gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def _map_segment(name: str, tensor_name: str) -> torch.Tensor:
    """The whole shared-memory segment ``name`` as a uint8 tensor (a MAP_SHARED mapping, released with the
    last view of it; no Python buffer export, no resource tracker)."""
    if not isinstance(name, str) or not _SHM_NAME.match(name.lstrip("/")):
        raise ValueError(f"ipc handle of tensor {tensor_name!r}: {name!r} is not a shared-memory segment name")
    path = os.path.join(_SHM_DIR, name.lstrip("/"))
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise ValueError(f"ipc handle of tensor {tensor_name!r}: no shared-memory segment {name!r} ({e})") from e
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


class IPCWeightTransferEngine(WeightTransferEngine[IPCWeightTransferInitInfo, IPCWeightTransferUpdateInfo]):
    """Receive weights from a trainer on the same machine through CUDA IPC or shared memory.

    Design: vLLM's ``IPCWeightTransferEngine`` (vllm/distributed/weight_transfer/ipc_engine.py). Tensors are
    mapped, not copied: ``load_weights`` reads the trainer's memory directly. CPU shared memory is Linux's
    /dev/shm.

    Args:
        device: the engine's CUDA device, whose UUID a CUDA handle must name (ignored for CPU handles).
    """

    init_info_cls = IPCWeightTransferInitInfo
    update_info_cls = IPCWeightTransferUpdateInfo

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__(device)
        self.allow_pickled_handles: bool | None = None  # None until init_transfer_engine
        self.segment_prefix: str | None = None  # set by init_transfer_engine, None again after shutdown

    def init_transfer_engine(self, init_info: IPCWeightTransferInitInfo | dict) -> None:
        """Record the opt-in and the segment prefix, and remove this prefix's leftover segments.

        Leftovers are ``/dev/shm/<segment_prefix>_<n>`` of an earlier engine with the same prefix whose
        trainer was killed with its resource tracker (see the module docstring). Called again with
        another prefix, the engine first removes the old prefix's segments.

        ``{}`` is accepted (vLLM's IPC init info has no fields): no opt-in to pickled handles (unless
        ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``), and a fresh segment prefix.

        Raises:
            ValueError: an unknown field, a non-bool ``allow_pickled_handles``, or a ``segment_prefix`` that is
                not a file-name prefix.
        """
        info = self.parse_init_info(init_info)
        if not isinstance(info.allow_pickled_handles, bool):
            raise ValueError(f"allow_pickled_handles must be a bool, got {info.allow_pickled_handles!r}")
        if self.segment_prefix not in (None, info.segment_prefix):
            self.remove_segments()  # the previous prefix's: no trainer of it will be answered any more
        self.allow_pickled_handles = info.allow_pickled_handles
        self.segment_prefix = info.segment_prefix
        self.remove_segments()

    def remove_segments(self) -> list[str]:
        """Unlink every ``/dev/shm/<segment_prefix>_<n>``; returns the names removed.

        Unlinking does not disturb a mapping already open (the trainer's, or a view ``load_weights`` still
        holds); a trainer that then ends removes nothing more. A name that cannot be removed (another
        user's, by the sticky bit of /dev/shm) is skipped with a warning. Call it only between updates, or
        once a trainer has died (see the module docstring; Limitations 5 in layerwise/transfer/__init__.py).

        Raises:
            RuntimeError: init_transfer_engine was not called.
        """
        if self.segment_prefix is None:
            raise RuntimeError("ipc weight transfer is not initialized: call init_transfer_engine() first")
        removed = []
        for name in segment_names(self.segment_prefix):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except FileNotFoundError:
                continue  # its trainer unlinked it meanwhile
            except OSError as e:
                warnings.warn(f"ipc weight transfer: cannot remove shared-memory segment {name!r}: {e}", stacklevel=2)
                continue
            removed.append(name)
        return removed

    def receive_weights(self, update_info: IPCWeightTransferUpdateInfo | dict, load_weights: LoadWeights) -> None:
        """Map each tensor of the chunk and call ``load_weights([(name, tensor)])`` for it, one at a time.

        If the chunk fails once its update info parsed (a bad handle, ``load_weights`` raising), the update
        is over: this engine's segments are removed (``remove_segments``) before the error propagates, so a
        trainer killed mid-update leaves nothing behind (a live trainer, waiting for this answer, keeps its
        mapping and ends without removing anything more).

        Raises:
            RuntimeError: init_transfer_engine was not called.
            ValueError: update info that does not parse (nothing removed); ``ipc_handles_pickled`` without the
                opt-in (``allow_pickled_handles=True`` or ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; nothing is
                unpickled); a handle that is malformed, for another GPU, or of another dtype/shape than the
                update info says (names the tensor).
            whatever ``load_weights`` raised.
        """
        if self.allow_pickled_handles is None:
            raise RuntimeError("ipc weight transfer is not initialized: call init_transfer_engine() first")
        info = self.parse_update_info(update_info)
        try:
            self._receive(info, load_weights)
        except BaseException:
            self.remove_segments()
            raise

    def _receive(self, info: IPCWeightTransferUpdateInfo, load_weights: LoadWeights) -> None:
        handles = info.ipc_handles
        if handles is None:
            if not (self.allow_pickled_handles or insecure_serialization_allowed()):
                raise ValueError(
                    "refusing to unpickle ipc_handles_pickled (unpickling can run code): opt in with "
                    "allow_pickled_handles=True in the init info or VLLM_ALLOW_INSECURE_SERIALIZATION=1, and only "
                    "for a trusted trainer on this machine"
                )
            handles = pickle.loads(base64.b64decode(info.ipc_handles_pickled))  # opted in
            if not isinstance(handles, list) or len(handles) != len(info.names):
                raise ValueError(
                    f"update info: ipc_handles_pickled holds {type(handles).__name__} of "
                    f"{len(handles) if isinstance(handles, list) else '?'} entries, names has "
                    f"{len(info.names)}"
                )
        segments: dict[str, torch.Tensor] = {}
        try:
            for i, name in enumerate(info.names):
                tensor = self._open(handles[i], i, info, segments)
                load_weights([(name, tensor)])
                del tensor
        finally:
            segments.clear()  # unmaps each segment once load_weights dropped its views

    def _open(
        self, handle: Any, i: int, info: IPCWeightTransferUpdateInfo, segments: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        name, dtype, shape, nbytes = info.names[i], info.dtypes[i], info.shapes[i], info.nbytes(i)
        if not isinstance(handle, dict):
            raise ValueError(f"ipc handle of tensor {name!r} must be a dict, got {type(handle).__name__}")
        if "shm_name" in handle:
            offset = handle.get("offset")
            segment = segments.get(handle["shm_name"])
            if segment is None:
                segment = segments[handle["shm_name"]] = _map_segment(handle["shm_name"], name)
            if (
                not isinstance(offset, int)
                or offset < 0
                or offset + nbytes > segment.numel()
                or offset % dtype.itemsize
            ):
                raise ValueError(
                    f"ipc handle of tensor {name!r}: offset {offset!r} + {nbytes} bytes does not fit "
                    f"segment {handle['shm_name']!r} of {segment.numel()} bytes (aligned to "
                    f"{dtype.itemsize})"
                )
            return segment[offset : offset + nbytes].view(dtype).view(shape)
        if "cuda" not in handle:  # vLLM's: {physical GPU UUID: (rebuild_cuda_tensor, args) or args}
            handle = self._vllm_cuda_handle(handle, name)
        if "cuda" in handle:
            func, args = handle["cuda"]
            if func is not rebuild_cuda_tensor:
                raise ValueError(
                    f"ipc handle of tensor {name!r}: refusing to call {func!r} (expected "
                    f"torch.multiprocessing.reductions.rebuild_cuda_tensor)"
                )
            device = self.device if self.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
            if handle.get("gpu_uuid") != _gpu_uuid(device):
                raise ValueError(
                    f"ipc handle of tensor {name!r} is for GPU {handle.get('gpu_uuid')}, this engine "
                    f"runs on {device} ({_gpu_uuid(device)})"
                )
            args = list(args)
            args[6] = device.index if device.index is not None else torch.cuda.current_device()  # storage device
            tensor = func(*args)
            if tensor.dtype != dtype or list(tensor.shape) != list(shape):
                raise ValueError(
                    f"ipc handle of tensor {name!r} maps {tensor.dtype}{tuple(tensor.shape)}, the update "
                    f"info says {dtype}{tuple(shape)}"
                )
            return tensor
        raise ValueError(f"ipc handle of tensor {name!r} has neither 'shm_name' nor 'cuda': {sorted(handle)}")

    def _vllm_cuda_handle(self, handle: dict, name: str) -> dict:
        """vLLM's per-tensor handle ``{gpu_uuid: (rebuild_cuda_tensor, args)}`` or ``{gpu_uuid: args}`` as ours
        (``{"gpu_uuid", "cuda"}``) for this engine's GPU; ``handle`` itself when it is not one."""
        if not handle or not all(isinstance(k, str) and isinstance(v, (tuple, list)) for k, v in handle.items()):
            return handle
        if not torch.cuda.is_available():
            raise ValueError(
                f"ipc handle of tensor {name!r} maps CUDA memory (GPUs {sorted(handle)}), and this "
                f"process has no CUDA device"
            )
        device = self.device if self.device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        uuid = _gpu_uuid(device)
        if uuid not in handle:
            raise ValueError(
                f"ipc handle of tensor {name!r} has no entry for this engine's GPU {uuid} "
                f"({device}); it has {sorted(handle)}"
            )
        value = tuple(handle[uuid])
        cuda = value if len(value) == 2 and callable(value[0]) else (rebuild_cuda_tensor, value)
        return {"gpu_uuid": uuid, "cuda": cuda}

    def shutdown(self) -> None:
        """Remove this engine's segments (``remove_segments``) and forget the opt-in. Safe to call twice."""
        if self.segment_prefix is not None:
            self.remove_segments()
        self.allow_pickled_handles = None
        self.segment_prefix = None

    @staticmethod
    def trainer_send_weights(
        iterator: Iterator[tuple[str, torch.Tensor]], trainer_args: IPCTrainerSendWeightsArgs | dict
    ) -> None:
        """Trainer side: share every (name, tensor) of ``iterator`` with the engine, chunk by chunk.

        CUDA tensors are shared in place (``reduce_tensor``, no copy; the trainer must not modify them until
        this returns). CPU tensors are copied into a shared-memory segment ``<segment_prefix>_<n>`` of up to
        ``buffer_size_bytes`` (a larger tensor gets a segment of its own size), reused by the next chunk
        once ``send_update`` returned, and unlinked when this returns or raises (the engine removes it if
        this process is killed with its resource tracker; see the module docstring). Each chunk is one
        ``send_update(update_info_dict)`` call whose dict carries ``ipc_handles_pickled`` (or one call of
        vLLM's ``send_mode`` / ``mode`` transport: see :class:`IPCTrainerSendWeightsArgs`).

        ``trainer_args`` may be vLLM's: e.g. ``{"send_mode": "http", "url": ...}``; such a trainer needs no
        GPU for CPU tensors (vLLM's always reads its current CUDA device).

        Raises:
            ValueError: trainer args that do not construct (e.g. a bad ``segment_prefix``, no transport).
            whatever ``send_update`` (or the transport: Ray's error, urllib's HTTPError) raised; the segment is
                unlinked all the same.
        """
        args = IPCTrainerSendWeightsArgs(**trainer_args) if isinstance(trainer_args, dict) else trainer_args
        prefix = args.segment_prefix if args.segment_prefix is not None else new_segment_prefix()
        layout = BucketLayout(args.chunk_bytes if args.chunk_bytes is not None else _ONE_CHUNK)
        pending: dict[int, tuple[str, torch.Tensor]] = {}
        segment: list[shared_memory.SharedMemory | None] = [None]

        def send(bucket: Bucket) -> None:
            cpu = [(i, off, n) for i, off, n in bucket.entries if pending[i][1].device.type == "cpu"]
            if cpu:
                size = max(off + n for _, off, n in cpu)
                if segment[0] is None or segment[0].size < size:
                    _unlink(segment[0])
                    segment[0] = None
                    segment[0] = _create_segment(prefix, max(size, 1))
                base = torch.frombuffer(segment[0].buf, dtype=torch.uint8, count=size)
                for i, off, n in cpu:
                    base[off : off + n].copy_(flat_bytes(pending[i][1]))
                del base  # no export of the segment's buffer may outlive this copy
            names, dtypes, shapes, handles = [], [], [], []
            for i, off, _ in bucket.entries:
                name, tensor = pending.pop(i)
                names.append(name)
                dtypes.append(dtype_name(tensor.dtype))
                shapes.append(list(tensor.shape))
                if tensor.device.type == "cpu":
                    handles.append({"shm_name": segment[0].name, "offset": off})
                else:
                    handles.append({"gpu_uuid": _gpu_uuid(tensor.device), "cuda": reduce_tensor(tensor)})
            info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
            info["is_checkpoint_format"] = args.is_checkpoint_format
            transport = args.transport
            if transport == "ray":  # Ray carries the handles as objects, as vLLM's "ray" mode
                _send_over_ray(args.llm_handle, dict(info, ipc_handles=handles))
                return
            info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode("ascii")
            if transport == "http":
                _send_over_http(args.url, info)
            else:
                transport(info)

        try:
            for index, (name, tensor) in enumerate(iterator):
                tensor = tensor.detach()
                if tensor.device.type == "cuda":
                    tensor = tensor.contiguous()
                closed = layout.place(index, tensor.numel() * tensor.element_size())
                if closed is not None:
                    send(closed)
                pending[index] = (name, tensor)
            last = layout.close()
            if last is not None:
                send(last)
        finally:
            _unlink(segment[0])


def _create_segment(prefix: str, size: int) -> shared_memory.SharedMemory:
    """A new segment ``<prefix>_<n>`` of ``size`` bytes (created exclusively; registered with this process's
    resource tracker, which unlinks it if the process ends without ``_unlink``)."""
    for _ in range(1000):
        name = f"{prefix}_{next(_SEGMENT_NUMBERS)}"
        try:
            return shared_memory.SharedMemory(name=name, create=True, size=size)
        except FileExistsError:
            continue  # another process's of this prefix, or a leftover the engine has not removed yet
    raise RuntimeError(f"no free shared-memory segment name {prefix}_<n> after 1000 tries (ls /dev/shm/{prefix}_*)")


def _unlink(segment: shared_memory.SharedMemory | None) -> None:
    """Close and unlink the trainer's segment; the engine may have unlinked it already (a failed update)."""
    if segment is None:
        return
    try:
        segment.close()
    finally:
        try:
            segment.unlink()
        except FileNotFoundError:
            # unlink() unregisters from the resource tracker only after it removed the name itself; without
            # this the tracker would remove, when this process ends, a later segment that reuses the name
            resource_tracker.unregister("/" + segment.name, "shared_memory")
