"""Layerwise load and reload machinery, named as in vLLM's model_loader/reload package.

Modules, in the order a load passes through them: ``session`` (the lifecycle: record_metadata_for_reloading
-> initialize_layerwise_reload -> finalize_layerwise_reload or abort_layerwise_reload, the
``layerwise_session`` context manager, the CPU staging buffer kept between reloads), ``buffering``
(online_process_loader: each wrapped loader call recorded on meta, held and counted until its module or
unit is complete), ``processing`` (a complete module materialized, replayed, processed, then committed
into the kernel tensors or staged), ``units`` (the same per processing unit of a FusedMoE), ``pieces`` (a
weight quantized from its loaded tensors themselves), ``coverage`` (what a module's or unit's writes lack,
as the errors name it), ``deferred`` (NaN/Inf checks made on the device and read at finalize or per
batch). Beneath them: ``types`` (LayerReloadingInfo, ReloadSession, element-interval coverage),
``counting`` (what a weight loader writes, measured on the meta device), ``meta`` (moving a module
between kernel format and checkpoint format on meta). Imports flow one way: session -> buffering ->
processing, units -> pieces, coverage, deferred -> types, counting, meta. ``kernel_format`` (copying
kernel-format tensors in place) is the path of a kernel-format reload, outside the session.

Guarantees, and the limits that come with them (code that enforces one says "Limitations N"):

1. Coverage is exact per element: every loader call is replayed on the meta parameter and the
   regions it writes are recorded, so a region written twice or never is an error naming the
   parameter. Cost: one meta-device run of each loader (no data), and a loader must write through
   ``copy_`` / ``fill_`` / ``zero_`` to be seen.
2. Tensors of a module still waiting for its other tensors are buffered on the CPU, never on the
   device. A stream that scatters one module's tensors far apart holds them in host memory until
   the module completes (``peak_buffered_bytes`` reports it); there is no bound on that host memory.
3. On a reload, modules absent from the stream keep their values (partial updates); a module that
   received part of its elements is an error. A first load must provide every element.
4. Failure leaves the model usable: a failed reload restores every module not yet overwritten and
   lists the overwritten ones (``ReloadError.updated_modules``); ``atomic=True`` stages everything
   and commits at the end, at the cost of the processed size of the streamed modules in device
   memory. A failed first load leaves the model on the meta device (nothing half-written to use).
5. The state lives on the modules (``module._layerwise_info``, ``model._layerwise_session``), never
   in a module-level registry, so a deleted model is freed by the garbage collector.
6. Tied parameters are one module (the LM head *is* embed_tokens), so they are loaded and
   reloaded once; a checkpoint's separate ``lm_head.weight`` is skipped when tied.
7. One session per model at a time; sessions are not thread-safe.
8. On the GPU every module is materialized in fresh allocations (the caching allocator reuses them). On
   the CPU, where fresh memory costs page faults (and page-cache reclaim) on every first write, modules
   are materialized in one reused staging buffer (``meta.StagingBuffer``): a first load stages the
   modules whose weight processing replaces and frees the buffer at its end; a reload stages every
   module and keeps the buffer on the model (``model._layerwise_staging``, the size of the largest
   module staged, in the checkpoint dtype) for the next reload, which then allocates almost nothing.
   ``release_staging(model)`` frees it; ``staging_bytes(model)`` reports it. Two cases skip staging
   (Limitations 10 and 11), so a reload may keep no buffer at all.
9. A module that declares processing units (``FusedMoE``: ``processing_unit(param_name, shard_id)``
   -> ``(param_name, i)``, i.e. ``param[i]``, one expert's w13 or w2) is counted, buffered and
   processed per unit: only one unit is ever materialized in the checkpoint dtype, and it is
   quantized straight into its slice of the layer's kernel tensors (allocated at the first unit; on a
   reload the live kernel tensors, so every data_ptr is kept). Its loader must write only
   ``param[i]`` (checked on meta for every load recorded). A module whose loader writes unit i's load
   as unit 0's moved by i units says so (``unit_shard_origin(shard_id)``: FusedMoE): its loads are then
   recorded once for unit 0 and translated (3 meta runs an MoE layer, not 3 per expert). A reload may
   bring any subset of whole units (partial reload of some experts; the module is reported updated); a
   unit partly written is an error naming the missing checkpoint keys. A failed non-atomic reload
   reports the module as updated as soon as one unit was written; atomic stages a copy of the whole
   layer's kernel tensors. A complete unit whose loads are all unread checkpoint tensors (lazy: holding
   them costs nothing) that the quant method takes as pieces (10) is not processed at once: it waits
   in ``pending_units`` until the module's last unit (or finalize, for a partial reload), and then
   every waiting unit is quantized in one ``process_experts`` call: all their scales first (on CPU one
   native pass per parameter over all their pieces, in parallel), then all their bytes; a NaN or Inf in
   any of them is raised, naming its key, before anything is written (a session with ``defer_checks``
   writes them and reports it at finalize, 12).
10. A weight whose every load is a verbatim copy (``counting.record_loader``: the whole loaded tensor,
   same dtype, into one contiguous region; no TP slice, cast or transpose) of a tensor already on the
   session's device is not materialized: a quant method that accepts pieces
   (``accepts_weight_pieces``: FP8 dense and MoE, when the pieces are whole rows for per-channel and
   per-block scales, a 128-row block shared by two pieces taking its scale from both; torchao per-row
   float8 on CPU, quant/torchao.py Limitations 5) quantizes the
   loaded tensors themselves, a checkpoint tensor as read into host memory (13) or the trainer's stream
   tensor, straight into its FP8 tensor (a non-atomic reload: the live one). The weight stays on meta
   meanwhile. Loads that do not qualify are staged and replayed as before.
11. On a non-atomic reload, a module whose kernel tensors are its checkpoint-format parameters (no
   quant method, or ``checkpoint_format``: BF16 linears, embeddings, norms) has its loads replayed
   straight into its live tensors (verbatim loads of CPU tensors by one native pass that copies and checks
   finiteness, ``cpu_native.copy_checked``), and an FP8 method writes its bytes into the live weight
   (``process_weights_after_loading(into=...)``) once its scale is known. Such a module is
   overwritten before its finiteness check: one that then fails the check is reported as updated
   (``ReloadError.updated_modules``) and holds the new values, NaN included. ``atomic=True`` keeps the
   all-or-nothing behaviour.
12. A session with ``defer_checks`` (``reload_weights`` of a list or tuple, and a checkpoint-format weight
   update, on CUDA without tensor parallelism: ``deferred.model_defers_checks``) makes no host read of its own
   while it streams modules
   (BF16, FP8, and torchao weights of a shape already checked against torchao's bytes), so the GPU is
   not left idle while Python routes the next module: its NaN/Inf checks (``check_finite``, the FP8
   scale's amax) append a device flag instead of raising (``layerwise.kernels.finite``), its copies of
   pinned host tensors in their own dtype return at once (``quant.parameters.async_host_copies``; a
   pageable source still holds the host for its copy), and a buffered load of a device tensor keeps the
   caller's tensor instead of a host copy (2). The session's CUDA device is made current for the stream
   (Triton launches on the current device). Finalize waits for the device and reads every flag at once.
   The cost: a module holding NaN or Inf is processed and written like the others, and so is every
   module after it; finalize then aborts and raises an error naming each such module and the key
   holding the value, whose ``updated_modules`` lists every module written. ``atomic=True`` still
   changes nothing (the flags are read before the commit). Another error that ends the stream first is
   raised as before, with the NaN modules already written in ``ReloadError.non_finite_modules``. The
   stream's tensors must stay unchanged until the call returns: finalize and abort wait for the device
   before returning. A weight update differs in three ways: it reads its checks at the end of each
   ``load_weights`` batch (``check_deferred``), while the batch is still valid, and raises a NaN there,
   naming its key (the NaN module and the rest of the batch written first; staged and dropped when atomic);
   every ``load_weights`` call on CUDA waits for the device before it returns, so the transport may refill,
   and a trainer reuse, the batch's memory; and it still copies a device tensor it buffers across batches to
   the host (``borrow_device_tensors=False``), a copy that waits for the device. Unit-wise modules (9) defer
   theirs too, a flag per processing call (one expert, or a module's queued experts at once), and are named
   once however many of their experts held a NaN. The checks of what a quantization produced from finite
   weights (torchao's float8 makes NaN from an all-zero row, quant/torchao.py Limitations 6) are deferred the
   same way and named with the module and the scheme at finalize.
13. A checkpoint directory may change while it is read (a trainer writing its next checkpoint into it). Each
   shard's size, ``st_mtime_ns`` and inode (``st_dev``, ``st_ino``) are recorded when the ``Checkpoint`` opens
   it (``checkpoint.FileIdentity``) and compared (``fstat`` of the open descriptor, ``stat`` of the path)
   before and after every tensor is read, and once more after the stream's last tensor, before finalize
   commits. A shard truncated, rewritten in place, replaced (``os.replace``: another inode at its path) or
   deleted is a ``CheckpointChangedError`` naming the file and what changed (``size a -> b bytes``, ``mtime``,
   ``replaced by another file``), which a reload raises as a ReloadError through the abort of (4): with
   ``atomic=True`` nothing changed; otherwise ``updated_modules`` lists the modules written, each from the
   file as it was when opened (a tensor read while its file changed never reaches the model). A first load
   raises the CheckpointChangedError itself (the model stays on meta, 4). A reload reads each tensor (only a
   slice's bytes under tensor parallelism) with ``os.preadv`` at the header's offsets into host memory, never
   through a memory map, so a shard cut short is that error (a short read too), not SIGBUS. The cost: a copy
   of every byte into host buffers, reused within the reload, where a mapping let the loaders read the page
   cache in place (10's pieces included), and host memory for the tensors read at once, the largest one at
   least (on CPU anonymous memory, which ``DeviceMemoryTracker`` does not count, as it did not count mapped
   pages; RssAnon does). ``Checkpoint(path, mmap=True)`` reads views of the memory map instead (no copy; what a
   first load does unless ``load_model(..., mmap=False)``, having no live model to lose): checked the same
   way before each read, but a shard truncated while a view is used still kills the process with SIGBUS,
   and one rewritten in place while a view is used mixes.
   So do ``Checkpoint.get_tensor`` and iterating a ``Checkpoint`` (the streams callers build, and a
   kernel-format reload from a directory, ``is_checkpoint_format=False``). Not detected: a writer that keeps a
   file's size and inode and rewrites it within one tick of the file system's mtime clock (milliseconds on
   Linux, seconds on FAT and some network file systems), or sets the mtime back (``os.utime``); that needs a
   content check, a hash of every shard (a second pass over its bytes). A unit still queued at finalize (9, a
   partial reload) is read after the stream's last check: its own read is checked, a change after it is not
   seen (nothing is mixed: every value is from the files as they were opened).
"""

from layerwise.reload.buffering import online_process_loader
from layerwise.reload.session import (
    abort_layerwise_reload,
    finalize_layerwise_reload,
    get_layerwise_info,
    initialize_layerwise_reload,
    layerwise_session,
    record_metadata_for_reloading,
    release_staging,
    staging_bytes,
)
from layerwise.reload.types import LayerReloadingInfo

__all__ = [
    "LayerReloadingInfo",
    "abort_layerwise_reload",
    "finalize_layerwise_reload",
    "get_layerwise_info",
    "initialize_layerwise_reload",
    "layerwise_session",
    "online_process_loader",
    "record_metadata_for_reloading",
    "release_staging",
    "staging_bytes",
]
