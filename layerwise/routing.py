"""The one recursive load path: route checkpoint keys down the module tree to weight loaders.

``load_weights(module, weights)`` splits each key on dots and descends through ``named_children``.
When a component names no child, the children's ``checkpoint_shards`` are consulted: a fused layer
(qkv_proj, gate_up_proj) declares the checkpoint module names it absorbs and the shard_id of each.
A module with a ``checkpoint_param(rest) -> (param_name, shard_id)`` method owns the rest of the key
instead (``FusedMoE``: "3.up_proj.weight" -> ("w13_weight", (3, "w3")); it raises
UnexpectedWeightError for a name it does not take).
The last component names a parameter, whose own ``weight_loader(param, tensor, shard_id)`` writes
it; inside a layerwise session the loader is ``online_process_loader``'s wrapper and the checkpoint
key travels with the call (``key=``), for error messages and the per-module buffers.
``stream_weights`` feeds a whole stream through a model's ``load_weights``, one tensor at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from layerwise.errors import DuplicateWeightError, LayerwiseError, UnexpectedWeightError
from layerwise.reload.session import get_layerwise_info


def _load_param(module: nn.Module, param_name: str, tensor: torch.Tensor, key: str, shard_id=None) -> None:
    """Call the weight_loader of ``module.<param_name>`` (the session's wrapper inside a session)."""
    param = module._parameters.get(param_name)
    if param is None:
        raise UnexpectedWeightError(f"{type(module).__name__} has no parameter {param_name!r}", key=key)
    loader = getattr(param, "weight_loader", None)
    info = get_layerwise_info(module)
    if loader is None:
        if info is not None and info.done:  # processed earlier in this load/reload session
            raise DuplicateWeightError(
                f"module {info.prefix} was already loaded in this session; {info.prefix}.{param_name} is written again",
                key=key,
            )
        raise UnexpectedWeightError(
            f"parameter {param_name!r} of {type(module).__name__} is in kernel format; reload with "
            f"layerwise.reload_weights instead of calling load_weights directly",
            key=key,
        )
    if info is not None and info.session is not None:  # online_process_loader: buffers with the key
        loader(param, tensor, shard_id, key=key)
    else:  # a plain weight_loader (a model built on a real device, outside any session)
        loader(param, tensor, shard_id)


def _route(module: nn.Module, name: str, tensor: torch.Tensor, key: str, shard_id=None) -> None:
    # looked up on the class: nn.Module's __getattr__ fallback raises (and catches) AttributeError for every
    # module without it, at every level of every key
    if getattr(type(module), "checkpoint_param", None) is not None:
        # the module resolves the rest of the key itself (FusedMoE: expert, projection); None: another rank's
        # (expert parallelism), skipped unread
        resolved = module.checkpoint_param(name)
        if resolved is not None:
            _load_param(module, resolved[0], tensor, key, resolved[1])
        else:  # its metadata checked alike on every rank, nothing read
            module.check_unowned(name, tensor)
        return
    head, _, rest = name.partition(".")
    if not rest:
        _load_param(module, head, tensor, key, shard_id)
        return
    child = module._modules.get(head)
    if child is not None:
        _route(child, rest, tensor, key, shard_id)
        return
    for child in module._modules.values():
        shards = getattr(child, "checkpoint_shards", None) or {}
        if head in shards:
            _route(child, rest, tensor, key, shards[head])
            return
    raise UnexpectedWeightError(f"no module {head!r} under {type(module).__name__}", key=key)


def load_weights(
    module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], skip: Callable[[str], bool] | None = None
) -> list[str]:
    """Load (key, tensor) pairs in checkpoint naming into ``module`` (inside a layerwise session).

    Args:
        module: root of the module tree the keys are relative to.
        weights: iterable of (Hugging Face checkpoint key, tensor).
        skip: predicate on the key; True means the tensor is ignored (e.g. rotary inv_freq).
    Returns:
        the keys that were loaded, in order.
    Raises:
        LayerwiseError subclasses with ``key`` set: UnexpectedWeightError (a key names no module or
        parameter), WeightShapeError (a tensor does not fit its parameter), DuplicateWeightError, ...
    """
    loaded = []
    for key, tensor in weights:
        if skip is not None and skip(key):
            continue
        try:
            _route(module, key, tensor, key)
        except LayerwiseError as e:
            e.add_context(key=key)
            raise
        loaded.append(key)
    return loaded


def stream_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    file_of: Callable[[str], str | None] | None = None,
    on_tensor: Callable[[str], None] | None = None,
) -> None:
    """Feed (key, tensor) pairs one at a time to ``model.load_weights`` (inside a layerwise session).

    Args:
        file_of: key -> checkpoint file, to name the file in errors.
        on_tensor: called with each key after it was loaded (progress reporting).
    Raises:
        LayerwiseError subclasses, with ``key`` and ``file`` filled in from the pair that failed.
    """
    for key, tensor in weights:
        try:
            model.load_weights([(key, tensor)])
        except LayerwiseError as e:
            # the error may name another key than the one whose load completed the module (the tensor
            # holding a NaN, say): the file is that key's
            e.add_context(key=key, file=file_of(e.key or key) if file_of else None)
            raise
        if on_tensor is not None:
            on_tensor(key)
