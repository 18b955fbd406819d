"""Mistral (Jiang et al., 2023, "Mistral 7B"): Llama's architecture with sliding-window attention.

Each token attends to at most ``config.sliding_window`` keys, its own included (null: no window);
the window applies in the full forward and in the KV-cached decode path (layers/attention.py).
"""

from __future__ import annotations

from layerwise.config import ModelConfig
from layerwise.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class MistralAttention(LlamaAttention):
    """Grouped-query attention over the last ``sliding_window`` positions; no biases."""

    qkv_bias = False

    def attention_window(self, config: ModelConfig, layer_idx: int) -> int | None:
        return config.sliding_window


class MistralDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm decoder layer around MistralAttention."""

    attention_cls = MistralAttention


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral decoder plus an LM head: int64 ids [B, T] -> logits [B, T, vocab] (see CausalLM.forward)."""

    decoder_layer_cls = MistralDecoderLayer
