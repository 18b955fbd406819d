"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 as in transformers' LlamaRMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from layerwise.quant.parameters import ModelWeightParameter, default_weight_loader


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)); x [..., hidden] in any float dtype -> same dtype."""

    def __init__(self, hidden_size: int, eps: float, *, params_dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = ModelWeightParameter(torch.empty(hidden_size, dtype=params_dtype), default_weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)
