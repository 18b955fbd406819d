"""Causal self-attention through torch's scaled_dot_product_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full causal attention with grouped-query heads.

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hk, D] with Hq a multiple of Hk.
    Returns:
        [B, T, Hq * D] in q's dtype.
    """
    b, t, hq, d = q.shape
    hk = k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if hk != hq:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(b, t, hq * d)
