"""Qwen2 (Qwen team, 2024): Llama's architecture with a bias on the q, k and v projections."""

from __future__ import annotations

from layerwise.config import ModelConfig
from layerwise.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Attention(LlamaAttention):
    """q/k/v projections carry a bias; o_proj does not. With ``use_sliding_window``, the layers that
    ``layer_types`` (or ``max_window_layers``) names attend over ``sliding_window`` keys."""

    qkv_bias = True

    def attention_window(self, config: ModelConfig, layer_idx: int) -> int | None:
        return config.sliding_window if config.is_sliding_layer(layer_idx) else None


class Qwen2DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer with :class:`Qwen2Attention`."""

    attention_cls = Qwen2Attention


class Qwen2ForCausalLM(LlamaForCausalLM):
    """The Qwen2 causal LM: :class:`LlamaForCausalLM` built of :class:`Qwen2DecoderLayer`."""

    decoder_layer_cls = Qwen2DecoderLayer
