"""Reload of kernel-format tensors: the model's own names and dtypes (FP8 + scales), copied in place.

Used by ``reload_weights(..., is_checkpoint_format=False)`` and by weight sync from a trainer that
already holds the quantized tensors. Each tensor is checked (name, dtype, shape, NaN/Inf) before it
is written; with ``atomic`` every tensor is checked and staged before any is written.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from layerwise.errors import NonFiniteWeightError, UnexpectedWeightError, WeightShapeError
from layerwise.kernels import has_non_finite


def kernel_targets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers by name, tied duplicates included (``lm_head.weight``)."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    return targets


def check_kernel_tensor(targets: dict[str, torch.Tensor], name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The kernel tensor ``name`` that ``tensor`` may be copied into, after checking it.

    Raises:
        UnexpectedWeightError: no parameter or buffer of that name.
        WeightShapeError: a dtype or shape other than the kernel tensor's.
        NonFiniteWeightError: NaN or Inf (an FP8 NaN byte included).
    """
    target = targets.get(name)
    if target is None:
        raise UnexpectedWeightError("no parameter or buffer of this name in the model", key=name)
    if tensor.shape != target.shape or tensor.dtype != target.dtype:
        raise WeightShapeError(
            f"kernel tensor is {target.dtype}{tuple(target.shape)}, got {tensor.dtype}{tuple(tensor.shape)}",
            key=name,
        )
    if has_non_finite(tensor):
        raise NonFiniteWeightError("non-finite value (NaN or Inf)", key=name)
    return target


def copy_kernel_tensors(
    model: nn.Module, stream: Iterable[tuple[str, torch.Tensor]], atomic: bool, updated: list
) -> None:
    """Copy each (name, tensor) of ``stream`` into the parameter or buffer of that name.

    Args:
        model: the live model; names are those of ``model.named_parameters()`` / ``named_buffers()``
            (tied duplicates included).
        stream: (name, tensor) pairs; tensors may live on any device and must match the target's
            dtype and shape exactly.
        atomic: stage copies of every tensor on the target device and write them only after the
            whole stream was checked (costs their bytes on the device).
        updated: list the names written are appended to, as they are written (so a caller that
            catches an error knows what changed).
    Raises:
        UnexpectedWeightError / WeightShapeError / NonFiniteWeightError, with ``key`` set, before the
        offending tensor (and, atomic, any tensor) is written (see :func:`check_kernel_tensor`).
    """
    targets = kernel_targets(model)
    staged = []
    for name, tensor in stream:
        target = check_kernel_tensor(targets, name, tensor)
        if atomic:
            staged.append((name, target, tensor.to(target.device, copy=True)))
            continue
        with torch.no_grad():
            target.copy_(tensor)
        updated.append(name)
    with torch.no_grad():
        for name, target, tensor in staged:
            target.copy_(tensor)
            updated.append(name)
