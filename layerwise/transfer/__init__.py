"""Weight sync from a trainer into a live model, named as vLLM's vllm/distributed/weight_transfer/.

Modules: ``base`` (WeightTransferEngine, the init/update info dataclasses, requests, transport errors),
``update`` (the engine side: start_weight_update / WeightUpdate.receive / finish_weight_update, and
update_weights), ``factory`` (WeightTransferEngineFactory, lazy), ``packed_tensor`` (the bucket layout),
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
4. Tied embeddings: ``lm_head.weight`` and ``model.embed_tokens.weight`` name one tensor, which stays one
   tensor. In checkpoint format whichever name arrives first in an update is loaded and the other is
   skipped (their values are not compared); in kernel format both names write that tensor, the last wins.
5. The ipc backend unpickles and maps handles sent by the trainer: it works only with
   ``allow_pickled_handles=True`` and must never receive handles from an untrusted process. CPU shared
   memory is /dev/shm (Linux).
6. Not thread-safe: one update per model at a time; ``update_weights`` holds the object's
   ``weight_update_lock()`` when it has one, so forward steps wait for the whole update.
7. The nccl backend's NCCL (CUDA) path and the ipc backend's CUDA path are tested only on a GPU machine
   (tests marked ``gpu``); a timed-out NCCL communicator is aborted, which needs a fresh group.
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
