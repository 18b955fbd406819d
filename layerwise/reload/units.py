"""Unit-wise processing (Limitations 9): a ``FusedMoE`` processed one *unit* (one expert's w13 or w2) at a time.

A module with ``processing_unit(param_name, shard_id) -> (param_name, i)`` declares that each load writes only
``param[i]``. The wrapped loaders (``buffering``) count and buffer its loads per unit and hand over each unit once
all its elements are written (:func:`_complete_unit`). A complete unit alone is materialized ([2I, H] for an
expert's w13), its loads replayed into it, and ``quant_method.process_expert`` writes it into its slice of the
layer's kernel-format tensors, which are set up once, at the first unit (:func:`_unit_targets`: fresh on a first
load, the live kernel tensors on a reload, a staged copy when atomic). A unit whose loads are unread checkpoint
tensors taken as pieces (Limitations 10) waits in ``pending_units`` instead, and the module's queued units are
quantized in one ``process_experts`` call (:func:`_process_pending_units`) at its last unit, or at finalize after a
partial reload (``session``). The module is done, and its kernel tensors set, when all its units are.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import nn

from layerwise.checkpoint import LazyTensor
from layerwise.errors import DuplicateWeightError, MissingWeightError, NonFiniteWeightError
from layerwise.reload.coverage import _unit_coverage, _unit_name
from layerwise.reload.deferred import _deferral, _find_non_finite_key
from layerwise.reload.meta import empty_like_metas, set_layer_tensors
from layerwise.reload.pieces import _loaded_pieces, _piece_spans
from layerwise.reload.types import LayerReloadingInfo, UnitState, _buffered_bytes


def _complete_unit(module: nn.Module, info: LayerReloadingInfo, unit: Hashable, state: UnitState, key) -> None:
    """Check a complete unit's coverage, then process it now, or, when its loads are unread checkpoint tensors
    the quant method takes as pieces, queue it to be processed with the module's others (Limitations 9)."""
    param_name, index = unit
    unwritten, twice = _unit_coverage(state.writes, info.unit_numel[param_name])
    if twice:  # Limitations 1
        raise DuplicateWeightError(
            f"double write: {_unit_name(info, unit)} ({twice} elements written more than once)", key=key
        )
    if unwritten:  # the count reached the total without doubles: cannot happen
        raise MissingWeightError(f"incomplete unit {_unit_name(info, unit)} ({unwritten} elements)", key=key)
    state.done = True
    if _batchable(module, info, unit, state):
        info.pending_units.append(unit)
        # unread checkpoint tensors: nothing is held for the unit while it waits
        info.session.buffered_bytes -= _buffered_bytes(state.loaded_weights)
    else:
        _process_unit(module, info, unit, state)
    if info.pending_units and info.units_done + len(info.pending_units) == info.units_total:
        _process_pending_units(module, info)  # the module's last unit: quantize every waiting one


def _batchable(module: nn.Module, info: LayerReloadingInfo, unit: Hashable, state: UnitState) -> bool:
    """Whether the unit can wait to be processed with others: every load an unread checkpoint tensor (a lazy
    tensor: holding it costs nothing) that the quant method takes as a piece, on the device of the unit's
    kernel tensors."""
    if not all(type(b.loaded_weight) is LazyTensor for b in state.loaded_weights):
        return False
    param_name, index = unit
    shape = info.restore_metadata[param_name].shape[1:]
    first = index * info.unit_numel[param_name]
    return _piece_spans(module.quant_method, shape, state.loaded_weights, info.session.device, first) is not None


def _unit_targets(module: nn.Module, info: LayerReloadingInfo) -> dict[str, torch.Tensor]:
    """The kernel-format tensors units are written into, set up at the module's first unit."""
    session = info.session
    if not info.unit_targets:
        if not info.kernel_tensors:  # first load: allocated once, on the device
            info.unit_targets = module.quant_method.create_kernel_tensors(module, session.device)
        elif session.atomic:  # a staged copy (the units not streamed keep their bytes), committed at finalize
            info.unit_targets = info.staged = {n: t.detach().clone() for n, t in info.kernel_tensors.items()}
        else:  # reload: the live kernel tensors themselves, written expert by expert
            info.unit_targets = info.kernel_tensors
    return info.unit_targets


