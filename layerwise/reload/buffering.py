"""Buffering: what each call of a wrapped weight loader does while ``model.load_weights`` streams a checkpoint.

``initialize_layerwise_reload`` (``session``) wraps the loader of every meta parameter with
:func:`online_process_loader` (vLLM's name). A call learns which elements the original loader writes by running it
on the meta parameter (:func:`_recorded`, one meta run per distinct call, Limitations 1), holds the loaded tensor
with its checkpoint key (:func:`_hold`: on the CPU, Limitations 2, or the caller's own tensor with
``borrow_device_tensors``, Limitations 12), and counts the elements. It hands the module over to
``processing._process_module`` once its count reaches ``load_numel_total``; a unit-wise module (Limitations 9) is
counted and buffered per unit instead (:func:`_load_unit`), each complete unit handed to ``units._complete_unit``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from layerwise.errors import DuplicateWeightError, LayerwiseError
from layerwise.reload.counting import record_loader, written_numel
from layerwise.reload.coverage import _unit_name
from layerwise.reload.processing import _process_module
from layerwise.reload.types import BufferedLoad, LayerReloadingInfo, ReloadSession, UnitState
from layerwise.reload.units import _complete_unit


def online_process_loader(module: nn.Module, info: LayerReloadingInfo, param_name: str) -> Callable:
    """Wrap the weight loader of ``module.<param_name>`` for a layerwise load.

    The returned ``loader(param, loaded_weight, shard_id=None, *, key=None)`` runs the original
    loader on the meta parameter to learn which elements it writes, buffers the call (tensor kept on
    CPU) with its checkpoint ``key`` (for error messages), adds to ``info.load_numel``, and once
    ``load_numel`` reaches ``load_numel_total`` processes the module.
    """

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor, shard_id=None, *, key: str | None = None):
        session = info.session  # always set: loaders are wrapped only inside a session
        if info.done:
            raise DuplicateWeightError(
                f"module {info.prefix} was already loaded in this session; {info.prefix}.{param_name} is written again",
                key=key,
            )
        writes, verbatim_at = _recorded(module, info, param_name, loaded_weight, shard_id)
        if info.unit_numel:  # Limitations 9: counted, buffered and processed per unit
            load = BufferedLoad(param_name, loaded_weight, shard_id, key, verbatim_at)
            _load_unit(module, info, param_name, writes, load)
            return
        numel = written_numel(writes)
        completes = info.load_numel + numel >= info.load_numel_total
        loaded_weight = _hold(session, loaded_weight, completes)
        info.loaded_weights.append(BufferedLoad(param_name, loaded_weight, shard_id, key, verbatim_at))
        info.writes[param_name].extend(writes)
        info.load_numel += numel
        if completes:
            _process_module(module, info, key)

    return loader


def _hold(session: ReloadSession, loaded_weight, completes: bool):
    """What a load is held as until its module (or unit) is processed, its bytes counted in the session's buffered
    bytes. One that does not complete its module: Limitations 2, buffers stay on the CPU, except that a session that
    borrows device tensors holds the caller's own tensor (kept by the caller anyway, and a copy to the host would
    synchronize: Limitations 12). One that completes it is processed right away, as it is."""
    if not completes and loaded_weight.device.type != "cpu" and not session.borrow_device_tensors:
        loaded_weight = loaded_weight.to("cpu")
    session.buffered_bytes += loaded_weight.numel() * loaded_weight.element_size()
    session.peak_buffered_bytes = max(session.peak_buffered_bytes, session.buffered_bytes)
    return loaded_weight


def _recorded(module: nn.Module, info: LayerReloadingInfo, param_name: str, loaded_weight, shard_id):
    """:func:`record_loader` of one load, remembered per (parameter, loaded shape, strides, dtype, shard_id): the
    meta run sees nothing else of the loaded tensor, so the same call records the same writes, and the next
    reload skips the meta run (Limitations 1). A unit-wise module whose loader writes unit i's load as
    unit 0's moved by i units declares it (``unit_shard_origin``: FusedMoE's experts); its loads are recorded
    once for unit 0 and translated, so an MoE layer's 768 expert loads make 3 meta runs (Limitations 9)."""
    original, meta_param = info.weight_loaders[param_name], info.restore_metadata[param_name]
    origin = getattr(module, "unit_shard_origin", None) if info.unit_numel else None
    index, recorded_shard = origin(shard_id) if origin is not None else (0, shard_id)
    stride = tuple(loaded_weight.stride()) if isinstance(loaded_weight, torch.Tensor) else None  # lazy: contiguous
    key = (param_name, tuple(loaded_weight.shape), stride, loaded_weight.dtype, recorded_shard)
    try:
        result = info.recorded[key]
    except KeyError:
        result = info.recorded[key] = record_loader(original, meta_param, loaded_weight, recorded_shard)
    except TypeError:  # an unhashable shard_id: recorded every time
        result = record_loader(original, meta_param, loaded_weight, recorded_shard)
    if index == 0:
        return result
    shift = index * info.unit_numel[param_name]
    writes, verbatim_at = result
    return [(starts + shift, length) for starts, length in writes], None if verbatim_at is None else verbatim_at + shift


def _load_unit(module: nn.Module, info: LayerReloadingInfo, param_name: str, writes: list, load: BufferedLoad) -> None:
    """Count and buffer one load of a unit-wise module; complete its unit once all its elements are written."""
    session = info.session
    unit = module.processing_unit(param_name, load.shard_id)
    index, n = unit[1], info.unit_numel[param_name]
    first = index * n
    relative = []
    for starts, length in writes:
        if len(starts) and (int(starts.min()) < first or int(starts.max()) + length > first + n):
            raise LayerwiseError(f"a load declared for {_unit_name(info, unit)} writes outside it", key=load.key)
        relative.append((starts - first, length))
    state = info.units.setdefault(unit, UnitState())
    if state.done:
        raise DuplicateWeightError(
            f"{_unit_name(info, unit)} was already loaded in this session and is written again", key=load.key
        )
    numel = written_numel(writes)
    completes = state.load_numel + numel >= n
    load.loaded_weight = _hold(session, load.loaded_weight, completes)
    state.loaded_weights.append(load)
    state.writes.extend(relative)
    state.load_numel += numel
    info.load_numel += numel
    if completes:
        _complete_unit(module, info, unit, state, load.key)
