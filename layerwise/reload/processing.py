"""Processing and commit: a module whose every element has been loaded becomes kernel tensors.

The wrapped loaders (``buffering``) hand over a module once its loads reach ``load_numel_total``:
:func:`_process_module` checks its coverage, materializes it (in the staging buffer on CPU; on a non-atomic reload of
a checkpoint-format module straight into its live tensors, Limitations 11; a weight taken as pieces stays on meta,
Limitations 10), replays the buffered loads, runs ``process_weights_after_loading`` (checks deferred with
``defer_checks``, Limitations 12), and then commits: on a reload it copies the processed values into the kernel
tensors' storage (:func:`_commit`: every data_ptr kept), when atomic it stages them for finalize to commit, on a
first load it keeps them. The module's buffered loads are dropped and it is marked done; the session's finalize
commits what was staged with the same :func:`_commit`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from layerwise.errors import DuplicateWeightError, LayerwiseError, MissingWeightError, NonFiniteWeightError
from layerwise.kernels import cpu_native
from layerwise.quant.base import check_finite
from layerwise.reload.coverage import _coverage_problems
from layerwise.reload.deferred import _deferral, _find_non_finite_key
from layerwise.reload.meta import layer_tensors, materialize_layer, restore_layer_on_meta, set_layer_tensors
from layerwise.reload.pieces import _weight_pieces
from layerwise.reload.types import LayerReloadingInfo, _buffered_bytes


def _process_module(module: nn.Module, info: LayerReloadingInfo, key: str | None) -> None:
    """Materialize -> replay -> process_weights_after_loading -> commit or stage (``key``: the
    checkpoint key whose load completed the module, named by coverage errors)."""
    session = info.session
    missing, doubled = _coverage_problems(info)
    if doubled:  # Limitations 1: exact regions, so a double write cannot hide a missing one
        raise DuplicateWeightError("double write: " + "; ".join(doubled + missing), key=key)
    if missing:  # load_numel reached the total although regions are missing: cannot happen without doubles
        raise MissingWeightError("incomplete module: " + "; ".join(missing), key=key)
    quant_method = getattr(module, "quant_method", None)
    live = info.kernel_tensors if info.kernel_tensors and not session.atomic else None  # written right away
    pieces = finite = staging = None
    if live is not None and _loads_into_kernel_tensors(module, info):
        # processing only checks these parameters: the loads are replayed straight into the live tensors
        materialize_layer(module, info, session.device, into=live)
        info.in_place = True
        finite = _copy_checked(info, live)
    else:
        pieces = _weight_pieces(module, info)
        # staged (CPU): what processing replaces (an FP8 method's weight); on a non-atomic reload every module,
        # whose processed values are copied into the kernel tensors right away (an atomic one keeps them)
        replaced = quant_method is not None and quant_method.replaces_weight
        staging = session.staging if replaced or live is not None else None
        skip = ("weight",) if pieces is not None else ()  # quantized from the loaded tensors themselves
        materialize_layer(module, info, session.device, staging, keep_on_meta=skip)
    nbytes = sum(p.numel() * p.element_size() for p in info.restore_metadata.values())
    session.unit_bytes[info.prefix] = max(session.unit_bytes.get(info.prefix, 0), nbytes)
    with _deferral(session, info.prefix, info.loaded_weights) as flags:
        for buffered in info.loaded_weights if finite is None else ():
            if pieces is not None and buffered.param_name == "weight":
                continue
            info.weight_loaders[buffered.param_name](
                module._parameters[buffered.param_name], buffered.loaded_weight, buffered.shard_id
            )
        try:
            if finite is not None:  # copied and checked in one pass: what processing would check is known
                if not finite and session.defer_checks:
                    flags.append(torch.ones((), dtype=torch.bool))
                elif not finite:
                    raise NonFiniteWeightError("a parameter holds NaN or Inf")
            elif pieces is not None:
                quant_method.process_weights_after_loading(module, into=live, weight_pieces=pieces)
            elif quant_method is not None:
                quant_method.process_weights_after_loading(module, into=live)
            else:
                check_finite(module)
        except NonFiniteWeightError as e:  # raised before a quant method writes ``into`` the live tensors
            restore_layer_on_meta(module, info)
            raise NonFiniteWeightError(
                f"non-finite value (NaN or Inf) in a weight of {info.prefix}: {e.message}",
                key=_find_non_finite_key(info.loaded_weights),
            ) from e
        except BaseException:  # anything else may come after a write into the live tensors: reported as updated
            info.in_place = info.in_place or live is not None
            raise
    if live is not None:  # copied into the kernel tensors: nothing keeps the buffer
        processed = layer_tensors(module)
        _check_kernel_format(info, processed)
        info.in_place = info.in_place or any(_same_memory(t, live[n]) for n, t in processed.items())
        _commit(module, info, processed)
    else:
        if staging is not None:  # materialized in the buffer, which the next module reuses: copy out what lives there
            staging.release(module)  # (a bias); a module materialized elsewhere holds nothing of it (a torchao weight)
        processed = layer_tensors(module)
        if info.kernel_tensors:  # atomic: committed at finalize
            _check_kernel_format(info, processed)
            info.staged = processed
            restore_layer_on_meta(module, info)
    session.buffered_bytes -= _buffered_bytes(info.loaded_weights)
    info.loaded_weights = []
    info.done = True
    session.processed.append(info.prefix)


def _check_kernel_format(info: LayerReloadingInfo, processed: dict[str, torch.Tensor]) -> None:
    if set(processed) != set(info.kernel_tensors):
        raise LayerwiseError(
            f"module {info.prefix}: processing produced {sorted(processed)}, "
            f"but the live model holds {sorted(info.kernel_tensors)}"
        )
    for name, new in processed.items():
        old = info.kernel_tensors[name]
        if new.shape != old.shape or new.dtype != old.dtype:
            raise LayerwiseError(
                f"{info.prefix}.{name}: processed {new.dtype}{tuple(new.shape)} does not "
                f"fit the kernel tensor {old.dtype}{tuple(old.shape)}"
            )


def _copy_checked(info: LayerReloadingInfo, live: dict[str, torch.Tensor]) -> bool | None:
    """Where every load of a module replayed into its live tensors is a verbatim copy that the native kernels
    take (:func:`cpu_native.copy_checked`), make those copies and return whether every loaded value is finite:
    the check its processing would make, in the copies' own pass (Limitations 11). Else None, nothing copied."""
    copies = []
    for b in info.loaded_weights:
        if b.verbatim_at is None:
            return None
        src = b.loaded_weight if isinstance(b.loaded_weight, torch.Tensor) else b.loaded_weight.materialize()
        dst = live[b.param_name].data.view(-1)[b.verbatim_at : b.verbatim_at + src.numel()]
        if not cpu_native.supports_copy(src, dst):
            return None
        copies.append((src, dst))
    finite = True
    for src, dst in copies:
        finite &= cpu_native.copy_checked(src, dst)
    return finite