def _process_unit(module: nn.Module, info: LayerReloadingInfo, unit: Hashable, state: UnitState) -> None:
    """Materialize one unit -> replay its loads -> process_expert into the kernel tensors -> free it."""
    session = info.session
    param_name, index = unit
    targets = _unit_targets(module, info)
    meta = info.restore_metadata[param_name]
    unit_meta = torch.empty(meta.shape[1:], dtype=meta.dtype, device="meta")
    first = index * info.unit_numel[param_name]
    device = targets[param_name].device  # where the expert's FP8 slice lives, which the pieces are quantized into
    pieces = _loaded_pieces(module.quant_method, unit_meta.shape, state.loaded_weights, device, first)
    weight = as_param = None
    # checks recorded and host-to-device copies that do not wait, as in a module's replay and processing
    with _deferral(session, info.prefix, state.loaded_weights):
        if pieces is None:
            # CPU: the unit reuses the staging buffer's touched memory
            weight = empty_like_metas({param_name: unit_meta}, session.device, session.staging)[param_name]
            # the unit seen as the whole parameter: every index along dim 0 is this unit's storage, so the module's
            # own loader, which writes only param[index] (checked above on meta), fills it
            as_param = weight.unsqueeze(0).expand(meta.shape)
            for buffered in state.loaded_weights:
                info.weight_loaders[param_name](as_param, buffered.loaded_weight, buffered.shard_id)
        started_before, info.units_started = info.units_started, True  # the kernel tensors may now change
        try:
            if pieces is None:
                module.quant_method.process_expert(module, param_name, index, weight, targets)
            else:
                module.quant_method.process_expert(module, param_name, index, None, targets, weight_pieces=pieces)
        except NonFiniteWeightError as e:  # raised by the scale, before any write
            info.units_started = started_before
            raise _non_finite_unit(info, unit, state) from e
    del weight, as_param
    _unit_processed(module, info, unit, state)


def _non_finite_unit(info: LayerReloadingInfo, unit: Hashable, state: UnitState) -> NonFiniteWeightError:
    """The NonFiniteWeightError to raise for ``unit``: named by the unit and by the checkpoint key that holds the
    NaN or Inf (each of its loads is read until one does)."""
    return NonFiniteWeightError(
        f"non-finite value (NaN or Inf) in {_unit_name(info, unit)}", key=_find_non_finite_key(state.loaded_weights)
    )


def _process_pending_units(module: nn.Module, info: LayerReloadingInfo) -> None:
    """Quantize the module's queued units in one ``process_experts`` call over all their pieces: every unit's
    scale before any write (a NaN or Inf anywhere leaves the module untouched; with ``defer_checks`` it is written
    and reported at finalize, Limitations 12), on CPU one native pass for the
    scales and one for the bytes of each parameter, instead of ~10 small calls per expert."""
    pending, info.pending_units = info.pending_units, []
    targets = _unit_targets(module, info)
    device = next(iter(targets.values())).device
    batches: dict[str, tuple[list, list]] = {}
    queued = []
    for unit in pending:
        state = info.units[unit]
        first = unit[1] * info.unit_numel[unit[0]]
        shape = info.restore_metadata[unit[0]].shape[1:]
        pieces = _loaded_pieces(module.quant_method, shape, state.loaded_weights, device, first)
        if pieces is None:  # cannot happen for whole checkpoint tensors: processed alone
            _process_unit(module, info, unit, state)
            continue
        ids, weights = batches.setdefault(unit[0], ([], []))
        ids.append(unit[1])
        weights.append(pieces)
        queued.append((unit, state))
    if not queued:
        return
    started_before, info.units_started = info.units_started, True  # the kernel tensors may now change
    loads = [b for _, state in queued for b in state.loaded_weights]
    try:
        with _deferral(info.session, info.prefix, loads):
            module.quant_method.process_experts(module, batches, targets)
    except NonFiniteWeightError as e:  # raised before any write
        info.units_started = started_before
        bad = [(u, s) for u, s in queued if _find_non_finite_key(s.loaded_weights)]
        if not bad:
            raise
        raise _non_finite_unit(info, *bad[0]) from e
    for unit, state in queued:
        _unit_processed(module, info, unit, state, counted=False)


def _unit_processed(
    module: nn.Module, info: LayerReloadingInfo, unit: Hashable, state: UnitState, counted: bool = True
) -> None:
    """Account for a unit written into the kernel tensors (``counted``: its loads still count as buffered, not a
    unit that waited); the module is done once all its units are."""
    session = info.session
    meta = info.restore_metadata[unit[0]]
    nbytes = info.unit_numel[unit[0]] * meta.element_size()
    session.unit_bytes[info.prefix] = max(session.unit_bytes.get(info.prefix, 0), nbytes)
    if counted:
        session.buffered_bytes -= _buffered_bytes(state.loaded_weights)
    state.loaded_weights = []
    state.done = True
    info.units_done += 1
    if info.units_done == info.units_total:
        info.done = True
        session.processed.append(info.prefix)
        if not (session.atomic and info.kernel_tensors):  # an atomic reload commits the staged copy at finalize
            set_layer_tensors(module, info.unit_targets)
