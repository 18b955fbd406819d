"""Qwen3 (Qwen team, 2025): Llama's architecture with per-head RMSNorm on q and k before RoPE."""

from __future__ import annotations

import torch

from layerwise.config import ModelConfig
from layerwise.distributed import NO_TP, TPContext
from layerwise.layers.norm import RMSNorm
from layerwise.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from layerwise.quant.config import QuantConfig


class Qwen3Attention(LlamaAttention):
    """Adds q_norm and k_norm, RMSNorm over head_dim applied to every head. With ``use_sliding_window``,
    the layers that ``layer_types`` (or ``max_window_layers``) names attend over ``sliding_window`` keys."""

    def attention_window(self, config: ModelConfig, layer_idx: int) -> int | None:
        return config.sliding_window if config.is_sliding_layer(layer_idx) else None

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig,
        params_dtype: torch.dtype,
        device: torch.device,
        prefix: str,
        *,
        tp: TPContext = NO_TP,
    ):
        super().__init__(config, quant_config, params_dtype, device, prefix, tp=tp)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, params_dtype=params_dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, params_dtype=params_dtype)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor):
        """q [B, T, Hq, head_dim] and k [B, T, Hk, head_dim], each normalized over head_dim; same shapes."""
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with :class:`Qwen3Attention`."""

    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """The Qwen3 causal LM: :class:`LlamaForCausalLM` built of :class:`Qwen3DecoderLayer`."""

    decoder_layer_cls = Qwen3DecoderLayer
