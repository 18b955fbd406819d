"""Exceptions raised by layerwise. Each names the checkpoint file and tensor key where known.

A leaf module: it imports nothing from the project, so every package (layerwise.kernels,
layerwise.quant, layerwise) raises these same classes. A kernel raises NonFiniteWeightError without
a key; the loader that fed it adds the key and file (``add_context``) on the way up.
"""

from __future__ import annotations


class LayerwiseError(Exception):
    """Base class. ``key`` and ``file`` name the checkpoint tensor and file involved, when known."""

    def __init__(self, message: str, key: str | None = None, file: str | None = None):
        super().__init__(message)
        self.message = message
        self.key = key
        self.file = file

    def add_context(self, key: str | None = None, file: str | None = None) -> LayerwiseError:
        """Fill in key/file if not set yet; returns self so it can be re-raised."""
        self.key = self.key or key
        self.file = self.file or file
        return self

    def __str__(self) -> str:
        where = []
        if self.key:
            where.append(f"tensor {self.key!r}")
        if self.file:
            where.append(f"file {self.file}")
        return f"{self.message} ({', '.join(where)})" if where else self.message


class CheckpointError(LayerwiseError):
    """The checkpoint directory is unusable: no config.json, a listed shard is absent, bad index."""


class CheckpointChangedError(CheckpointError):
    """A checkpoint file changed while it was being read: truncated, rewritten in place or replaced (another
    file at its path) since the checkpoint opened it, as its size, mtime or inode tell, or a read came back
    short. The message says what changed (``size 1000 -> 512 bytes``, ...); ``file`` names it, ``key`` the
    tensor being read (None for the check at the end of a stream). Raised before the tensor read is used, so
    none read while its file changed reaches the model; a reload wraps it in a ReloadError (its ``cause``),
    Limitations 13 in ``layerwise/reload/__init__.py``."""


class ConfigError(CheckpointError, ValueError):
    """config.json lacks a required field or holds a value the model cannot take (an unknown rope_type, a
    sliding_window that is not a positive integer, layer_types of the wrong length). Raised while the config
    is parsed or the model is built; the loader names the file."""


class UnsupportedArchitectureError(LayerwiseError):
    """config.json names an architecture that has no model class in the registry."""


class UnexpectedWeightError(LayerwiseError):
    """The checkpoint holds a tensor that no parameter of the model takes."""


class WeightShapeError(LayerwiseError, ValueError):
    """A checkpoint tensor's shape (or dtype: an integer tensor for a float parameter; a kernel-format tensor of
    another dtype) does not fit the parameter (region) it is loaded into."""


class WeightDtypeError(WeightShapeError):
    """A checkpoint tensor's dtype does not fit the parameter it is loaded into, so a copy would cast it silently:
    an integer or bool tensor for a floating-point parameter, a float8 tensor for a parameter that is not float8
    (a model loaded from a BF16 checkpoint: its e4m3 values read as BF16 would be thousands of times too large),
    a tensor that is not float8 for the float8 weight of a model loaded from an FP8 checkpoint, or another float8
    variant (e5m2 for e4m3). Raised while the tensor is routed, before anything is written; names key and dtype."""


class NonFiniteWeightError(LayerwiseError, ValueError):
    """A tensor to be loaded or quantized holds NaN or Inf (it would poison an FP8 scale)."""


class MissingWeightError(LayerwiseError):
    """Some parameter (or part of one) was never provided by the checkpoint."""


class MissingScaleError(WeightDtypeError, MissingWeightError):
    """The float8 weight of a module of an FP8 checkpoint arrived without its scale (``weight_scale_inv`` /
    ``weight_scale``), or the scale without its weight: the two are one unit, and neither is written without the
    other. ``key`` names the tensor that did not arrive. On a reload the error is also a ReloadError."""


class DuplicateWeightError(LayerwiseError):
    """Some region of a parameter was written more than once in one load or reload."""


