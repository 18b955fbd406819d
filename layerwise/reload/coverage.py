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
