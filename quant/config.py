"""Choosing the quantization method for each layer from a scheme name."""

from __future__ import annotations

from dataclasses import dataclass

from quant.base import QuantMethod, UnquantizedLinearMethod
from quant.fp8 import Fp8LinearMethod

QUANTIZATIONS = ("fp8", "fp8-per-tensor", "none")


@dataclass(frozen=True)
class QuantConfig:
    """Which method quantizes which layer.

    Attributes:
        quantization: scheme name, one of ``QUANTIZATIONS`` ("fp8" is "fp8-per-tensor").
        kernel: "torch" or "triton" (already resolved for the target device).
        fp8_mode: "auto", "w8a8" or "w8a16" (see :class:`quant.fp8.Fp8LinearMethod`).
    Only decoder Linear layers are quantized; embeddings, norms and lm_head keep the checkpoint dtype.
    """

    quantization: str = "none"
    kernel: str = "torch"
    fp8_mode: str = "auto"

    def __post_init__(self):
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose one of {QUANTIZATIONS}")

    @property
    def scheme(self) -> str:
        """Canonical scheme name ("fp8-per-tensor" or "none")."""
        return "fp8-per-tensor" if self.quantization in ("fp8", "fp8-per-tensor") else "none"

    def get_linear_method(self, prefix: str) -> QuantMethod:
        """The method for the Linear layer at ``prefix`` (e.g. "model.layers.0.mlp.down_proj")."""
        if self.scheme == "none":
            return UnquantizedLinearMethod()
        return Fp8LinearMethod(kernel=self.kernel, mode=self.fp8_mode)
