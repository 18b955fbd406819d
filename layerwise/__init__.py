"""layerwise: load BF16 Hugging Face checkpoints as FP8 layer by layer, and hot-reload them in place."""

from typing import TYPE_CHECKING

from layerwise.errors import (
    CheckpointChangedError,
    CheckpointError,
    ConfigError,
    DeviceError,
    DuplicateWeightError,
    LayerwiseError,
    MissingDependencyError,
    MissingWeightError,
    NonFiniteWeightError,
    ReloadError,
    TensorParallelError,
    UnexpectedWeightError,
    UnsupportedArchitectureError,
    WeightShapeError,
)

__version__ = "0.1.0"  # the distribution's version too (pyproject.toml reads it)

if TYPE_CHECKING:  # what __getattr__ returns, for type checkers and editors
    from layerwise.api import LoadReport, ReloadReport, load_model, load_model_with_report, reload_weights
    from layerwise.engine import Engine
    from layerwise.outputs import CompletionOutput, Logprob, RequestOutput
    from layerwise.sampling_params import SamplingParams

# name -> the module it is imported from at first use (PEP 562): ``import layerwise`` (and the CLI's --help)
# imports no torch
_API = {
    **dict.fromkeys(("LoadReport", "ReloadReport", "load_model", "load_model_with_report", "reload_weights"), "api"),
    "Engine": "engine",
    "SamplingParams": "sampling_params",
    **dict.fromkeys(("CompletionOutput", "Logprob", "RequestOutput"), "outputs"),
}

__all__ = [
    "CheckpointChangedError",
    "CheckpointError",
    "CompletionOutput",
    "ConfigError",
    "DeviceError",
    "DuplicateWeightError",
    "Engine",
    "LayerwiseError",
    "LoadReport",
    "Logprob",
    "MissingDependencyError",
    "MissingWeightError",
    "NonFiniteWeightError",
    "ReloadError",
    "TensorParallelError",
    "UnexpectedWeightError",
    "UnsupportedArchitectureError",
    "ReloadReport",
    "RequestOutput",
    "SamplingParams",
    "WeightShapeError",
    "load_model",
    "load_model_with_report",
    "reload_weights",
]


def __getattr__(name: str):
    """The API names (from layerwise.api, .engine, .sampling_params, .outputs), and the submodules
    (``layerwise.checkpoint`` after ``import layerwise``,
    as when this package imported the API eagerly), each imported at its first use."""
    import importlib

    if name in _API:
        value = getattr(importlib.import_module(f"layerwise.{_API[name]}"), name)
        globals()[name] = value  # looked up once
        return value
    if name.startswith("__") or not name.isidentifier():  # dunder probes, "a.b": no submodule to import
        raise AttributeError(f"module 'layerwise' has no attribute {name!r}")
    try:
        return importlib.import_module(f"layerwise.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"layerwise.{name}":  # the submodule exists but imports something missing
            raise
        raise AttributeError(f"module 'layerwise' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
