"""Reload of kernel-format tensors: the model's own names and dtypes (FP8 + scales), copied in place.

Used by ``reload_weights(..., is_checkpoint_format=False)`` and by weight sync from a trainer that
already holds the quantized tensors (:class:`KernelTensorWriter`, the one writer of both). Each tensor is
checked (name, dtype, shape, NaN/Inf, not sent before) before it is written; with ``atomic`` every tensor is
checked and staged before any is written.
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.errors import DuplicateWeightError, NonFiniteWeightError, UnexpectedWeightError, WeightShapeError
from layerwise.kernels import has_non_finite


def named_kernel_tensors(model: nn.Module, remove_duplicate: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by name (its kernel tensors once loaded); ``remove_duplicate``
    False: a tied tensor under each of its names (``lm_head.weight`` beside ``model.embed_tokens.weight``)."""
    tensors = dict(model.named_parameters(remove_duplicate=remove_duplicate))
    tensors.update(dict(model.named_buffers(remove_duplicate=remove_duplicate)))
    return tensors


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


class KernelTensorWriter:
    """Writes kernel-format tensors into a live model by name, each checked first (:func:`check_kernel_tensor`)
    and accepted once: immediately, or, ``atomic``, staged on the target's device and written by :meth:`commit`.

    The one writer of ``reload_weights(..., is_checkpoint_format=False)`` and of a kernel-format weight update
    (``layerwise.transfer.update.WeightUpdate``).

    Attributes:
        updated: the names written so far, appended as each is written (so a caller that catches an error knows
            what changed: empty for an atomic writer until :meth:`commit`).
    """

    def __init__(self, model: nn.Module, atomic: bool):
        self.atomic = atomic
        self.updated: list[str] = []
        self._targets = named_kernel_tensors(model, remove_duplicate=False)  # tied duplicates included
        self._staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Check ``tensor`` (any device; the target's dtype and shape exactly) and write it into the parameter or
        buffer ``name`` (``atomic``: stage a copy on the target's device, its bytes held until :meth:`commit`).

        Raises:
            UnexpectedWeightError / WeightShapeError / NonFiniteWeightError: as :func:`check_kernel_tensor`.
            DuplicateWeightError: ``name`` was already written or staged by this writer.
            All with ``key`` set, before anything of this call is written.
        """
        target = check_kernel_tensor(self._targets, name, tensor)
        if name in self._staged or name in self.updated:
            raise DuplicateWeightError("tensor sent twice in one update", key=name)
        if self.atomic:
            self._staged[name] = (target, tensor.to(target.device, copy=True))
            return
        with torch.no_grad():
            target.copy_(tensor)
        self.updated.append(name)

    def commit(self) -> None:
        """Write the staged tensors (a no-op when not ``atomic``), appending each name to :attr:`updated`."""
        staged, self._staged = self._staged, {}
        with torch.no_grad():
            for name, (target, tensor) in staged.items():
                target.copy_(tensor)
                self.updated.append(name)

    def discard(self) -> None:
        """Drop the staged tensors unwritten."""
        self._staged = {}
