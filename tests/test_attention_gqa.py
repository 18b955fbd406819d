"""Decode attention over a static KV cache reads grouped-query KV heads without repeating the cache."""

import torch

from layerwise.layers.attention import cached_attention
from layerwise.memory import DeviceMemoryTracker


def test_cached_attention_does_not_repeat_the_cache():
    # a decode step (T = 1) of a Llama-3-8B-like head layout over a long cache: 32 query heads on 8 KV heads
    b, t, hq, hk, d, length = 2, 1, 32, 8, 64, 2048
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, t, h, d, generator=gen) for h in (hq, hk, hk))
    cache = tuple(torch.randn(b, length, hk, d, generator=gen) for _ in range(2))
    positions = torch.full((b, t), length - 1)
    expected_cache = [c.clone() for c in cache]
    with DeviceMemoryTracker("cpu") as tracker:
        out = cached_attention(q, k, v, positions, cache, 0.125)
    # the reference: every query head attends to its own copy of its KV head (transformers' repeat_kv)
    for c, new in zip(expected_cache, (k, v), strict=True):
        c[:, length - 1] = new[:, 0]
    rep_k, rep_v = (c.transpose(1, 2).repeat_interleave(hq // hk, dim=1) for c in expected_cache)
    ref = torch.softmax(q.transpose(1, 2) @ rep_k.transpose(2, 3) * 0.125, dim=-1) @ rep_v
    torch.testing.assert_close(out, ref.transpose(1, 2).reshape(b, t, hq * d), rtol=1e-5, atol=1e-5)
    repeated_cache = 2 * b * length * hq * d * 4  # what repeat_interleave of K and V allocates: 64 MiB
    # measured 86,288 bytes (positions, masks, the folded query, the output); with the cache repeated per query
    # head (the code before): 67,146,000
    assert tracker.peak_bytes <= 96 * 1024 < repeated_cache
