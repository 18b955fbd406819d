"""Quantization methods: how a layer's weights are created, processed after loading, and applied."""

from layerwise.quant.base import QuantMethod, UnquantizedLinearMethod
from layerwise.quant.config import QUANTIZATIONS, QuantConfig, check_quantization
from layerwise.quant.fp8 import Fp8LinearMethod
from layerwise.quant.parameters import ModelWeightParameter

__all__ = [
    "QUANTIZATIONS", "Fp8LinearMethod", "check_quantization", "ModelWeightParameter", "QuantConfig", "QuantMethod",
    "UnquantizedLinearMethod",
]
