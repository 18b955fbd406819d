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
        """x [..., hidden] -> the same shape and dtype."""
        # torch's rms_norm, x * rsqrt(mean(x^2) + eps): one fused kernel on CUDA (aten._fused_rms_norm) where the
        # spelled-out formula takes five. For bf16/fp16 x it computes in float32 and rounds once to x's dtype,
        # as transformers' x.float() ... .to(dtype) does, without the two casts as kernels of their own; then the
        # weight, in x's dtype
        return self.weight * F.rms_norm(x, (x.shape[-1],), eps=self.eps)
