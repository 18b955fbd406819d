"""Deferred checks (Limitations 12): NaN/Inf checks made on the device while modules stream, read at once later.

Processing (``processing``, ``units``) runs inside :func:`_deferral`: in a session with ``defer_checks`` each
finiteness check appends a device flag instead of reading it, and the flags are kept on the session as one
:class:`DeferredCheck` per module (per processing call of a unit-wise module), with the loads that name its key.
Without ``defer_checks`` the checks raise where they are made and nothing is kept. The session reads the flags
at finalize and abort (:func:`_failed_deferred`, one wait for the device), a weight update at the end of each
batch (:func:`check_deferred`); this module turns the failed ones into the modules and key an error names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from layerwise.errors import NonFiniteWeightError
from layerwise.kernels import has_non_finite
from layerwise.kernels.finite import deferred_finite_checks
from layerwise.quant.parameters import async_host_copies
from layerwise.reload.types import BufferedLoad, DeferredCheck, ReloadSession


def _find_non_finite_key(loads: list[BufferedLoad]) -> str | None:
    for buffered in loads:
        w = buffered.loaded_weight
        if has_non_finite(w if isinstance(w, torch.Tensor) else w.materialize()):  # a LazyTensor: read it
            return buffered.key
    return None


@contextlib.contextmanager
def _deferral(session: ReloadSession, prefix: str, loads: list[BufferedLoad]) -> Iterator[list[torch.Tensor]]:
    """With ``session.defer_checks``: finiteness checks recorded and host-to-device copies that do not wait, for the
    block (Limitations 12); otherwise nothing. Yields the list the checks are recorded into (the block may add its
    own flags); when the block ends without an error they are kept for finalize as one DeferredCheck of the module
    ``prefix`` (a unit-wise module gets one per processing call), with the ``loads`` that name its key."""
    flags: list[torch.Tensor] = []
    if session.defer_checks:
        with deferred_finite_checks(flags), async_host_copies():
            yield flags
    else:
        yield flags
    if flags:
        flag = flags[0] if len(flags) == 1 else torch.stack(flags).any()
        session.deferred.append(DeferredCheck(prefix, flag, loads))


def model_defers_checks(model: nn.Module) -> bool:
    """Whether ``model``'s reloads of a list and its checkpoint-format weight updates defer their NaN/Inf checks
    (Limitations 12): on CUDA (on the CPU no device waits for the host), without tensor parallelism (a NaN must
    fail every rank's amax reduction at once)."""
    if getattr(model, "tp_group", None) is not None:
        return False
    return any(p.device.type == "cuda" for p in model.parameters())


def on_device(device: torch.device):
    """The session's CUDA device made current (Triton launches on the current device's stream, torch ops on the
    tensors' device: with the model on cuda:1 both must be cuda:1's); nothing for other devices."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _drain(session: ReloadSession) -> None:
    """Wait for the device work a session that defers its checks may have left queued on the device's current
    stream (copies from the caller's tensors among it): after this the caller may reuse those tensors."""
    if session.defer_checks and session.device.type == "cuda":
        torch.cuda.current_stream(session.device).synchronize()


def _failed_deferred(session: ReloadSession) -> list[DeferredCheck]:
    """Wait for the device, then read every deferred check in one go (Limitations 12) and forget them; returns the
    checks of the modules that held NaN or Inf (written like the others)."""
    checks, session.deferred = session.deferred, []
    _drain(session)
    if not checks:
        return []
    flags = torch.stack([c.flag for c in checks]).tolist()
    return [c for c, bad in zip(checks, flags, strict=True) if bad]


def _failed_modules(failed: list[DeferredCheck]) -> list[str]:
    """The modules of ``failed``, each once (a unit-wise module has a check per processing call)."""
    return list(dict.fromkeys(c.prefix for c in failed))


def _add_non_finite(session: ReloadSession, failed: list[DeferredCheck]) -> None:
    """Add the modules of ``failed`` to ``session.non_finite_modules``, each module listed once."""
    session.non_finite_modules.extend(m for m in _failed_modules(failed) if m not in session.non_finite_modules)


def _non_finite_message(failed: list[DeferredCheck], atomic: bool, where: str = "the stream") -> str:
    modules = _failed_modules(failed)
    subject = "these modules were" if len(modules) > 1 else "the module was"
    effect = "staged, not written (atomic)" if atomic else "written with it"
    return (
        f"non-finite value (NaN or Inf) in a weight of {', '.join(modules)}, found at the end of "
        f"{where}: {subject} {effect}"
    )


def check_deferred(session: ReloadSession) -> None:
    """Wait for the device and read the checks deferred so far (Limitations 12), as a weight update does at the
    end of each batch, while the batch's tensors are still valid (the transport refills them next).

    Raises:
        NonFiniteWeightError: a module processed since the last read held NaN or Inf; it was written like the
            others and is added to ``session.non_finite_modules`` (atomic: staged, and not added). Names the key.
    """
    failed = _failed_deferred(session)
    if failed:
        if not session.atomic:  # staged modules are dropped by the abort that follows: nothing holds the NaN
            _add_non_finite(session, failed)
        message = _non_finite_message(failed, session.atomic, "the batch")
        raise NonFiniteWeightError(message, key=_find_non_finite_key(failed[0].loads))