class ReloadError(LayerwiseError):
    """A reload or weight update failed. ``updated_modules`` lists the modules whose kernel tensors
    were already overwritten with new values (empty for an atomic reload, which changed nothing);
    ``non_finite_modules`` those of them written with NaN or Inf by a reload that checks on the device
    and reads the results at its end (``layerwise/reload`` Limitations 12) when another error ended it
    first; ``cause`` is the underlying error (UnexpectedWeightError, WeightShapeError, ..., or an OSError
    or RuntimeError raised midway), when there is one."""

    def __init__(self, message: str, updated_modules=(), key=None, file=None, non_finite_modules=()):
        super().__init__(message, key=key, file=file)
        self.updated_modules = list(updated_modules)
        self.non_finite_modules = list(non_finite_modules)
        self.cause: Exception | None = None

    @classmethod
    def wrap(
        cls, cause: Exception, updated_modules: list, action: str = "reload", non_finite_modules: list = ()
    ) -> ReloadError:
        """A ReloadError for ``cause`` after the session was aborted, naming what was already updated (and
        written with NaN or Inf); raise it ``from cause``. ``cause`` is a LayerwiseError, or any other Exception
        the stream or torch raised midway (an OSError of a truncated file, a RuntimeError): either way the
        caller learns which modules hold new values."""
        note = cls.note(updated_modules, non_finite_modules)
        if isinstance(cause, LayerwiseError):
            message, key, file = cause.message, cause.key, cause.file
        else:
            message, key, file = f"{type(cause).__name__}: {cause}", None, None
        err = cls(
            f"{action} failed: {message}; {note}",
            updated_modules=updated_modules,
            key=key,
            file=file,
            non_finite_modules=non_finite_modules,
        )
        err.cause = cause
        return err

    @staticmethod
    def note(updated_modules: list, non_finite_modules: list = ()) -> str:
        """What an aborted reload or update left: the modules it overwrote, and those written with NaN or Inf."""
        note = f"modules already updated: {updated_modules}" if updated_modules else "no module was changed"
        if non_finite_modules:
            note += f"; written with NaN or Inf: {list(non_finite_modules)}"
        return note


class WeightTransferError(ReloadError):
    """A weight update failed in transport (not because of a tensor's content).

    Like every ReloadError, ``updated_modules`` lists what the failed update already overwrote (filled
    in by ``layerwise.transfer.update`` after it aborted the update; empty when atomic).
    """


class WeightTransferTimeoutError(WeightTransferError, TimeoutError):
    """No data from the peer within the configured timeout, or its connection closed (it died).

    ``key`` names the tensor that was being waited for. After this error the transfer engine's group is
    unusable: call ``shutdown()`` and ``init_transfer_engine`` again (with the trainer) before the next update.
    """


class MissingDependencyError(LayerwiseError, ImportError):
    """An optional dependency is not installed; the message gives the exact ``pip install`` line
    (see :func:`layerwise.optional.import_optional`)."""


class DeviceError(LayerwiseError, ValueError):
    """The target device is unusable with this torch build or machine: not a device name, a device type layerwise
    does not run on, CUDA on a torch without CUDA or without a visible GPU, or a GPU index past the visible ones.
    Raised before anything is built or read (:func:`layerwise.api.resolve_device`). ``device`` is the device as
    given, ``reason`` what is wrong with it and what to do (the CLI prints it after its ``--device`` option)."""

    def __init__(self, device, reason: str):
        super().__init__(f"device {str(device)!r}: {reason}")
        self.device = device
        self.reason = reason

    def __reduce__(self):  # pickled across processes (spawned workers) with both arguments
        return type(self), (self.device, self.reason)


class TensorParallelError(LayerwiseError, ValueError):
    """A model cannot be sharded over the given tensor-parallel group (sizes that do not divide),
    or the group is unusable. Raised while the model is built, before any weight is read."""
