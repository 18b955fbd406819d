"""reload_weights: new weights into a live model, written into the storage it already has.

RL trainers push new policy weights every few steps into an engine that has captured CUDA graphs;
those graphs hold raw addresses, so the weights must land in the same tensors. Checkpoint-format
weights (BF16, Hugging Face names) are re-quantized layer by layer through the same machinery as
the first load and copied into the recorded kernel tensors; kernel-format weights (FP8 + scale,
the model's own parameter names) are copied directly.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Iterable, Union

import torch
from torch import nn

from layerwise.kernels.reference import amax
from layerwise.checkpoint import Checkpoint
from layerwise.config import ModelConfig
from layerwise.errors import LayerwiseError, NonFiniteWeightError, ReloadError, UnexpectedWeightError, WeightShapeError
from layerwise.loader import stream_weights
from layerwise.reload.session import (abort_layerwise_reload, finalize_layerwise_reload,
                                        initialize_layerwise_reload)

Weights = Union[str, os.PathLike, Iterable[tuple[str, torch.Tensor]]]


@dataclass
class ReloadReport:
    """What a reload changed.

    Attributes:
        updated_layers: prefixes of the layers whose kernel tensors received new values.
        seconds: wall-clock duration.
        peak_buffered_bytes: most bytes of incoming tensors held (on CPU) by layers waiting for
            their remaining tensors; 0 for a stream that arrives one whole layer at a time on CPU
            memory it already owns (memory-mapped checkpoint views are counted too).
    """

    updated_layers: list = field(default_factory=list)
    seconds: float = 0.0
    peak_buffered_bytes: int = 0


def _open_weights(model: nn.Module, weights: Weights):
    if isinstance(weights, (str, os.PathLike)):
        ckpt = Checkpoint(weights)
        config = ModelConfig.from_dict(ckpt.config)
        own = model.config
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "head_dim"):
            if getattr(config, name) != getattr(own, name):
                raise WeightShapeError(f"checkpoint config {name}={getattr(config, name)} differs from the live "
                                       f"model's {getattr(own, name)}", file=os.path.join(ckpt.path, "config.json"))
        return ckpt, ckpt.file_of
    return weights, None


def reload_weights(model: nn.Module, weights: Weights, *, is_checkpoint_format: bool = True,
                   atomic: bool = False) -> ReloadReport:
    """Reload weights into ``model`` in place: every parameter keeps its object, storage and data_ptr.

    Args:
        model: a model returned by :func:`layerwise.load_model`.
        weights: a checkpoint directory, or any iterable of (name, tensor). Tensors may live on any
            device; those waiting for the rest of their layer are kept on the CPU.
        is_checkpoint_format: True: Hugging Face names and dtype (e.g. BF16); each complete layer
            is re-quantized and copied into its kernel tensors. Layers absent from the stream are
            left unchanged (partial updates). False: the model's own parameter names
            (``model.named_parameters()``, e.g. ``...qkv_proj.weight`` in float8_e4m3fn and
            ``...qkv_proj.weight_scale``), copied directly after a dtype/shape/finiteness check.
        atomic: stage every processed layer and write the kernel tensors only once the whole stream
            has been checked. Extra device memory: the processed (kernel-format) size of every
            layer in the stream, i.e. up to the model's own size for a full reload. Without it,
            the extra memory is about one layer in the checkpoint dtype.
    Returns:
        a :class:`ReloadReport`.
    Raises:
        ReloadError: the stream named an unknown tensor, a wrong shape, a non-finite value, a region
            twice, or left a layer incomplete. Raised before the affected layer's kernel tensors
            are touched; ``updated_layers`` lists the layers already overwritten (none when
            ``atomic``), every other layer holds its previous values, and the model stays usable.
            The original error is chained as ``__cause__`` and kept as ``cause``.
    """
    start = time.perf_counter()
    try:
        stream, file_of = _open_weights(model, weights)
    except LayerwiseError as e:
        raise _reload_error(e, []) from e
    if not is_checkpoint_format:
        updated = _reload_kernel_format(model, stream, atomic)
        return ReloadReport(updated, time.perf_counter() - start, 0)
    session = initialize_layerwise_reload(model, atomic=atomic)
    try:
        stream_weights(model, stream, session, file_of)
        finalize_layerwise_reload(model)
    except ReloadError:
        raise  # finalize already restored the model and listed the updated layers
    except LayerwiseError as e:
        raise _reload_error(e, abort_layerwise_reload(model)) from e
    except BaseException:
        abort_layerwise_reload(model)
        raise
    return ReloadReport(list(session.processed), time.perf_counter() - start, session.peak_buffered_bytes)


def _reload_error(e: LayerwiseError, updated: list) -> ReloadError:
    note = f"layers already updated: {updated}" if updated else "no layer was changed"
    err = ReloadError(f"reload failed: {e.message}; {note}", updated_layers=updated, key=e.key, file=e.file)
    err.cause = e
    return err


def _has_non_finite(t: torch.Tensor) -> bool:
    """NaN/Inf anywhere in ``t``: float8_e4m3fn has only NaN (bits S.1111.111); wider floats go
    through the one-pass, temporary-free ``amax``."""
    if t.dtype == torch.float8_e4m3fn:
        return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return t.is_floating_point() and not bool(torch.isfinite(amax(t)))


def _reload_kernel_format(model: nn.Module, stream, atomic: bool) -> list:
    targets = dict(model.named_parameters(remove_duplicate=False))
    targets.update(dict(model.named_buffers(remove_duplicate=False)))
    staged, updated = [], []
    try:
        for name, tensor in stream:
            target = targets.get(name)
            if target is None:
                raise UnexpectedWeightError("no parameter or buffer of this name in the model", key=name)
            if tensor.shape != target.shape or tensor.dtype != target.dtype:
                raise WeightShapeError(f"kernel tensor is {target.dtype}{tuple(target.shape)}, got "
                                       f"{tensor.dtype}{tuple(tensor.shape)}", key=name)
            if _has_non_finite(tensor):
                raise NonFiniteWeightError("non-finite value", key=name)
            if atomic:
                staged.append((target, tensor.to(target.device, copy=True), name))
            else:
                with torch.no_grad():
                    target.copy_(tensor)
                updated.append(name)
    except LayerwiseError as e:
        raise _reload_error(e, [] if atomic else updated) from e
    with torch.no_grad():
        for target, tensor, name in staged:
            target.copy_(tensor)
            updated.append(name)
    return updated


def model_digest(model: nn.Module) -> dict[str, str]:
    """SHA-256 of the bytes of every parameter and buffer, by name (to prove what a reload changed)."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        out[name] = hashlib.sha256(data.numpy().tobytes()).hexdigest()
    return out
