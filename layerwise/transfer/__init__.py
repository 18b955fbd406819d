"""Weight sync from a trainer into a live model, named as vLLM's vllm/distributed/weight_transfer/.

Modules: ``base`` (WeightTransferEngine, the init/update info dataclasses, requests, transport errors),
``update`` (the engine side: start_weight_update / WeightUpdate.receive / finish_weight_update, and
update_weights), ``factory`` (WeightTransferEngineFactory, lazy), ``packed_tensor`` (the bucket layout, and
vLLM's ``packed_broadcast_producer`` / ``packed_broadcast_consumer``),
``nccl`` (broadcast over a group of its own: NCCL on CUDA, gloo on CPU), ``ipc`` (CUDA IPC / shared memory).
The backends ``nccl`` and ``ipc`` are imported only by ``WeightTransferEngineFactory.create_engine``.

Guarantees, and the limits that come with them (code that enforces one says "Limitations N"):

1. An update goes through the reload path: checkpoint-format tensors are routed by
   ``layerwise.routing.stream_weights`` and each module is re-quantized once complete, so the result equals
   a fresh ``load_model`` of the same weights bit for bit, in the same kernel tensors (data_ptrs unchanged).
   Everything of ``layerwise/reload/__init__.py``'s Limitations applies (exact coverage, partial updates,
   rollback, one session per model).
2. ``load_weights`` keeps no reference to the tensors it is given once it returns: a tensor whose module is
   still incomplete is copied to the CPU (the transport's bucket or shared memory is reused right away).
   That copy is the receiver's only buffering; ``max_buffered_bytes`` bounds it, and ``ReloadReport.
   peak_buffered_bytes`` reports it. The transport adds its own buffers (packed: up to
   ``packed_num_buffers`` buckets of ``packed_buffer_size_bytes`` on the device).
3. Every wait of the nccl backend is bounded by ``timeout_seconds``; a dead or stalled trainer raises
   WeightTransferTimeoutError (a ReloadError and a TimeoutError) naming the tensor, after the update was
   aborted (atomic: nothing changed; otherwise ``updated_modules`` lists what was). The group is unusable
   after that: shutdown() and init again. After a *bad tensor* instead, the engine keeps receiving (and
   dropping) the rest of the update, so the trainer completes its send and the group stays usable.
   Joining is bounded too: ``init_transfer_engine`` and ``trainer_init`` return or raise within
   ``timeout_seconds`` plus a poll (the message gives the true elapsed time), and each rank is admitted
   once: a second engine with a taken rank, or one late after the group formed, is refused with a
   WeightTransferError; a ``group_id`` in the init info makes an engine refuse a trainer hosting another
   group (``layerwise/transfer/rendezvous.py``). A rank that dies in the milliseconds between the
   rendezvous and the process group's own connection can still cost one more timeout.
4. Tied embeddings: ``lm_head.weight`` and ``model.embed_tokens.weight`` name one tensor, which stays one
   tensor. In checkpoint format whichever name arrives first in an update is loaded and the other is
   skipped (their values are not compared); in kernel format both names write that tensor, the last wins.
5. The ipc backend maps handles sent by the trainer, and unpickles them when they come pickled
   (``ipc_handles_pickled``) only with an opt-in: ``allow_pickled_handles=True`` in its init info, or vLLM's
   ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``; it must never receive handles from an untrusted process. CPU shared
   memory is /dev/shm (Linux), in segments named ``<segment_prefix>_<n>`` after the init info's prefix
   (drawn fresh as ``layerwise_<16 hex>`` unless given; pass it to the trainer as ``segment_prefix``). The
   trainer unlinks its segment when its send returns or raises; the engine removes exactly its prefix's
   segments at init, when receive_weights raises, at shutdown and on ``remove_segments()``, so a trainer
   killed with its resource tracker leaves nothing once the engine cleans up. Trainer and engine both
   SIGKILLed: the segment stays until an engine with that prefix inits, or reboot (``ls /dev/shm/<prefix>_*``).
6. Not thread-safe: one update per model at a time; ``update_weights`` holds the object's
   ``weight_update_lock()`` when it has one, so forward steps wait for the whole update.
7. The nccl backend's NCCL (CUDA) path and the ipc backend's CUDA path are tested only on a GPU machine
   (tests marked ``gpu``); a timed-out NCCL communicator is aborted, which needs a fresh group.
8. Sizes are agreed before bytes move (nccl backend, ``layerwise/transfer/wire.py``): before each bucket the
   trainer and the engines all-reduce its header (bytes, tensor count, a CRC-32 of names, dtypes and
   shapes, verify and the buckets in flight), and an end-of-update header after the last, so a trainer that
   sends another dtype or shape, a tensor too few or too many, or another packing raises WeightTransferError
   on both sides (the engine names the first tensor that differs and both sizes; the trainer its bucket's
   first tensor) before any collective with mismatched sizes (gloo would abort the process); nothing of
   that bucket is loaded, the update is aborted as in 3, and the group stays in step for the next update. A
   trainer whose iterator raises tells the engines at its next header (they raise naming its error; the
   group stays in step). Any other error in the middle of an update marks the group unusable.
   ``verify=True`` (update info and trainer args) compares a checksum of each bucket's bytes, sender's
   against receiver's, before it is loaded: CRC-32 on the CPU, Fletcher on CUDA; it catches bytes changed
   in transit or while the trainer sent them, not an adversary. Cost: one all-reduce round trip per bucket
   on the engine's path when loading a bucket takes less (unpacked: per tensor; gloo here ~1 ms each). Not detected: a
   trainer that sends other *values* of the declared names, dtypes and shapes (wrong weights are
   weights); the non-finite check (Limitations of the reload) still applies. On CUDA (NCCL) the agreement
   and the Fletcher checksum have not run on GPUs yet (the NCCL tests need two); the Fletcher code is tested
   on the CPU against plain Python.
"""

from layerwise.transfer.base import (
    TensorListUpdateInfo,
    WeightTransferEngine,
    WeightTransferError,
    WeightTransferInitInfo,
    WeightTransferInitRequest,
    WeightTransferTimeoutError,
    WeightTransferUpdateInfo,
    WeightTransferUpdateRequest,
    tensor_metadata,
)
from layerwise.transfer.factory import WeightTransferEngineFactory
from layerwise.transfer.update import (
    WeightUpdate,
    abort_weight_update,
    current_weight_update,
    finish_weight_update,
    receive_weight_update,
    start_weight_update,
    update_weights,
)

__all__ = [
    "TensorListUpdateInfo",
    "WeightTransferEngine",
    "WeightTransferEngineFactory",
    "WeightTransferError",
    "WeightTransferInitInfo",
    "WeightTransferInitRequest",
    "WeightTransferTimeoutError",
    "WeightTransferUpdateInfo",
    "WeightTransferUpdateRequest",
    "WeightUpdate",
    "abort_weight_update",
    "current_weight_update",
    "finish_weight_update",
    "receive_weight_update",
    "start_weight_update",
    "tensor_metadata",
    "update_weights",
]
