"""Choosing the quantization method for each layer from a scheme name."""

from __future__ import annotations

from dataclasses import dataclass

from layerwise.quant.base import QuantMethod, UnquantizedLinearMethod
from layerwise.quant.fp8 import Fp8LinearMethod

FP8_SCHEMES = {"fp8": "tensor", "fp8-per-tensor": "tensor", "fp8-per-channel": "channel", "fp8-per-block": "block"}
QUANTIZATIONS = (*FP8_SCHEMES, "none", "torchao:<ConfigName>")


def check_quantization(name: str) -> str:
    """Validate a scheme name; returns it. Raises ValueError naming the accepted ones."""
    if name in FP8_SCHEMES or name == "none" or (name.startswith("torchao:") and len(name) > 8):
        return name
    raise ValueError(f"unknown quantization {name!r}; choose one of {QUANTIZATIONS}")


@dataclass(frozen=True)
class QuantConfig:
    """Which method quantizes which layer.

    Attributes:
        quantization: "fp8" (= "fp8-per-tensor"), "fp8-per-channel", "fp8-per-block",
            "torchao:<ConfigName>" (a torchao.quantization config class) or "none".
        kernel: "torch" or "triton" (already resolved for the target device).
        fp8_mode: "auto", "w8a8" or "w8a16" (see :class:`quant.fp8.Fp8LinearMethod`).
    Only decoder Linear layers are quantized; embeddings, norms and lm_head keep the checkpoint dtype.
    Raises:
        ValueError: unknown scheme name (on construction).
    """

    quantization: str = "none"
    kernel: str = "torch"
    fp8_mode: str = "auto"

    def __post_init__(self):
        check_quantization(self.quantization)
        if self.quantization.startswith("torchao:"):
            from layerwise.quant.torchao import torchao_config

            torchao_config(self.quantization.split(":", 1)[1])  # fail early on a bad name

    @property
    def scheme(self) -> str:
        """Canonical scheme name ("fp8-per-tensor", "fp8-per-block", "torchao:...", "none")."""
        if self.quantization in FP8_SCHEMES:
            return f"fp8-per-{FP8_SCHEMES[self.quantization]}"
        return self.quantization

    def get_linear_method(self, prefix: str) -> QuantMethod:
        """The method for the Linear layer at ``prefix`` (e.g. "model.layers.0.mlp.down_proj")."""
        if self.quantization in FP8_SCHEMES:
            return Fp8LinearMethod(FP8_SCHEMES[self.quantization], self.kernel, self.fp8_mode)
        if self.quantization.startswith("torchao:"):
            from layerwise.quant.torchao import TorchaoLinearMethod

            return TorchaoLinearMethod(self.quantization.split(":", 1)[1])
        return UnquantizedLinearMethod()
