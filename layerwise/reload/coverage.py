"""Coverage (Limitations 1 and 3): what the writes recorded for a module or a unit cover, and what they lack.

The wrapped loaders (``buffering``) record, for every load, the exact element intervals it writes. Once a module or
a processing unit has received all its elements, its processing (``processing``, ``units``) checks here that no
element was written twice or never before it materializes anything; at finalize the session asks here what each
incomplete module lacks. The answers are the messages the errors carry, naming parameters, units and checkpoint
keys; the interval arithmetic itself is ``types.coverage``.
"""

from __future__ import annotations

from collections.abc import Hashable

from torch import nn

from layerwise.errors import MissingScaleError
from layerwise.quant.checkpoint_fp8 import FUSED_SHARDS, Fp8CheckpointLinearMethod
from layerwise.reload.types import LayerReloadingInfo, coverage, unwritten_in_range


def _coverage_problems(info: LayerReloadingInfo) -> tuple[list[str], list[str]]:
    missing, doubled = [], []
    for name, meta in info.restore_metadata.items():
        unwritten, twice = coverage(info.writes[name], meta.numel())
        if unwritten:
            missing.append(f"{info.prefix}.{name} ({unwritten} of {meta.numel()} elements never written)")
        if twice:
            doubled.append(f"{info.prefix}.{name} ({twice} elements written more than once)")
    return missing, doubled


def _unit_name(info: LayerReloadingInfo, unit: Hashable) -> str:
    param_name, index = unit
    return f"{info.prefix}.{param_name}[{index}]"


def _unit_coverage(writes: list, numel: int) -> tuple[int, int]:
    """:func:`coverage` of a unit's writes; one whose loads each wrote one span, the spans tiling it exactly (an
    expert's gate and up, or its down), needs no interval arithmetic."""
    if all(len(starts) == 1 for starts, _ in writes):
        reach = 0
        for start, length in sorted((int(starts[0]), length) for starts, length in writes):
            if start != reach:
                break
            reach += length
        else:
            if reach == numel:
                return 0, 0
    return coverage(writes, numel)


_MAX_UNIT_PROBLEMS = 8  # problems named per unit-wise module in one message


def _unit_problems(module: nn.Module, info: LayerReloadingInfo, first_load: bool) -> list[str]:
    """What a unit-wise module lacks at finalize, named by checkpoint key: every unit on a first load,
    on a reload only the units that received some of their elements (Limitations 3)."""
    problems = []
    for unit in module.processing_units():
        state = info.units.get(unit)
        if state is not None and state.done or state is None and not first_load:
            continue
        writes = state.writes if state is not None else []
        for name, start, stop in module.unit_checkpoint_names(unit):
            unwritten = unwritten_in_range(writes, start, stop)
            if unwritten:
                problems.append(f"{info.prefix}.{name} ({unwritten} of {stop - start} elements never written)")
        twice = coverage(writes, info.unit_numel[unit[0]])[1]
        if twice:
            problems.append(f"{_unit_name(info, unit)} ({twice} elements written more than once)")
    if len(problems) > _MAX_UNIT_PROBLEMS:  # a whole missing MoE layer would list 3 x num_experts keys
        hidden = len(problems) - _MAX_UNIT_PROBLEMS
        problems = problems[:_MAX_UNIT_PROBLEMS] + [f"... and {hidden} more tensors of {info.prefix}"]
    return problems


def _unpaired_fp8(module: nn.Module, info: LayerReloadingInfo) -> MissingScaleError | None:
    """The error for a module of an FP8 checkpoint in which some checkpoint module (one fused shard: q_proj of qkv_proj)
    received its whole float8 weight but not its scale, or its whole scale but not its weight (the pair is one unit:
    neither was written), naming the checkpoint key that did not arrive and the weight's dtype; None otherwise."""
    method = getattr(module, "quant_method", None)
    if not isinstance(method, Fp8CheckpointLinearMethod):
        return None
    scale_name = method.fmt.scale_name
    weight, scale = info.restore_metadata["weight"], info.restore_metadata[scale_name]
    weight_row, scale_row = weight.shape[1], scale.shape[1]  # elements per row of each
    parent, _, name = info.prefix.rpartition(".")
    shards = FUSED_SHARDS.get(name, ()) if len(method.output_sizes) > 1 else ()
    row = scale_rows = 0
    for i, (rows, n_scale) in enumerate(zip(method.output_sizes, method.scale_rows(), strict=True)):
        lacks_weight = unwritten_in_range(info.writes["weight"], row * weight_row, (row + rows) * weight_row)
        lacks_scale = unwritten_in_range(
            info.writes[scale_name], scale_rows * scale_row, (scale_rows + n_scale) * scale_row
        )
        row, scale_rows = row + rows, scale_rows + n_scale
        if (lacks_weight == 0) == (lacks_scale == 0):
            continue
        absent = scale_name if lacks_weight == 0 else "weight"
        key = f"{parent}.{shards[i]}.{absent}" if shards else f"{info.prefix}.{absent}"
        dtype = str(weight.dtype).removeprefix("torch.")
        what = f"its FP8 weight ({dtype}) without its scale" if absent == scale_name else f"a scale without its {dtype}"
        return MissingScaleError(
            f"{info.prefix} received {what}: {key} never arrived (or only part of it), so neither was written; an "
            f"FP8 weight and its {scale_name} are one unit: send both",
            key=key,
        )
    return None
