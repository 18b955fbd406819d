"""One decoder layer's static KV cache: BF16 (the model's dtype) or FP8 e4m3 with a float32 scale per tensor.

FP8 (vLLM's ``kv_cache_dtype="fp8"``): a key k is stored as ``e4m3(clamp(k / k_scale, -448, 448))`` and read
back as ``fp8 * k_scale``; the same for values with ``v_scale``. The scales are per layer (one for K, one
for V), float32 [1], set by calibration (``scale = amax / 448`` over a calibration batch, layerwise/
kv_calibration.py) and rewritten in place after every weight change, so a captured CUDA graph that reads them
by address stays valid (FP8-RL, arXiv 2601.18150, recalibrates Q/K/V scales every RL step). A value beyond the
calibrated range is clamped to +-448 (never Inf or NaN) and counted.

Attention never multiplies the scales into the cache: softmax(q . (k8 * ks)) = softmax((q * ks) . k8), and
softmax(...) @ (v8 * vs) = (softmax(...) @ v8) * vs, so the scales fold into the query and the output; the FP8
bytes are only cast to the model's dtype (exact: e4m3's 3 mantissa bits and its exponents fit BF16 and float16),
one layer at a time inside its attention call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
KV_CACHE_DTYPES = ("auto", "fp8")  # vLLM's names: "auto" = the model's dtype, "fp8" = e4m3


@dataclass
class LayerKVCache:
    """One decoder layer's cache, or a view of some of its slots and positions.

    Attributes:
        k, v: [B, L, kv_heads, head_dim], the model's dtype, or float8_e4m3fn with the scales below.
        k_scale, v_scale: float32 [1] (FP8 only): stored value x scale = key / value. Shared by every view of the
            layer's cache.
        counts: int64 [2] (FP8 only), shared by all layers: values clamped to +-448, values written.
        amax: float32 [2] or None: when set, every write also raises it to the largest |key| and |value|
            written (calibration, on a BF16 scratch cache).
    """

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    amax: torch.Tensor | None = None

    @property
    def quantized(self) -> bool:
        return self.k.dtype == FP8_DTYPE

    @property
    def length(self) -> int:
        """Positions per slot (L)."""
        return self.k.shape[1]

    def __iter__(self):  # ``k_cache, v_cache = cache``, as for the (k, v) tuples it replaces
        return iter((self.k, self.v))

    def view(self, start: int, stop: int, length: int) -> LayerKVCache:
        """Slots start..stop-1, positions 0..length-1; the same storage, scales and counts."""
        return LayerKVCache(
            self.k[start:stop, :length], self.v[start:stop, :length], self.k_scale, self.v_scale, self.counts, self.amax
        )

    def write(self, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, T, kv_heads, head_dim] at (rows, positions) (int64 [B, T] each), quantized when FP8.
        No host synchronization (capturable in a CUDA graph)."""
        if self.amax is not None:
            self.amax.copy_(torch.maximum(self.amax, torch.stack([k.abs().amax(), v.abs().amax()]).float()))
        if self.quantized:
            k, v = self._quantize(k, self.k_scale), self._quantize(v, self.v_scale)
        self.k.index_put_((rows, positions), k)
        self.v.index_put_((rows, positions), v)

    def _quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        scaled = x.float() / scale
        if self.counts is not None:
            self.counts[0].add_((scaled.abs() > FP8_MAX).sum())  # kernels only (no host tensor): capturable
            self.counts[1].add_(x.numel())
        return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def as_layer_cache(cache) -> LayerKVCache:
    """A ``LayerKVCache`` as it is, or one made from a (k_cache, v_cache) tuple of the model's dtype."""
    return cache if isinstance(cache, LayerKVCache) else LayerKVCache(*cache)


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """The name if it is one of :data:`KV_CACHE_DTYPES`; ValueError naming the accepted ones otherwise."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        accepted = ", ".join(map(repr, KV_CACHE_DTYPES))
        raise ValueError(f"kv_cache_dtype must be one of {accepted}, got {kv_cache_dtype!r}")
    return kv_cache_dtype
