"""Rotary position embeddings (Su et al., RoFormer, 2021), "rotate half" layout as in transformers.

Supports the default frequencies, linear scaling (``rope_type: linear``: frequencies divided by
``factor``), YaRN (Peng et al., 2023; ``rope_type: yarn``, transformers' ``_compute_yarn_parameters``),
Llama 3's ``rope_type: llama3`` scaling (the piecewise smoothing of transformers'
``_compute_llama3_parameters``) and LongRoPE (Ding et al., 2024;
``rope_type: longrope``, Phi-3 128k: short or long per-frequency factors, chosen per call as in
transformers' ``longrope_frequency_update``). A partial rotary dimension (Phi-3's
``partial_rotary_factor``) rotates the first ``rotary_dim`` features of each head and passes the rest.
Frequencies are non-persistent buffers created directly on the target device (they are not in
checkpoints); cos/sin are computed in float32 from the positions, once per model forward (``cos_sin``)
and applied by every layer (``rotate`` / ``apply``).

Fewer kernels per decode step, same values: transformers' ``rotate_half(x) * sin`` is computed as
``swap_halves(x) * signed_sin``, where ``signed_sin`` (made once per forward) carries rotate_half's minus
on its first half (one flip instead of a neg and a cat; (-a) * b and a * (-b) are the same float); and a
model without per-head q/k norms rotates q and k as one [B, T, Hq + Hk, D] view of its qkv_proj output
(``LlamaAttention.forward``), one set of kernels for both.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from layerwise.config_fields import ROPE_TYPES
from layerwise.errors import ConfigError


def default_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """inv_freq[i] = theta^(-2i / head_dim), float32 [head_dim / 2] on ``device``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


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


def yarn_inv_freq(
    rotary_dim: int, theta: float, scaling: dict, max_position_embeddings: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, float]:
    """YaRN frequencies as transformers' ``_compute_yarn_parameters``: interpolated (divided by ``factor``) below the
    correction range of wavelengths, extrapolated (kept) above it, a linear ramp between.

    Args:
        scaling: factor (default max_position_embeddings / original), original_max_position_embeddings, and
            optionally attention_factor, mscale, mscale_all_dim, beta_fast (32), beta_slow (1), truncate (True).
    Returns:
        inv_freq float32 [rotary_dim / 2], and the cos/sin multiplier (attention_factor; default
        0.1 * ln(factor) + 1, or the ratio of the mscale and mscale_all_dim terms when both are set).
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original

    def get_mscale(scale, mscale=1):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(num_rotations):  # the dimension whose wavelength turns num_rotations times in original
        return (rotary_dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2, device=device).to(torch.float32) / rotary_dim)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention_factor


def longrope_inv_freq(
    rotary_dim: int, theta: float, scaling: dict, max_position_embeddings: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """LongRoPE frequencies as transformers' ``_compute_longrope_parameters``.

    Args:
        scaling: short_factor and long_factor (lists of rotary_dim / 2 numbers),
            original_max_position_embeddings, and optionally factor and attention_factor.
    Returns:
        (short inv_freq, long inv_freq) float32 [rotary_dim / 2], and the cos/sin multiplier
        (attention_factor; default sqrt(1 + ln(factor) / ln(original)), factor defaulting to
        max_position_embeddings / original).
    Raises:
        ConfigError: a factor list of the wrong length.
    """
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    powers = theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / rotary_dim)
    freqs = []
    for name in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[name], dtype=torch.float32, device=device)
        if ext.shape != powers.shape:
            raise ConfigError(f"longrope {name} has {ext.numel()} entries, expected {powers.numel()} (rotary_dim / 2)")
        freqs.append(1.0 / (ext * powers))
    return freqs[0], freqs[1], attention_factor


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [B, T, Hq, D] and k [B, T, Hk, D] at positions [B, T] (int64).

    Args:
        rotary_dim: features rotated at the start of each head (default: all ``head_dim``).
        max_position_embeddings: the config's value (LongRoPE's default ``factor`` is its ratio
            to original_max_position_embeddings).
    Raises:
        ConfigError: an unsupported ``rope_type``.
    """

    def __init__(
        self,
        head_dim: int,
        rope_theta: float,
        rope_scaling: dict | None,
        device: torch.device,
        *,
        rotary_dim: int | None = None,
        max_position_embeddings: int | None = None,
    ):
        super().__init__()
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.attention_factor = 1.0
        self.original_max_position_embeddings = None  # set for longrope: longer sequences use long factors
        # Explicit device: the model is built under torch.device("meta"), but these frequencies are
        # computed, not loaded, so they are created where the model will run.
        inv_freq = default_inv_freq(self.rotary_dim, rope_theta, device)
        long_inv_freq = None
        rope_type = (rope_scaling or {}).get("rope_type", "default")
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, rope_scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif rope_type == "yarn":
            inv_freq, self.attention_factor = yarn_inv_freq(
                self.rotary_dim, rope_theta, rope_scaling, max_position_embeddings, device
            )
        elif rope_type == "longrope":
            inv_freq, long_inv_freq, self.attention_factor = longrope_inv_freq(
                self.rotary_dim, rope_theta, rope_scaling, max_position_embeddings, device
            )
            self.original_max_position_embeddings = rope_scaling["original_max_position_embeddings"]
        elif rope_type != "default":
            raise ConfigError(f"unsupported rope_type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("long_inv_freq", long_inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin [B, T, 1, rotary_dim] in ``dtype`` for int64 ``positions`` [B, T], computed in
        float32; signed sin is sin with its first half negated (see the module docstring).

        They depend only on the positions, so a model computes them once per forward and every layer
        applies them (:meth:`apply`). No host sync (LongRoPE picks its factors on the device).
        """
        inv_freq = self.inv_freq
        if self.long_inv_freq is not None:  # a 0-d device tensor decides: no host sync, CUDA-graph safe
            is_long = positions.max() + 1 > self.original_max_position_embeddings
            inv_freq = torch.where(is_long, self.long_inv_freq, self.inv_freq)
        freqs = positions.to(torch.float32)[..., None] * inv_freq  # [B, T, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, R]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        half = self.rotary_dim // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.to(dtype), signed_sin.to(dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first ``rotary_dim`` features of every head of x [B, T, H, D] by :meth:`cos_sin`'s tensors:
        x * cos + rotate_half(x) * sin, with rotate_half(x) * sin computed as swap_halves(x) * signed_sin."""
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + swap_halves(x) * signed_sin
        rot = x[..., :r]
        return torch.cat((rot * cos + swap_halves(rot) * signed_sin, x[..., r:]), dim=-1)

    def apply(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor):
        """:meth:`rotate` q [B, T, Hq, D] and k [B, T, Hk, D]; returns (q, k) of the same shapes."""
        return self.rotate(q, cos, signed_sin), self.rotate(k, cos, signed_sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """:meth:`apply` with :meth:`cos_sin` of ``positions`` in q's dtype."""
        return self.apply(q, k, *self.cos_sin(positions, q.dtype))


def swap_halves(x: torch.Tensor) -> torch.Tensor:
    """cat(x2, x1) of the last dimension's halves x1, x2, as one flip of a [..., 2, D/2] view: a single kernel
    that reads strided input as it is (torch.roll would copy a non-contiguous input first on CUDA)."""
    return x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
