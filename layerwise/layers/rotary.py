"""Rotary position embeddings (Su et al., RoFormer, 2021), "rotate half" layout as in transformers.

Supports the default frequencies and Llama 3's ``rope_type: llama3`` scaling (the piecewise
smoothing of transformers' ``_compute_llama3_parameters``). Frequencies are a non-persistent buffer
created directly on the target device (they are not in checkpoints); cos/sin are computed per call
in float32 from the positions.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def default_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """inv_freq[i] = theta^(-2i / head_dim), float32 [head_dim / 2] on ``device``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3 frequency scaling: long wavelengths divided by ``factor``, short kept, a smooth blend
    between (keys: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [B, T, Hq, D] and k [B, T, Hk, D] at positions [B, T] (int64).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """

    def __init__(self, head_dim: int, rope_theta: float, rope_scaling: Optional[dict], device: torch.device):
        super().__init__()
        # Explicit device: the model is built under torch.device("meta"), but these frequencies are
        # computed, not loaded, so they are created where the model will run.
        inv_freq = default_inv_freq(head_dim, rope_theta, device)
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, llama3)")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]          # [B, T, 1, D]
        cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
