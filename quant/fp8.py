"""FP8 (e4m3fn) per-tensor online quantization of Linear weights.

After loading, a layer holds ``weight`` (float8_e4m3fn, [out, in]) and ``weight_scale`` (float32,
shape [1]) with one scale over the whole fused parameter (qkv_proj, gate_up_proj), computed as
amax / 448 (kernels.reference). The forward runs either

* W8A8: the activation is quantized per tensor on the fly (dynamic scale = amax(x) / 448) and
  multiplied with ``torch._scaled_mm`` (CUDA on sm89+, and CPU in torch >= 2.13); or
* W8A16: the weight is dequantized to the activation dtype and multiplied with ``F.linear``.

This mirrors vLLM's online ``Fp8LinearMethod`` (checkpoint in BF16, quantized in
``process_weights_after_loading``) and its dynamic per-tensor activation scheme.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from kernels import FP8_DTYPE, FP8_E4M3_MAX, dequantize, fp8_quantize_per_tensor
from kernels.reference import amax, quantize
from quant.base import QuantMethod

FP8_MODES = ("auto", "w8a8", "w8a16")


def scaled_mm_supported(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` (CPU in torch >= 2.13; CUDA on sm89+)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and hasattr(torch, "_scaled_mm")


def scaled_mm_preferred(device: torch.device) -> bool:
    """Whether "auto" picks W8A8: on CUDA sm89+ only. torch 2.13's CPU ``_scaled_mm`` is a slow
    reference (measured here: ~30 MFLOP/s, 100 ms for 64x128x384), far behind dequantize + matmul."""
    return device.type == "cuda" and scaled_mm_supported(device)


class Fp8LinearMethod(QuantMethod):
    """Per-tensor FP8 weights; W8A8 via ``_scaled_mm`` or W8A16 via dequantize + ``F.linear``.

    Args:
        kernel: "torch" or "triton", the kernels used for quantizing weights at load time.
        mode: "auto" (W8A8 on CUDA sm89+ when both weight dims are multiples of 16, else W8A16),
            "w8a8" (also on CPU, where it is slow), or "w8a16".
    Raises:
        ValueError: unknown mode.
    """

    name = "fp8-per-tensor"

    def __init__(self, kernel: str = "torch", mode: str = "auto"):
        if mode not in FP8_MODES:
            raise ValueError(f"unknown fp8 mode {mode!r}; choose one of {FP8_MODES}")
        self.kernel = kernel
        self.mode = mode

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = fp8_quantize_per_tensor(layer.weight.data, self.kernel)
        del layer.weight
        layer.weight = nn.Parameter(q, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale.reshape(1), requires_grad=False)

    def _use_scaled_mm(self, weight: torch.Tensor) -> bool:
        if self.mode == "w8a16":
            return False
        out_features, in_features = weight.shape
        aligned = weight.device.type != "cuda" or (in_features % 16 == 0 and out_features % 16 == 0)
        if self.mode == "auto":
            return scaled_mm_preferred(weight.device) and aligned
        if not (scaled_mm_supported(weight.device) and aligned):
            raise RuntimeError(f"w8a8 requested but torch._scaled_mm cannot run shape {tuple(weight.shape)} "
                               f"on {weight.device}")
        return True

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight, weight_scale = layer.weight, layer.weight_scale
        if not self._use_scaled_mm(weight):
            return F.linear(x, dequantize(weight, weight_scale, x.dtype), bias)
        x2 = x.reshape(-1, x.shape[-1])
        # Dynamic per-tensor activation scale. No host sync (no finiteness check) so the step can
        # be captured in a CUDA graph; an all-zero activation gets the smallest scale and stays 0.
        x_scale = torch.clamp(amax(x2) / FP8_E4M3_MAX, min=torch.finfo(torch.float32).tiny).reshape(1)
        xq = quantize(x2, x_scale, torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device))
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])
