"""Layerwise loading and reloading: buffer each layer's loads, then materialize, replay, quantize.

The sequence and names follow vLLM (model_loader/reload/layerwise.py):

    record_metadata_for_reloading(model)      once, while the model's parameters are on meta
    initialize_layerwise_reload(model)        kernel tensors set aside, meta params + wrapped loaders
    model.load_weights(weights)               each loader call is buffered by online_process_loader;
                                              a layer whose elements are all written is processed:
                                              materialize -> replay -> process_weights_after_loading
                                              -> copy into the kernel tensors (reload) -> drop buffers
    finalize_layerwise_reload(model)          untouched layers get their kernel tensors back;
                                              incomplete layers are an error naming the parameters

Where this goes beyond vLLM: coverage is checked per element region (a double write cannot
mask a missing region), buffered tensors are kept off the device, a failed reload restores every
layer it has not yet overwritten and says which ones it has (or, with ``atomic=True``, changes
nothing at all), and tied parameters are one module, hence one layer.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from layerwise.kernels import NonFiniteError
from layerwise.kernels.reference import amax
from layerwise.errors import (DuplicateWeightError, LayerwiseError, MissingWeightError, NonFiniteWeightError,
                              ReloadError)
from layerwise.reload.counting import record_loader_writes, written_numel
from layerwise.reload.meta import layer_tensors, materialize_layer, restore_layer_on_meta, set_layer_tensors
from layerwise.reload.types import BufferedLoad, LayerReloadingInfo, ReloadSession, coverage
from layerwise.quant.base import check_finite
from layerwise.quant.parameters import ModelWeightParameter

# The state lives on the modules themselves, never in a module-level registry: an info holds its
# layer's bound weight loaders, so a registry keyed by the layer (even a WeakKeyDictionary) would
# keep every loaded model alive forever. On the module, the references form a cycle that the
# garbage collector frees with the model.
_INFO_ATTR = "_layerwise_info"  # on each layer with parameters: its LayerReloadingInfo
_SESSION_ATTR = "_layerwise_session"  # on the model, between initialize and finalize/abort


def get_layerwise_info(layer: nn.Module) -> Optional[LayerReloadingInfo]:
    """The LayerReloadingInfo recorded for ``layer``, or None if it has no parameters of its own."""
    return layer.__dict__.get(_INFO_ATTR)


def _session(model: nn.Module) -> Optional[ReloadSession]:
    return model.__dict__.get(_SESSION_ATTR)


def _end_session(model: nn.Module) -> Optional[ReloadSession]:
    return model.__dict__.pop(_SESSION_ATTR, None)


def _layers(model: nn.Module):
    """(prefix, layer, info) for every layer with recorded metadata; a tied module appears once."""
    for prefix, module in model.named_modules():
        info = get_layerwise_info(module)
        if info is not None:
            yield prefix, module, info


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
                raise TypeError(f"{prefix}.{name}: expected a meta ModelWeightParameter, got "
                                f"{type(p).__name__} on {p.device}")
        info = LayerReloadingInfo(
            prefix=prefix, restore_metadata=params,
            weight_loaders={n: p.weight_loader for n, p in params.items()},
            load_numel_total=sum(p.numel() for p in params.values()))
        info.reset()
        module.__dict__[_INFO_ATTR] = info


def initialize_layerwise_reload(model: nn.Module, device: Optional[torch.device] = None,
                                atomic: bool = False) -> ReloadSession:
    """Put every layer in checkpoint format on meta and wrap its loaders with online_process_loader.

    Args:
        model: a model whose metadata was recorded.
        device: where layers are materialized; defaults to the device of the kernel tensors.
        atomic: stage processed layers and write them into the kernel tensors only at finalize
            (costs, on the device, the processed size of every layer in the stream: up to the whole
            model's kernel-tensor bytes for a full reload).
    Returns:
        the session.
    Raises:
        RuntimeError: a session is already in progress on this model, or no metadata was recorded.
    """
    if _session(model) is not None:
        raise RuntimeError("a layerwise load/reload is already in progress on this model")
    layers = {}
    first_load = True
    for prefix, layer, info in _layers(model):
        current = layer_tensors(layer)
        is_meta = all(t.device.type == "meta" for t in current.values())
        info.kernel_tensors = {} if is_meta else current
        if not is_meta:
            first_load = False
            device = device or next(iter(current.values())).device
        layers[prefix] = layer
    if not layers:
        raise RuntimeError("no layer metadata recorded: call record_metadata_for_reloading(model) first")
    if device is None:
        raise RuntimeError("device is required when loading a model that is still on the meta device")
    session = ReloadSession(device=torch.device(device), layers=layers, first_load=first_load, atomic=atomic)
    for layer in layers.values():
        info = get_layerwise_info(layer)
        info.reset()
        info.session = session
        restore_layer_on_meta(layer, info)
        for name, meta_param in info.restore_metadata.items():
            meta_param.weight_loader = online_process_loader(layer, info, name)
    model.__dict__[_SESSION_ATTR] = session
    return session


def online_process_loader(layer: nn.Module, info: LayerReloadingInfo, param_name: str) -> Callable:
    """Wrap the weight loader of ``layer.<param_name>`` for a layerwise load.

    The returned loader runs the original one on the meta parameter to learn which elements it
    writes, buffers the call (tensor kept on CPU), adds to ``info.load_numel``, and once
    ``load_numel`` reaches ``load_numel_total`` processes the layer.
    """
    original = info.weight_loaders[param_name]
    meta_param = info.restore_metadata[param_name]

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None) -> None:
        session = info.session  # always set: loaders are wrapped only inside a session
        key = session.current_key
        if info.done:
            raise DuplicateWeightError(f"layer {info.prefix} was already loaded in this session; "
                                       f"{info.prefix}.{param_name} is written again", key=key)
        writes = record_loader_writes(original, meta_param, loaded_weight, shard_id)
        numel = written_numel(writes)
        completes = info.load_numel + numel >= info.load_numel_total
        if not completes and loaded_weight.device.type != "cpu":
            loaded_weight = loaded_weight.to("cpu")
        info.loaded_weights.append(BufferedLoad(param_name, loaded_weight, shard_id, key))
        info.writes[param_name].extend(writes)
        info.load_numel += numel
        session.buffered_bytes += loaded_weight.numel() * loaded_weight.element_size()
        session.peak_buffered_bytes = max(session.peak_buffered_bytes, session.buffered_bytes)
        if completes:
            _process_layer(layer, info)

    return loader


def _coverage_problems(info: LayerReloadingInfo) -> tuple[list[str], list[str]]:
    missing, doubled = [], []
    for name, meta in info.restore_metadata.items():
        unwritten, twice = coverage(info.writes[name], meta.numel())
        if unwritten:
            missing.append(f"{info.prefix}.{name} ({unwritten} of {meta.numel()} elements never written)")
        if twice:
            doubled.append(f"{info.prefix}.{name} ({twice} elements written more than once)")
    return missing, doubled


def _find_non_finite_key(info: LayerReloadingInfo) -> Optional[str]:
    for buffered in info.loaded_weights:
        w = buffered.loaded_weight
        if w.is_floating_point() and not bool(torch.isfinite(amax(w))):
            return buffered.key
    return None


def _process_layer(layer: nn.Module, info: LayerReloadingInfo) -> None:
    session = info.session
    missing, doubled = _coverage_problems(info)
    if doubled:
        raise DuplicateWeightError("double write: " + "; ".join(doubled + missing), key=session.current_key)
    if missing:  # load_numel reached the total although regions are missing: cannot happen without doubles
        raise MissingWeightError("incomplete layer: " + "; ".join(missing), key=session.current_key)
    materialize_layer(layer, info, session.device)
    for buffered in info.loaded_weights:
        info.weight_loaders[buffered.param_name](layer._parameters[buffered.param_name], buffered.loaded_weight,
                                                 buffered.shard_id)
    try:
        quant_method = getattr(layer, "quant_method", None)
        if quant_method is not None:
            quant_method.process_weights_after_loading(layer)
        else:
            check_finite(layer)
    except NonFiniteError as e:
        bad = _find_non_finite_key(info)
        restore_layer_on_meta(layer, info)
        raise NonFiniteWeightError(f"non-finite value (NaN or Inf) in a weight of layer {info.prefix}: {e}",
                                   key=bad) from e
    processed = layer_tensors(layer)
    if info.kernel_tensors:
        _check_kernel_format(info, processed)
        if session.atomic:
            info.staged = processed
            restore_layer_on_meta(layer, info)
        else:
            _commit(layer, info, processed)
    session.buffered_bytes -= sum(b.loaded_weight.numel() * b.loaded_weight.element_size()
                                  for b in info.loaded_weights)
    info.loaded_weights = []
    info.done = True
    session.processed.append(info.prefix)


def _check_kernel_format(info: LayerReloadingInfo, processed: dict[str, torch.Tensor]) -> None:
    if set(processed) != set(info.kernel_tensors):
        raise LayerwiseError(f"layer {info.prefix}: processing produced {sorted(processed)}, "
                             f"but the live model holds {sorted(info.kernel_tensors)}")
    for name, new in processed.items():
        old = info.kernel_tensors[name]
        if new.shape != old.shape or new.dtype != old.dtype:
            raise LayerwiseError(f"layer {info.prefix}.{name}: processed {new.dtype}{tuple(new.shape)} does not "
                                 f"fit the kernel tensor {old.dtype}{tuple(old.shape)}")


def _commit(layer: nn.Module, info: LayerReloadingInfo, processed: dict[str, torch.Tensor]) -> None:
    """Copy processed values into the kernel tensors' storage and put those objects back."""
    with torch.no_grad():
        for name, new in processed.items():
            info.kernel_tensors[name].copy_(new)
    set_layer_tensors(layer, info.kernel_tensors)


def _close(info: LayerReloadingInfo) -> None:
    """Unwrap the layer's loaders and forget the session's state for it."""
    for name, meta_param in info.restore_metadata.items():
        meta_param.weight_loader = info.weight_loaders[name]
    info.reset()
    info.session = None


def abort_layerwise_reload(model: nn.Module) -> list[str]:
    """End a session after an error, leaving the model usable.

    Every layer whose kernel tensors were not overwritten gets them back unchanged; staged values
    (atomic) are dropped. Returns the prefixes of the layers that were already overwritten (always
    empty for an atomic session). On a first load there is nothing to restore and the model stays
    on meta.
    """
    session = _end_session(model)
    if session is None:
        return []
    updated = []
    for prefix, layer in session.layers.items():
        info = get_layerwise_info(layer)
        if info.kernel_tensors:
            if info.done and not session.atomic:
                updated.append(prefix)
            set_layer_tensors(layer, info.kernel_tensors)
        _close(info)
    return updated


def finalize_layerwise_reload(model: nn.Module) -> ReloadSession:
    """Close the session: check completeness, commit staged layers, restore untouched layers.

    Returns:
        the finished session (``processed`` lists the layers that were updated).
    Raises:
        MissingWeightError: a layer received some but not all of its elements (or, on a first load,
            none); the message names each parameter and how many elements are missing. After a
            reload the model is left usable (see :func:`abort_layerwise_reload`) and the error is a
            ReloadError subclass instance listing ``updated_layers``.
    """
    session = _session(model)
    if session is None:
        raise RuntimeError("no layerwise load/reload in progress on this model")
    problems = []
    for prefix, layer in session.layers.items():
        info = get_layerwise_info(layer)
        if info.done:
            continue
        if info.load_numel or session.first_load:
            missing, doubled = _coverage_problems(info)
            problems.extend(doubled + missing)
    if problems:
        updated = abort_layerwise_reload(model)
        if session.first_load:
            raise MissingWeightError("checkpoint does not provide: " + "; ".join(problems))
        raise _MissingOnReload("reload incomplete: " + "; ".join(problems), updated_layers=updated)
    for prefix, layer in session.layers.items():
        info = get_layerwise_info(layer)
        if info.staged:
            _commit(layer, info, info.staged)
        elif info.kernel_tensors and not info.done:
            set_layer_tensors(layer, info.kernel_tensors)
        _close(info)
    _end_session(model)
    return session


class _MissingOnReload(ReloadError, MissingWeightError):
    """A reload ended with a layer only partly written."""
