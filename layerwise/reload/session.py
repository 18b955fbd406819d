"""The session of a layerwise load, reload or weight update: record -> initialize -> load_weights -> finalize.

The sequence and names follow vLLM (model_loader/reload/layerwise.py). In vLLM's names a "layer" is any module with
parameters of its own; the prose here calls it a *module* (qkv_proj, norm, embed_tokens) and keeps *decoder layer*
for the repeated block. A load passes through these stages, each in its own file:

    record_metadata_for_reloading(model)   session      once, while the model's parameters are on meta
    initialize_layerwise_reload(model)     session      kernel tensors set aside, meta params + wrapped loaders
    model.load_weights(weights)            buffering    each loader call recorded on meta, held and counted by
                                                        online_process_loader; a module whose elements are all
                                                        written is handed on to
                                           processing   coverage -> materialize -> replay ->
                                                        process_weights_after_loading -> copy into the kernel
                                                        tensors (reload) or stage them (atomic) -> drop buffers
                                           units        (FusedMoE) the same per unit, one expert at a time
    finalize_layerwise_reload(model)       session      deferred checks read (deferred), queued units processed,
                                                        what incomplete modules lack named (coverage), staged
                                                        modules committed, untouched ones get their kernel tensors

:func:`abort_layerwise_reload` ends a session after an error instead, and :func:`layerwise_session` wraps initialize /
finalize-or-abort for load, reload and weight sync. Where this goes beyond vLLM, and what it does not do, is listed
in ``layerwise/reload/__init__.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from layerwise.errors import MissingScaleError, MissingWeightError, NonFiniteWeightError, ReloadError
from layerwise.quant.parameters import ModelWeightParameter
from layerwise.reload.buffering import online_process_loader
from layerwise.reload.coverage import _coverage_problems, _unit_problems, _unpaired_fp8
from layerwise.reload.deferred import (
    _add_non_finite,
    _failed_deferred,
    _failed_modules,
    _find_non_finite_key,
    _non_finite_message,
    on_device,
)
from layerwise.reload.meta import StagingBuffer, layer_tensors, restore_layer_on_meta, set_layer_tensors
from layerwise.reload.processing import _commit
from layerwise.reload.types import LayerReloadingInfo, ReloadSession
from layerwise.reload.units import _process_pending_units

# The state lives on the modules themselves, never in a module-level registry: an info holds its
# module's bound weight loaders, so a registry keyed by the module (even a WeakKeyDictionary) would
# keep every loaded model alive forever (Limitations 5). On the module, the references form a cycle
# that the garbage collector frees with the model.
_INFO_ATTR = "_layerwise_info"  # on each module with parameters: its LayerReloadingInfo
_SESSION_ATTR = "_layerwise_session"  # on the model, between initialize and finalize/abort
_STAGING_ATTR = "_layerwise_staging"  # on the model, after a reload on CPU: its staging buffer, for the next one


def get_layerwise_info(module: nn.Module) -> LayerReloadingInfo | None:
    """The LayerReloadingInfo recorded for ``module``, or None if it has no parameters of its own."""
    return module.__dict__.get(_INFO_ATTR)


def _session(model: nn.Module) -> ReloadSession | None:
    return model.__dict__.get(_SESSION_ATTR)


def _end_session(model: nn.Module) -> ReloadSession | None:
    session = model.__dict__.pop(_SESSION_ATTR, None)
    if session is not None:
        session.staging = None  # the staging buffer is freed with the session, not with its report
    return session


def _modules(model: nn.Module):
    """(prefix, module, info) for every module with recorded metadata; a tied module appears once."""
    for prefix, module in model.named_modules():
        info = get_layerwise_info(module)
        if info is not None:
            yield prefix, module, info


def _unitwise(module: nn.Module) -> bool:
    return callable(getattr(module, "processing_unit", None))


def record_metadata_for_reloading(model: nn.Module) -> None:
    """Record, for every module with direct parameters, its checkpoint-format meta parameters.

    Must be called while the parameters are still on the meta device and in checkpoint format
    (right after the model is built). Costs no memory.

    Raises:
        TypeError: a parameter is not a typed ModelWeightParameter on the meta device.
    """
    for prefix, module in model.named_modules():
        params = {n: p for n, p in module._parameters.items() if p is not None}
        if not params:
            continue
        for name, p in params.items():
            if not isinstance(p, ModelWeightParameter) or p.device.type != "meta":
                raise TypeError(
                    f"{prefix}.{name}: expected a meta ModelWeightParameter, got {type(p).__name__} on {p.device}"
                )
        info = LayerReloadingInfo(
            prefix=prefix,
            restore_metadata=params,
            weight_loaders={n: p.weight_loader for n, p in params.items()},
            load_numel_total=sum(p.numel() for p in params.values()),
            unit_numel={n: p.shape[1:].numel() for n, p in params.items()} if _unitwise(module) else {},
            units_total=len(module.processing_units()) if _unitwise(module) else 0,
        )
        info.reset()
        module.__dict__[_INFO_ATTR] = info


def initialize_layerwise_reload(
    model: nn.Module,
    device: torch.device | None = None,
    atomic: bool = False,
    defer_checks: bool = False,
    borrow_device_tensors: bool | None = None,
) -> ReloadSession:
    """Put every module in checkpoint format on meta and wrap its loaders with online_process_loader.

    Args:
        model: a model whose metadata was recorded.
        device: where modules are materialized; defaults to the device of the kernel tensors.
        atomic: stage processed modules and write them into the kernel tensors only at finalize
            (costs, on the device, the processed size of every module in the stream: up to the
            whole model's kernel-tensor bytes for a full reload).
        defer_checks: check NaN/Inf on the device and read the results once, at finalize, and let
            host-to-device copies run ahead (no host synchronization per module on CUDA; Limitations 12).
            Only for a stream whose tensors the caller keeps unchanged until finalize or abort returns
            (a sequence it holds), and never with a cross-rank amax reduction (tensor parallelism). A weight
            update reads them at the end of each batch instead (:func:`layerwise.reload.deferred.check_deferred`).
        borrow_device_tensors: a buffered load of a device tensor keeps the caller's tensor instead of a host
            copy (a host copy synchronizes); default: ``defer_checks``. False for a weight update, whose
            transport refills the buffers its tensors are views of.
    Returns:
        the session.
    Raises:
        RuntimeError: a session is already in progress on this model, or no metadata was recorded.
    """
    if _session(model) is not None:
        raise RuntimeError("a layerwise load/reload is already in progress on this model")
    modules = {}
    first_load = True
    for prefix, module, info in _modules(model):
        current = layer_tensors(module)
        is_meta = all(t.device.type == "meta" for t in current.values())
        info.kernel_tensors = {} if is_meta else current
        if not is_meta:
            first_load = False
            device = device or next(iter(current.values())).device
        modules[prefix] = module
    if not modules:
        raise RuntimeError("no metadata recorded: call record_metadata_for_reloading(model) first")
    if device is None:
        raise RuntimeError("device is required when loading a model that is still on the meta device")
    device = torch.device(device)
    session = ReloadSession(
        device=device, modules=modules, first_load=first_load, atomic=atomic, defer_checks=defer_checks,
        borrow_device_tensors=defer_checks if borrow_device_tensors is None else borrow_device_tensors,
    )  # fmt: skip
    if device.type == "cpu":
        # a reload keeps its buffer on the model for the next one (Limitations 8); a first load does not
        kept = model.__dict__.get(_STAGING_ATTR)
        session.staging = kept if kept is not None else StagingBuffer(device)
        if not first_load:
            model.__dict__[_STAGING_ATTR] = session.staging
    else:  # the model moved off the CPU: a buffer kept by an earlier CPU reload is of no use any more
        model.__dict__.pop(_STAGING_ATTR, None)
    for module in modules.values():
        info = get_layerwise_info(module)
        info.reset()
        info.session = session
        restore_layer_on_meta(module, info)
        for name, meta_param in info.restore_metadata.items():
            meta_param.weight_loader = online_process_loader(module, info, name)
    model.__dict__[_SESSION_ATTR] = session
    return session


def finalize_layerwise_reload(model: nn.Module) -> ReloadSession:
    """Close the session: check completeness, commit staged modules, restore untouched modules.

    Returns:
        the finished session (``processed`` lists the modules that were updated).
    Raises:
        MissingWeightError: a module received some but not all of its elements (or, on a first
            load, none); the message names each parameter and how many elements are missing. After
            a reload the model is left usable (see :func:`abort_layerwise_reload`) and the error is
            a ReloadError subclass instance listing ``updated_modules``.
        NonFiniteWeightError: a unit still queued at finalize (a partial reload, Limitations 9) holds NaN
            or Inf, in a session without ``defer_checks``; the session is then left open:
            :func:`layerwise_session` aborts it. Or a check deferred to
            finalize failed (``defer_checks``, Limitations 12): the session is aborted first, and after a
            reload the error is a ReloadError subclass instance listing ``updated_modules`` (the module with
            the NaN or Inf among them).
    """
    session = _session(model)
    if session is None:
        raise RuntimeError("no layerwise load/reload in progress on this model")
    failed = _failed_deferred(session)  # Limitations 12: what the device found, before anything else
    if not failed:
        queued = [m for m in session.modules.values() if get_layerwise_info(m).pending_units]
        for module in queued:  # a partial reload's units still queued (Limitations 9)
            _process_pending_units(module, get_layerwise_info(module))
        if queued:
            failed = _failed_deferred(session)  # what the device found in those
    if failed:
        message = _non_finite_message(failed, session.atomic) + _made_by_quantization(session, failed)
        error = NonFiniteWeightError(message, key=_find_non_finite_key(failed[0].loads))
        updated = abort_layerwise_reload(model)
        if session.first_load:
            raise error
        written = [] if session.atomic else _failed_modules(failed)  # atomic: nothing was written
        raise _NonFiniteOnReload.wrap(error, updated, non_finite_modules=written) from error
    problems = []
    for module in session.modules.values():
        info = get_layerwise_info(module)
        if info.done:
            continue
        if info.unit_numel:
            problems.extend(_unit_problems(module, info, session.first_load))
            continue
        if info.load_numel or session.first_load:  # Limitations 3: absent modules are kept on a reload
            missing, doubled = _coverage_problems(info)
            problems.extend(doubled + missing)
    if problems:
        unpaired = next(filter(None, (_unpaired_fp8(m, get_layerwise_info(m)) for m in session.modules.values())), None)
        updated = abort_layerwise_reload(model)
        if unpaired is not None:  # a named FP8 weight / scale pair first, then the whole list
            message = f"{unpaired.message}; in all: {'; '.join(problems)}"
            if session.first_load:
                raise MissingScaleError(message, key=unpaired.key)
            raise _MissingScaleOnReload(f"reload incomplete: {message}", updated_modules=updated, key=unpaired.key)
        if session.first_load:
            raise MissingWeightError("checkpoint does not provide: " + "; ".join(problems))
        raise _MissingOnReload("reload incomplete: " + "; ".join(problems), updated_modules=updated)
    for prefix, module in session.modules.items():
        info = get_layerwise_info(module)
        if info.units_done and not info.done:  # Limitations 9: a partial reload of a unit-wise module
            session.processed.append(prefix)
        if info.kernel_tensors and (info.staged or (info.done or info.units_started) and not session.atomic):
            session.committed.append(prefix)  # before the commit: one that fails midway has written some
        if info.staged:
            _commit(module, info, info.staged)
        elif info.kernel_tensors and not info.done:
            set_layer_tensors(module, info.kernel_tensors)
        _close(info)
    _end_session(model)
    return session


def _made_by_quantization(session: ReloadSession, failed: list) -> str:
    """A note naming each failed module whose loaded values are all finite, with its scheme: its quantization made
    the NaN or Inf (torchao's float8 of an all-zero row, ``quant/torchao.py`` Limitations 6); "" when there is none.
    Reads the modules' loads (an error path)."""
    made = [
        p for p in _failed_modules(failed) if not any(_find_non_finite_key(c.loads) for c in failed if c.prefix == p)
    ]
    if not made:
        return ""
    named = ", ".join(
        f"{p} ({getattr(getattr(session.modules[p], 'quant_method', None), 'name', 'none')})" for p in made
    )
    return f"; the loaded values of {named} are finite: the quantization made the NaN or Inf"


def abort_layerwise_reload(model: nn.Module) -> list[str]:
    """End a session after an error, leaving the model usable.

    Every module whose kernel tensors were not overwritten gets them back unchanged; staged values
    (atomic) are dropped. Returns the prefixes of the modules that were already overwritten (empty for
    an atomic session, unless its finalize failed midway through the commit). On a first load there is
    nothing to restore and the model stays on meta. A session that deferred its checks (Limitations 12)
    then waits for the device and records the written modules that held NaN or Inf in
    ``session.non_finite_modules``.
    """
    session = _end_session(model)
    if session is None:
        return []
    updated = list(session.committed)  # closed by a finalize that then failed
    try:
        for prefix, module in session.modules.items():
            info = get_layerwise_info(module)
            if info.kernel_tensors:
                written = (info.done or info.units_started or info.in_place) and not session.atomic  # written into
                if written and prefix not in updated:
                    updated.append(prefix)
                set_layer_tensors(module, info.kernel_tensors)
            _close(info)
    finally:
        # Limitations 12: the caller may reuse its stream's tensors once the error reaches it, and a NaN the
        # device found before another error ended the stream is still reported
        _add_non_finite(session, _failed_deferred(session))
    return updated


@contextlib.contextmanager
def layerwise_session(
    model: nn.Module, *, device: torch.device | None = None, atomic: bool = False, defer_checks: bool = False
) -> Iterator[ReloadSession]:
    """initialize -> (the caller streams weights) -> finalize, or abort on any error.

    The session sequence (vLLM's start / update / finish) as load and reload run it, within one call; a
    weight update (``layerwise.transfer.update.WeightUpdate``), which spans several calls, runs the same three
    steps from its start / receive / finish / abort. On an error inside the block the session is aborted
    (every module not yet overwritten keeps its kernel tensors) and ``session.updated_before_abort`` lists the
    modules that were overwritten; the error propagates unchanged. Errors of finalize itself abort the same way.

    Raises:
        RuntimeError: a session is already open on ``model`` (see initialize_layerwise_reload).
    """
    session = initialize_layerwise_reload(model, device=device, atomic=atomic, defer_checks=defer_checks)
    with on_device(session.device):
        try:
            yield session
        except BaseException:
            session.updated_before_abort = abort_layerwise_reload(model)
            raise
        try:
            finalize_layerwise_reload(model)
        except BaseException:
            if _session(model) is session:  # failed midway (a commit's copy_), not by its own checks, which abort
                session.updated_before_abort = abort_layerwise_reload(model)
            raise


def release_staging(model: nn.Module) -> int:
    """Free the CPU staging buffer a reload left on ``model`` for the next one (Limitations 8).

    Returns:
        the bytes freed (0 if there was none).
    Raises:
        RuntimeError: a load, reload or weight update is in progress on the model.
    """
    if _session(model) is not None:
        raise RuntimeError("a layerwise load/reload is in progress on this model; release its staging after it")
    staging = model.__dict__.pop(_STAGING_ATTR, None)
    return 0 if staging is None else staging.nbytes


def staging_bytes(model: nn.Module) -> int:
    """Bytes of the CPU staging buffer kept on ``model`` between reloads (0 if none)."""
    staging = model.__dict__.get(_STAGING_ATTR)
    return 0 if staging is None else staging.nbytes


def _close(info: LayerReloadingInfo) -> None:
    """Unwrap the module's loaders and forget the session's state for it."""
    for name, meta_param in info.restore_metadata.items():
        meta_param.weight_loader = info.weight_loaders[name]
    info.reset()
    info.session = None


class _MissingOnReload(ReloadError, MissingWeightError):
    """A reload ended with a module only partly written."""


class _MissingScaleOnReload(ReloadError, MissingScaleError):
    """A reload ended with an FP8 module that received its weight without its scale (or the reverse)."""


class _NonFiniteOnReload(ReloadError, NonFiniteWeightError):
    """A reload that deferred its checks found NaN or Inf at finalize (Limitations 12)."""
