"""layerwise: load BF16 Hugging Face checkpoints as FP8 layer by layer, and hot-reload them in place."""

from layerwise.api import LoadReport, ReloadReport, load_model, load_model_with_report, reload_weights
from layerwise.errors import (
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

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DeviceError",
    "DuplicateWeightError",
    "LayerwiseError",
    "LoadReport",
    "MissingDependencyError",
    "MissingWeightError",
    "NonFiniteWeightError",
    "ReloadError",
    "TensorParallelError",
    "UnexpectedWeightError",
    "UnsupportedArchitectureError",
    "ReloadReport",
    "WeightShapeError",
    "load_model",
    "load_model_with_report",
    "reload_weights",
]
