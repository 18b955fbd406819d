"""Per-module and per-session state of a layerwise load or reload (vLLM's LayerReloadingInfo)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from layerwise.checkpoint import decoder_layer


@dataclass
class BufferedLoad:
    """One deferred ``weight_loader(param, loaded_weight, shard_id)`` call.

    ``loaded_weight`` stays where it came from if it is on the CPU (a memory-mapped checkpoint view
    costs no memory), and is moved to the CPU otherwise, so buffered tensors never sit on the device.
    """

    param_name: str
    loaded_weight: torch.Tensor
    shard_id: Any
    key: str | None
    #: flat element offset where the loader copies ``loaded_weight`` verbatim (whole, same dtype, one
    #: contiguous region: :func:`layerwise.reload.counting.record_loader`), else None
    verbatim_at: int | None = None


def _buffered_bytes(loads: list[BufferedLoad]) -> int:
    return sum(b.loaded_weight.numel() * b.loaded_weight.element_size() for b in loads)


@dataclass
class UnitState:
    """Loads of one processing unit of a unit-wise module (``FusedMoE``: expert e's w13 or w2).

    Attributes:
        load_numel: elements written so far (counted on the meta device).
        writes: flat [start, stop) element intervals written so far, relative to the unit's first element.
        loaded_weights: buffered loader calls, replayed into the unit once it is complete.
        done: the unit is complete in this session: processed (written into the kernel-format tensors), or
            waiting in its module's ``pending_units`` to be processed with others.
    """

    load_numel: int = 0
    writes: list = field(default_factory=list)
    loaded_weights: list[BufferedLoad] = field(default_factory=list)
    done: bool = False


@dataclass
class LayerReloadingInfo:
    """State of one module with parameters of its own (vLLM's "layer") across a load or reload.

    Attributes:
        prefix: the module's dotted name in the model ("model.layers.0.self_attn.qkv_proj").
        restore_metadata: the module's checkpoint-format parameters on the meta device, recorded
            once when the model is created (they cost no memory and carry the typed loaders).
        weight_loaders: the original (unwrapped) weight_loader of each of those parameters.
        load_numel_total: elements the checkpoint must write for the module to be complete.
        load_numel: elements written so far in this load (counted on the meta device).
        writes: per parameter, the flat [start, stop) element intervals written so far, so
            coverage can be checked exactly (a double write cannot hide a missing region).
        loaded_weights: the buffered loader calls, replayed once the module is complete.
        kernel_tensors: the module's processed parameters and buffers from the previous load, whose
            storage a reload writes into (empty during the first load).
        staged: processed values waiting for an atomic reload to commit them.
        done: the module was completed and processed in the current session.
        unit_numel: for a unit-wise module (one with ``processing_unit``, e.g. FusedMoE), the elements of
            one unit of each parameter: a unit (param_name, i) is ``param[i]``. Empty for other modules.
        units: unit -> its UnitState in this session (unit-wise modules; written by online_process_loader).
        unit_targets: the kernel-format tensors the units are processed into, set at the first unit:
            fresh on a first load, the kernel tensors themselves on a reload, a staged copy when atomic.
        units_done: units processed in this session; the module is done at ``units_total``.
        pending_units: complete units whose loads are all unread checkpoint tensors taken verbatim, waiting to be
            quantized together (at the module's last unit, or at finalize after a partial reload).
        units_started: a unit's processing began in this session: its kernel tensors may be partly
            overwritten even if that unit failed (a non-atomic reload reports the module as updated).
        recorded: what each distinct loader call writes (``counting.record_loader`` results by parameter, loaded
            shape, strides, dtype and shard_id), kept across sessions: the meta run is made once per distinct call.
        in_place: a non-atomic reload wrote the module's kernel tensors directly (its loads replayed
            into them, or its quant method wrote ``into`` them): overwritten even if a check then failed.
    """

    prefix: str
    restore_metadata: dict[str, nn.Parameter]
    weight_loaders: dict[str, Callable]
    load_numel_total: int
    load_numel: int = 0
    writes: dict[str, list] = field(default_factory=dict)
    loaded_weights: list[BufferedLoad] = field(default_factory=list)
    kernel_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    done: bool = False
    unit_numel: dict[str, int] = field(default_factory=dict)
    units: dict[Hashable, UnitState] = field(default_factory=dict)
    unit_targets: dict[str, torch.Tensor] = field(default_factory=dict)
    units_done: int = 0
    pending_units: list = field(default_factory=list)
    units_started: bool = False
    units_total: int = 0
    in_place: bool = False
    recorded: dict = field(default_factory=dict)
    session: ReloadSession | None = None

    def reset(self) -> None:
        """Forget everything about the current session (buffers, counts, staged values)."""
        self.load_numel = 0
        self.writes = {name: [] for name in self.restore_metadata}
        self.loaded_weights = []
        self.staged = {}
        self.done = False
        self.units = {}
        self.unit_targets = {}
        self.units_done = 0
        self.pending_units = []
        self.in_place = False
        self.units_started = False


@dataclass
class DeferredCheck:
    """The finiteness checks of one processed module, made on the device and read at finalize (a session with
    ``defer_checks``, Limitations 12).

    Attributes:
        prefix: the module.
        flag: 0-d bool tensor on the session's device, True when a checked tensor held NaN or Inf.
        loads: the module's buffered loads (the stream's own tensors, valid until the checks are read: the caller
            holds them), read again only to name the key holding the NaN or Inf.
    """

    prefix: str
    flag: torch.Tensor
    loads: list[BufferedLoad]


@dataclass
class ReloadSession:
    """State of one load or reload of a whole model (between initialize and finalize).

    Attributes:
        device: where the modules are materialized.
        modules: prefix -> module, for every module with a LayerReloadingInfo.
        first_load: True while loading into a model created on the meta device.
        atomic: processed modules are staged and committed only at finalize.
        processed: prefixes of the modules completed so far, in order.
        updated_before_abort: after an abort, the modules whose kernel tensors had already been
            overwritten (set by :func:`layerwise.reload.session.layerwise_session`).
        buffered_bytes / peak_buffered_bytes: bytes of checkpoint tensors held in buffers (on CPU)
            by incomplete modules, now and at most during this session (memory-mapped views count,
            though they cost only page cache).
        committed: modules finalize has already closed with new values (committed staged values, or
            processed before): what an abort must still report if finalize fails midway.
        staging: the buffer modules are materialized in, on CPU (see ``meta.StagingBuffer``); None on
            other devices (CUDA's caching allocator already reuses freed blocks) and after the session.
        unit_bytes: module prefix -> the most checkpoint-format bytes materialized at once on the device
            for it: the whole module, or, for a unit-wise module, its largest processing unit (one
            expert's w13). The session's transient device memory is about the largest of these.
        defer_checks: finiteness checks are made on the device and read once, at finalize (or at the end of
            each batch of a weight update, :func:`layerwise.reload.deferred.check_deferred`); host-to-device
            copies do not wait (Limitations 12).
        borrow_device_tensors: a buffered load of a device tensor keeps the caller's tensor instead of a host
            copy (with ``defer_checks`` on a stream the caller holds until the session ends: a reload of a
            list; not a weight update, whose transport refills its buffers).
        deferred: the checks of the modules processed so far, with ``defer_checks``.
        non_finite_modules: with ``defer_checks``, the modules written with NaN or Inf: found by
            ``check_deferred`` (a weight update's batch), or by the abort after another error ended the
            session (their checks were not read yet). Never staged modules of an atomic session.
    """

    device: torch.device
    modules: dict[str, nn.Module]
    first_load: bool
    atomic: bool = False
    processed: list[str] = field(default_factory=list)
    updated_before_abort: list[str] = field(default_factory=list)
    buffered_bytes: int = 0
    peak_buffered_bytes: int = 0
    unit_bytes: dict[str, int] = field(default_factory=dict)
    committed: list[str] = field(default_factory=list)
    staging: Any = None  # a layerwise.reload.meta.StagingBuffer on CPU (reused module memory), else None
    defer_checks: bool = False
    borrow_device_tensors: bool = False
    deferred: list[DeferredCheck] = field(default_factory=list)
    non_finite_modules: list[str] = field(default_factory=list)


def intervals_of_view(offset: int, sizes: tuple, strides: tuple) -> tuple[np.ndarray, int]:
    """Flat element intervals covered by a strided view of a contiguous storage.

    Args:
        offset: the view's storage_offset (elements); sizes/strides: the view's shape and strides.
    Returns:
        (starts int64 [n], length): the view covers [s, s + length) for each s in starts.
    """
    dims = [(s, st) for s, st in zip(sizes, strides, strict=True) if s != 1]
    if any(s == 0 for s in sizes):
        return np.zeros(0, dtype=np.int64), 0
    if not dims:
        return np.array([offset], dtype=np.int64), 1
    merged = [list(dims[-1])]
    for size, stride in reversed(dims[:-1]):
        inner_size, inner_stride = merged[0]
        if stride == inner_size * inner_stride:
            merged[0] = [inner_size * size, inner_stride]
        else:
            merged.insert(0, [size, stride])
    length = 1
    if merged[-1][1] == 1:
        length = merged.pop()[0]
    starts = np.array([offset], dtype=np.int64)
    for size, stride in merged:
        starts = (starts[:, None] + np.arange(size, dtype=np.int64)[None, :] * stride).reshape(-1)
    return starts, length


def coverage(writes: list, numel: int) -> tuple[int, int]:
    """(elements never written, elements written more than once) for one parameter.

    Args:
        writes: list of (starts, length) from :func:`intervals_of_view`.
        numel: the parameter's number of elements.
    """
    if not writes:
        return numel, 0
    starts = np.concatenate([s for s, _ in writes])
    stops = np.concatenate([s + n for s, n in writes])
    order = np.argsort(starts, kind="stable")
    starts, stops = starts[order], stops[order]
    reach = np.maximum.accumulate(stops)
    prev_reach = np.concatenate([[0], reach[:-1]])
    written = int((stops - starts).sum())
    overlap = int(np.clip(prev_reach - starts, 0, stops - starts).sum())
    covered = written - overlap
    return numel - covered, overlap


def unwritten_in_range(writes: list, start: int, stop: int) -> int:
    """Elements of [start, stop) that no interval of ``writes`` ((starts, length) pairs) covers."""
    clipped = []
    for starts, length in writes:
        lo = np.clip(starts, start, stop)
        hi = np.clip(starts + length, start, stop)
        keep = hi > lo
        clipped.extend((np.array([a - start]), int(b - a)) for a, b in zip(lo[keep], hi[keep], strict=True))
    return coverage(clipped, stop - start)[0]


@dataclass
class ReloadReport:
    """What a reload changed.

    Attributes:
        updated_modules: prefixes of the modules (with parameters of their own) whose kernel
            tensors received new values, e.g. "model.layers.0.self_attn.qkv_proj"; for a
            kernel-format reload, the parameter and buffer names written.
        seconds: wall-clock duration.
        peak_buffered_bytes: most bytes of incoming tensors held (on CPU) by modules waiting for
            their remaining tensors; 0 for a stream that arrives one whole module at a time on CPU
            memory it already owns (memory-mapped checkpoint views are counted too).
        kv_scales_recalibrated: an Engine with an FP8 KV cache recalibrated its K/V scales after this change
            (always, when it has one); False for a model without an engine.
        kv_calibration_seconds: how long that took (not part of ``seconds``).
    """

    updated_modules: list = field(default_factory=list)
    seconds: float = 0.0
    peak_buffered_bytes: int = 0
    kv_scales_recalibrated: bool = False
    kv_calibration_seconds: float = 0.0

    @property
    def updated_decoder_layers(self) -> list[int]:
        """Indices of the decoder layers at least one of whose modules was updated."""
        return sorted({i for i in map(decoder_layer, self.updated_modules) if i is not None})
