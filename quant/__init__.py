"""Quantization methods: how a layer's weights are created, processed after loading, and applied."""

from layerwise.quant.base import QuantMethod, UnquantizedLinearMethod
from layerwise.quant.config import QuantConfig, parse_scheme, register_scheme, scheme_names
from layerwise.quant.fp8 import Fp8LinearMethod
from layerwise.quant.parameters import ModelWeightParameter

__all__ = [
    "Fp8LinearMethod",
    "ModelWeightParameter",
    "QuantConfig",
    "QuantMethod",
    "parse_scheme",
    "register_scheme",
    "scheme_names",
    "UnquantizedLinearMethod",
]
