"""The engine side of a weight update: start -> receive (any number of times) -> finish, or abort.

Design after vLLM's start_weight_update / update_weights / finish_weight_update
(``vllm/distributed/weight_transfer/base.py``), on layerwise's own reload session:

    start_weight_update(model, is_checkpoint_format, atomic)
        checkpoint format: initialize_layerwise_reload (kernel tensors set aside, loaders wrapped)
        kernel format:     index the model's parameters and buffers by name
    WeightUpdate.receive(transfer_engine, update_info)  -> transfer_engine.receive_weights(info, load_weights)
    WeightUpdate.load_weights([(name, tensor), ...])
        checkpoint format: layerwise.routing.stream_weights, one tensor at a time (the reload path);
                           a module is re-quantized and written (or staged, atomic) once complete
        kernel format:     name / dtype / shape / NaN-Inf checked, then copied in place (or staged)
    finish_weight_update(model)
        checkpoint format: finalize_layerwise_reload (atomic: commit the staged modules)
        kernel format:     atomic: commit the staged tensors
    any error: abort (every module not yet overwritten keeps its values), ReloadError naming the tensor

:func:`update_weights` does all three for one request. The state of an update in progress lives on the
model (``model.__dict__``), never in a module-level registry.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from layerwise.errors import (
    LayerwiseError,
    ReloadError,
)
from layerwise.reload.deferred import check_deferred, model_defers_checks, on_device
from layerwise.reload.kernel_format import KernelTensorWriter
from layerwise.reload.session import (
    abort_layerwise_reload,
    finalize_layerwise_reload,
    get_layerwise_info,
    initialize_layerwise_reload,
)
from layerwise.reload.types import ReloadReport
from layerwise.routing import stream_weights
from layerwise.transfer.base import WeightTransferEngine, WeightTransferError, WeightTransferUpdateRequest

_UPDATE_ATTR = "_layerwise_weight_update"  # on the model, between start and finish/abort
_TIED_NAMES = ("model.embed_tokens.weight", "lm_head.weight")


def _model_of(model_or_engine: Any) -> nn.Module:
    if isinstance(model_or_engine, nn.Module):
        return model_or_engine
    model = getattr(model_or_engine, "model", None)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"expected an nn.Module or an object with a .model nn.Module (an Engine), got "
            f"{type(model_or_engine).__name__}"
        )
    return model


class WeightUpdate:
    """One weight update of a live model, between :func:`start_weight_update` and finish or abort.

    Not thread-safe; one update per model at a time. Use it through the module functions, or directly:
    ``update.receive(transfer_engine, update_info)`` / ``update.load_weights(pairs)`` / ``update.finish()``.

    Attributes:
        is_checkpoint_format / atomic: as given to :func:`start_weight_update`.
        updated: modules (checkpoint format) or tensor names (kernel format) overwritten so far.
        closed: finished or aborted.
    """

    def __init__(self, model: nn.Module, is_checkpoint_format: bool, atomic: bool, max_buffered_bytes: int | None):
        self.model = model
        self.is_checkpoint_format = is_checkpoint_format
        self.atomic = atomic
        self.max_buffered_bytes = max_buffered_bytes
        self.start = time.perf_counter()
        self.updated: list[str] = []
        self.closed = False
        self.session = None
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self._tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
        self._tied_seen: str | None = None  # which of the tied names arrived first
        self._writer: KernelTensorWriter | None = None  # kernel format
        if is_checkpoint_format:  # Limitations 12 on CUDA: one host read per batch, not one per module
            self.session = initialize_layerwise_reload(
                model, atomic=atomic, defer_checks=model_defers_checks(model), borrow_device_tensors=False
            )
        else:
            self._writer = KernelTensorWriter(model, atomic)
            self.updated = self._writer.updated  # one list: what the writer has written so far

    # -- receiving -------------------------------------------------------------------------------
    def receive(self, transfer_engine: WeightTransferEngine, update_info: Any) -> None:
        """``transfer_engine.receive_weights(update_info, self.load_weights)``; aborts on any error.

        Args:
            update_info: the backend's typed update info, or its dict.
        Raises:
            ReloadError: a bad tensor (names it) or a format mismatch; the update is aborted.
            WeightTransferTimeoutError / WeightTransferError: the transport failed; the update is aborted.
            ValueError: ``update_info`` does not parse (nothing was received; the update stays open).
        """
        self._check_open()
        info = transfer_engine.parse_update_info(update_info)
        load = self.load_weights
        if info.is_checkpoint_format != self.is_checkpoint_format:
            mismatch = LayerwiseError(
                f"the update info says is_checkpoint_format={info.is_checkpoint_format}, "
                f"but this update was started with {self.is_checkpoint_format}"
            )

            def load(weights):  # refuse every batch; the backend still drains the transfer
                raise mismatch

        try:
            transfer_engine.receive_weights(info, load)
        except BaseException as e:
            self._fail(e)
            raise  # only for BaseExceptions that _fail re-raises unchanged

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Feed (name, tensor) pairs into the update (the ``load_weights`` of ``receive_weights``).

        After it returns no reference to the given tensors is kept (a module still waiting for its
        other tensors holds a copy, on the CPU), so the caller may reuse their memory.

        Raises:
            ReloadError: an unknown name, a wrong shape or dtype, a NaN/Inf, a region written twice, or
                more than ``max_buffered_bytes`` buffered; names the tensor (``key``), lists
                ``updated_modules``; the update is aborted.
        """
        self._check_open()
        batch = list(weights)
        try:
            with on_device(self.device):
                if self.is_checkpoint_format:
                    for name, tensor in batch:
                        self._load_checkpoint_tensor(name, tensor)
                else:
                    for name, tensor in batch:
                        self._writer.write(name, tensor)
                # queued copies may still read the batch, which the caller may reuse (a trainer's IPC tensors) or
                # the transport refill once this returns: wait for the device (and read the deferred checks)
                if self.session is not None and self.session.defer_checks:
                    check_deferred(self.session)
                elif self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
        except BaseException as e:
            self._fail(e)
            raise
        finally:
            if self.session is not None and not self.closed:
                self._own_buffered(batch)

    def _load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> None:
        route = name  # an integer tensor is refused by the parameter's loader (quant.parameters.check_loaded_dtype)
        if self._tied and name in _TIED_NAMES:  # Limitations 4: one tied weight, whichever name arrives
            if self._tied_seen not in (None, name):
                return
            self._tied_seen, route = name, _TIED_NAMES[0]
        try:
            stream_weights(self.model, [(route, tensor)])
        except LayerwiseError as e:
            e.key = name  # the name the trainer sent
            raise
        limit = self.max_buffered_bytes
        if limit is not None and self.session.buffered_bytes > limit:
            raise LayerwiseError(
                f"the receiver holds {self.session.buffered_bytes} bytes of tensors waiting for "
                f"the rest of their module, more than max_buffered_bytes={limit}; send each "
                f"module's tensors together",
                key=name,
            )

    def _own_buffered(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """Replace buffered CPU views of the batch's memory by copies (Limitations 2)."""
        storages = {t.untyped_storage().data_ptr() for _, t in batch if t.device.type == "cpu"}
        if not storages:
            return
        for module in self.session.modules.values():
            info = get_layerwise_info(module)
            units = [state.loaded_weights for state in info.units.values()]  # an MoE layer's per-expert loads
            for buffered in itertools.chain(info.loaded_weights, *units):
                w = buffered.loaded_weight
                if w.device.type == "cpu" and w.untyped_storage().data_ptr() in storages:
                    buffered.loaded_weight = w.clone()

    # -- ending ----------------------------------------------------------------------------------
    def finish(self) -> ReloadReport:
        """Complete the update: commit staged values (atomic), restore untouched modules.

        Returns:
            a ReloadReport: ``updated_modules`` (module prefixes, or tensor names for kernel format),
            ``seconds`` since start, ``peak_buffered_bytes`` (bytes of tensors held on the CPU for
            incomplete modules; 0 for kernel format).
        Raises:
            ReloadError: a module received only part of its tensors (names the parameters); the update
                is aborted (atomic: nothing changed).
        """
        self._check_open()
        peak = 0
        try:
            if self.is_checkpoint_format:
                with on_device(self.device):
                    session = finalize_layerwise_reload(self.model)
                self.updated, peak = list(session.processed), session.peak_buffered_bytes
            else:
                self._writer.commit()
        except ReloadError:
            self._close()  # finalize restored the model itself
            raise
        except BaseException as e:
            self._fail(e)
            raise
        self._close()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the model's device, whichever is current
        return ReloadReport(self.updated, time.perf_counter() - self.start, peak)

    def abort(self) -> list[str]:
        """End the update, keeping every value not yet overwritten. Returns what was overwritten
        (module prefixes or tensor names; empty when atomic, unless the commit itself failed midway).
        A no-op returning [] on a closed update."""
        if self.closed:
            return []
        if self.is_checkpoint_format:
            with on_device(self.device):
                self.updated = abort_layerwise_reload(self.model)
        if self._writer is not None:
            self._writer.discard()
        self._close()
        # exact in both modes: an atomic update lists only what its commit wrote before it failed
        return list(self.updated)

    def _fail(self, e: BaseException) -> None:
        """Abort, and turn ``e`` into a ReloadError listing the overwritten modules (raised from here)."""
        already_closed = self.closed
        updated = self.abort()
        if already_closed or not isinstance(e, Exception):
            return  # an error raised by an inner call that failed already, or KeyboardInterrupt & co
        non_finite = list(self.session.non_finite_modules) if self.session is not None else []
        if isinstance(e, WeightTransferError):
            note = ReloadError.note(updated, non_finite)
            err = type(e)(
                f"{e.message}; {note}", updated_modules=updated, key=e.key, file=e.file, non_finite_modules=non_finite
            )
            err.cause = e.cause
            raise err from e
        if isinstance(e, ReloadError):
            return
        # a LayerwiseError (a NaN found at the end of a batch, Limitations 12, among them), or any other exception
        # of the trainer's stream or of torch: name what was overwritten, and what holds NaN or Inf
        raise ReloadError.wrap(e, updated, action="weight update", non_finite_modules=non_finite) from e

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this weight update was already finished or aborted")

    def _close(self) -> None:
        self.closed = True
        if self.model.__dict__.get(_UPDATE_ATTR) is self:
            del self.model.__dict__[_UPDATE_ATTR]


def start_weight_update(
    model_or_engine: Any,
    is_checkpoint_format: bool = True,
    *,
    atomic: bool = False,
    max_buffered_bytes: int | None = None,
) -> WeightUpdate:
    """Open a weight update on a model loaded by :func:`layerwise.load_model` (or an Engine's model).

    Args:
        model_or_engine: the model, or any object with a ``.model`` (an Engine).
        is_checkpoint_format: True: Hugging Face names and dtypes, re-quantized module by module (the
            reload path); False: the model's own kernel-format names and dtypes, copied after checks.
        atomic: keep the old values until :func:`finish_weight_update` (costs, on the model's device, the
            kernel-format bytes of every module in the update); without it each module is overwritten
            as soon as it is complete (and checked; on CUDA without tensor parallelism the checks of a batch
            are read at its end, so a module holding NaN is written first: Limitations 12). On a CPU model,
            a checkpoint-format update, like a reload, keeps its staging buffer (the largest module in the
            checkpoint dtype) on the model for the next one (``layerwise.reload.release_staging`` frees it).
        max_buffered_bytes: fail (instead of running out of host memory) when tensors waiting for the rest
            of their module exceed this many bytes; None = no limit.
    Returns:
        the open :class:`WeightUpdate` (also kept on the model until finish/abort).
    Raises:
        RuntimeError: an update or reload is already in progress on this model.
        TypeError: not a model or an object with a ``.model``.
    """
    model = _model_of(model_or_engine)
    if model.__dict__.get(_UPDATE_ATTR) is not None:
        raise RuntimeError("a weight update is already in progress on this model")
    update = WeightUpdate(model, is_checkpoint_format, atomic, max_buffered_bytes)
    model.__dict__[_UPDATE_ATTR] = update
    return update


def current_weight_update(model_or_engine: Any) -> WeightUpdate | None:
    """The open update of this model, or None."""
    return _model_of(model_or_engine).__dict__.get(_UPDATE_ATTR)


def _open_update(model_or_engine: Any) -> WeightUpdate:
    update = current_weight_update(model_or_engine)
    if update is None:
        raise RuntimeError("no weight update in progress on this model: call start_weight_update first")
    return update


def receive_weight_update(model_or_engine: Any, transfer_engine: WeightTransferEngine, update_info: Any) -> None:
    """Receive one update (or one chunk of it) into the open update; see :meth:`WeightUpdate.receive`."""
    _open_update(model_or_engine).receive(transfer_engine, update_info)


def finish_weight_update(model_or_engine: Any) -> ReloadReport:
    """Finish the open update; see :meth:`WeightUpdate.finish`."""
    return _open_update(model_or_engine).finish()


def abort_weight_update(model_or_engine: Any) -> list[str]:
    """Abort the open update, if any; returns what it had overwritten (see :meth:`WeightUpdate.abort`)."""
    update = current_weight_update(model_or_engine)
    return update.abort() if update is not None else []


def _update_info_of(request: Any) -> Any:
    if isinstance(request, WeightTransferUpdateRequest):
        return request.update_info
    if isinstance(request, dict) and set(request) == {"update_info"}:
        return request["update_info"]
    return request  # an update-info dict or a typed update info


def update_weights(
    model_or_engine: Any,
    transfer_engine: WeightTransferEngine,
    request: Any,
    *,
    atomic: bool = False,
    max_buffered_bytes: int | None = None,
) -> ReloadReport:
    """Start, receive and finish one weight update: the one call an engine process makes per update.

    Every kernel tensor keeps its object, storage and data_ptr (captured CUDA graphs stay valid). If the
    object has a ``weight_update_lock()`` context manager (an Engine), the whole update runs under it,
    so no forward step sees a half-written model.

    Args:
        model_or_engine: a model from :func:`layerwise.load_model`, or an object with ``.model``.
        transfer_engine: an initialized backend (``WeightTransferEngineFactory.create_engine``).
        request: a WeightTransferUpdateRequest, a dict ``{"update_info": {...}}``, the update-info dict
            itself, or the backend's typed update info. Its ``is_checkpoint_format`` picks the path.
        atomic / max_buffered_bytes: see :func:`start_weight_update`.
    Returns:
        a ReloadReport (updated modules, seconds, peak buffered bytes).
    Raises:
        ValueError: the update info does not parse (unknown or missing fields are named).
        ReloadError: a bad tensor, named; ``updated_modules`` lists what was overwritten (none if atomic)
            and the rest of the model keeps its previous values.
        WeightTransferTimeoutError (a ReloadError and a TimeoutError): the trainer sent nothing for
            ``timeout_seconds`` or died; same guarantees on the model.
    """
    info = transfer_engine.parse_update_info(_update_info_of(request))
    lock = getattr(model_or_engine, "weight_update_lock", None)
    with lock() if callable(lock) else contextlib.nullcontext() as scope:
        update = start_weight_update(
            model_or_engine, info.is_checkpoint_format, atomic=atomic, max_buffered_bytes=max_buffered_bytes
        )
        try:
            update.receive(transfer_engine, info)
            report = update.finish()
            if scope is not None:  # an Engine's lock fills in what it does after the change (KV-cache calibration)
                scope.report = report
            return report
        finally:
            update.abort()  # no-op once finished; closes the update after an unexpected error


__all__ = [
    "WeightUpdate",
    "abort_weight_update",
    "current_weight_update",
    "finish_weight_update",
    "receive_weight_update",
    "start_weight_update",
    "update_weights",
]
