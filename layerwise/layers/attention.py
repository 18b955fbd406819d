"""Causal self-attention through torch's scaled_dot_product_attention, with an optional static KV cache.

An optional ``sliding_window`` W (Mistral, Phi-3) restricts each query at position p to keys at
positions in (p - W, p]: W keys including its own, the convention of transformers' masking_utils
(``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``). None means full causal attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from layerwise.layers.kv_cache import LayerKVCache, as_layer_cache


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _visible(q_pos: torch.Tensor, kv_pos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Boolean mask, True where a query at ``q_pos`` [..., T, 1] may attend to a key at ``kv_pos`` [L]."""
    mask = kv_pos <= q_pos
    if sliding_window is not None:
        mask = mask & (kv_pos > q_pos - sliding_window)
    return mask


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, sliding_window: int | None = None
) -> torch.Tensor:
    """Full causal attention with grouped-query heads, over sequence indices 0..T-1.

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hk, D] with Hq a multiple of Hk.
        sliding_window: None, or the number of keys (own included) each query sees.
    Returns:
        [B, T, Hq * D] in q's dtype.
    """
    b, t, hq, d = q.shape
    groups = hq // k.shape[2]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    if sliding_window is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        idx = torch.arange(t, device=q.device)
        mask = _visible(idx[:, None], idx, sliding_window)  # [T, T]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(b, t, hq * d)


@dataclass
class AttentionMetadata:
    """What every layer's attention shares within one forward, computed once (vLLM's attn_metadata).

    Attributes:
        position_embeddings: (cos, signed sin) [B, T, 1, rotary_dim] in the activations' dtype
            (``RotaryEmbedding.cos_sin``).
        masks: with a KV cache, sliding window (None: full attention) -> :func:`cache_mask`
            [B, 1, groups * T, L]; None without a cache.
    """

    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    masks: dict | None = None


def cache_mask(
    positions: torch.Tensor, length: int, groups: int, sliding_window: int | None, dtype: torch.dtype
) -> torch.Tensor:
    """The additive attention mask of :func:`cached_attention`: 0 where a query at ``positions`` (int64
    [B, T]) may see a cached key (<= own position, and > own - ``sliding_window``), -inf elsewhere, in
    ``dtype``, shaped [B, 1, groups * T, L] for the folded grouped-query heads (row g * T + t: query t).

    The values SDPA derives from a boolean mask itself (``where(mask, 0, -inf)``), so results are the
    same; a model computes it once per forward and window instead of once per layer.
    """
    b, t = positions.shape
    visible = _visible(positions[:, :, None], torch.arange(length, device=positions.device), sliding_window)
    folded = visible[:, None].expand(b, groups, t, length).reshape(b, 1, groups * t, length)
    return torch.zeros((), dtype=dtype, device=positions.device).masked_fill(~folded, float("-inf"))


def cached_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: LayerKVCache | tuple[torch.Tensor, torch.Tensor],
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k/v at ``positions`` into a static cache, then attend to every cached position <= own
    (and, with ``sliding_window`` W, > own - W).

    Shapes are static (the cache length, not the sequence length, sets them) and nothing syncs
    with the host, so a decode step built on this can be captured in a CUDA graph. The window is a
    mask over the full-length cache, not a rolling buffer: the cache still holds max_seq_len positions.

    Args:
        q: [B, T, Hq, D]; k, v: [B, T, Hk, D]; positions: int64 [B, T].
        kv_cache: a :class:`~layerwise.layers.kv_cache.LayerKVCache` (BF16, or FP8 with its scales: keys and
            values are quantized as they are written, and the scales fold into the query and the output), or a
            (k_cache, v_cache) tuple of q's dtype; each [B, L, Hk, D], written in place.
        sliding_window: None, or the number of keys (own included) each query sees.
        mask: :func:`cache_mask` of these positions, cache length, grouping and window, when the caller
            computed it already (once per forward for all layers); None: computed here.
    Returns:
        [B, T, Hq * D] in q's dtype.
    """
    cache = as_layer_cache(kv_cache)
    b, t, hq, d = q.shape
    rows = torch.arange(b, device=q.device)[:, None].expand(b, t)
    cache.write(rows, positions, k, v)
    length, hk = cache.k.shape[1], cache.k.shape[2]
    groups = hq // hk
    if mask is None:
        mask = cache_mask(positions, length, groups, sliding_window, q.dtype)
    # Grouped-query heads folded into the query length: query head h = j * groups + g reads KV head j, so the
    # groups * T queries of KV head j attend to its cached keys as one [groups * T, L] problem. The cache is
    # read as it is, never repeated per query head (repeat_interleave copied the whole cache, every layer
    # and step: ~L * Hq * D * 2 elements).
    folded = q.view(b, t, hk, groups, d).permute(0, 2, 3, 1, 4).reshape(b, hk, groups * t, d)
    k_cache, v_cache = cache.k, cache.v
    if cache.quantized:  # q . (k8 * ks) = (q * ks) . k8; the output's V scale is applied after the sum
        folded = (folded.float() * cache.k_scale).to(q.dtype)
        k_cache, v_cache = k_cache.to(q.dtype), v_cache.to(q.dtype)
    out = F.scaled_dot_product_attention(
        folded, k_cache.transpose(1, 2), v_cache.transpose(1, 2), attn_mask=mask, scale=scale
    )  # [B, Hk, groups * T, D]
    if cache.quantized:
        out = (out.float() * cache.v_scale).to(q.dtype)
    return out.view(b, hk, groups, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, hq * d)


def attention(
    q,
    k,
    v,
    positions,
    kv_cache: LayerKVCache | tuple | None,
    scale: float,
    sliding_window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the sequence itself (no cache) or over a static KV cache.

    Shapes as in :func:`causal_attention` / :func:`cached_attention`; ``sliding_window`` and ``mask`` (with
    a cache only) as there.
    """
    if kv_cache is None:
        return causal_attention(q, k, v, scale, sliding_window)
    return cached_attention(q, k, v, positions, kv_cache, scale, sliding_window, mask)