def _loads_into_kernel_tensors(module: nn.Module, info: LayerReloadingInfo) -> bool:
    """Whether the module's kernel tensors are its checkpoint-format parameters (no quant method, or one whose
    ``checkpoint_format`` says processing only checks them), same names, shapes and dtypes, none a tensor
    subclass: a non-atomic reload can then replay the loads into them directly (Limitations 11)."""
    quant_method = getattr(module, "quant_method", None)
    if quant_method is not None and not quant_method.checkpoint_format:
        return False
    metas, live = info.restore_metadata, info.kernel_tensors
    if set(metas) != set(live):
        return False
    for name, meta in metas.items():
        t = live[name]
        if is_traceable_wrapper_subclass(t):  # its data is in inner tensors, not in t's own storage
            return False
        if (t.shape, t.dtype) != (meta.shape, meta.dtype) or not t.is_contiguous():
            return False
    return True


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same elements of the same storage (a copy between them is a no-op);
    never for tensor subclasses that wrap inner tensors (torchao's), whose own data_ptr says nothing."""
    if a is b:  # a quant method that wrote the live tensor itself (quant/torchao.py Limitations 5)
        return True
    if is_traceable_wrapper_subclass(a) or is_traceable_wrapper_subclass(b):
        return False
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _commit(module: nn.Module, info: LayerReloadingInfo, processed: dict[str, torch.Tensor]) -> None:
    """Copy processed values into the kernel tensors' storage (unless already written there) and put those
    objects back."""
    with torch.no_grad():
        for name, new in processed.items():
            old = info.kernel_tensors[name]
            if not _same_memory(new, old):
                old.copy_(new)
    set_layer_tensors(module, info.kernel_tensors)
