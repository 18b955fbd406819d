"""Causal self-attention through torch's scaled_dot_product_attention, with an optional static KV cache."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Full causal attention with grouped-query heads.

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hk, D] with Hq a multiple of Hk.
    Returns:
        [B, T, Hq * D] in q's dtype.
    """
    b, t, hq, d = q.shape
    groups = hq // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, _expand_kv(k, groups), _expand_kv(v, groups), is_causal=True,
                                         scale=scale)
    return out.transpose(1, 2).reshape(b, t, hq * d)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     kv_cache: tuple[torch.Tensor, torch.Tensor], scale: float) -> torch.Tensor:
    """Write k/v at ``positions`` into a static cache, then attend to every cached position <= own.

    Shapes are static (the cache length, not the sequence length, sets them) and nothing syncs
    with the host, so a decode step built on this can be captured in a CUDA graph.

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hk, D]; positions: int64 [B, T].
        kv_cache: (k_cache, v_cache), each [B, L, Hk, D], written in place.
    Returns:
        [B, T, Hq * D] in q's dtype.
    """
    k_cache, v_cache = kv_cache
    b, t, hq, d = q.shape
    rows = torch.arange(b, device=q.device)[:, None].expand(b, t)
    k_cache.index_put_((rows, positions), k)
    v_cache.index_put_((rows, positions), v)
    length = k_cache.shape[1]
    mask = torch.arange(length, device=q.device)[None, None, :] <= positions[:, :, None]  # [B, T, L]
    groups = hq // k_cache.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), _expand_kv(k_cache.transpose(1, 2), groups),
                                         _expand_kv(v_cache.transpose(1, 2), groups), attn_mask=mask[:, None],
                                         scale=scale)
    return out.transpose(1, 2).reshape(b, t, hq * d)


def attention(q, k, v, positions, kv_cache: Optional[tuple], scale: float) -> torch.Tensor:
    """Causal attention over the sequence itself (no cache) or over a static KV cache."""
    if kv_cache is None:
        return causal_attention(q, k, v, scale)
    return cached_attention(q, k, v, positions, kv_cache, scale)
