"""Quantization methods: how a layer's weights are created, processed after loading, and applied."""

from quant.base import QuantMethod, UnquantizedLinearMethod
from quant.config import QUANTIZATIONS, QuantConfig, check_quantization
from quant.fp8 import Fp8LinearMethod
from quant.parameters import ModelWeightParameter

__all__ = [
    "QUANTIZATIONS", "Fp8LinearMethod", "check_quantization", "ModelWeightParameter", "QuantConfig", "QuantMethod",
    "UnquantizedLinearMethod",
]
