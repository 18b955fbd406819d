"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as in transformers' LlamaRMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerwise.quant.parameters import ModelWeightParameter, default_weight_loader


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); x [..., hidden] in any float dtype -> same dtype."""

    def __init__(self, hidden_size: int, eps: float, *, params_dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = ModelWeightParameter(torch.empty(hidden_size, dtype=params_dtype), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's rms_norm on the float32 input: x * rsqrt(mean(x^2) + eps), one fused kernel on CUDA
        # (aten._fused_rms_norm) where the spelled-out formula takes five; then the weight in x's dtype
        normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
