"""Phi-3 (Abdin et al., 2024, "Phi-3 Technical Report"; also Phi-3.5 and Phi-4-mini, which share
``Phi3ForCausalLM``): Llama's architecture with sliding-window attention, LongRoPE in the 128k
variants and, in Phi-4-mini, RoPE on a fraction of each head (``partial_rotary_factor``).

Checkpoints store the fused ``self_attn.qkv_proj`` ([q | k | v] rows) and ``mlp.gate_up_proj``
([gate | up] rows) under the fused layers' own names, which load them whole (shard_id None), so the
Llama modules serve unchanged. No biases.
"""

from __future__ import annotations

import torch

from layerwise.config import ModelConfig
from layerwise.layers.rotary import RotaryEmbedding
from layerwise.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Phi3Attention(LlamaAttention):
    """Grouped-query attention over the last ``sliding_window`` positions, RoPE on the first
    ``head_dim * partial_rotary_factor`` features of each head."""

    qkv_bias = False

    def attention_window(self, config: ModelConfig, layer_idx: int) -> int | None:
        return config.sliding_window

    def make_rotary(self, config: ModelConfig, device: torch.device) -> RotaryEmbedding:
        scaling = config.rope_scaling
        if scaling is not None and scaling["rope_type"] in ("su", "yarn", "longrope"):
            # Phi3Config: "su"/"yarn" are old names of longrope; the top-level original_max_position_embeddings
            # (default 4096) wins over the one in the rope dict.
            original = config.raw.get("original_max_position_embeddings", 4096)
            scaling = dict(scaling, rope_type="longrope", original_max_position_embeddings=original)
        return RotaryEmbedding(
            self.head_dim,
            config.rope_theta,
            scaling,
            device,
            rotary_dim=int(self.head_dim * config.partial_rotary_factor),
            max_position_embeddings=config.max_position_embeddings,
        )


class Phi3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm decoder layer around Phi3Attention."""

    attention_cls = Phi3Attention


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi3 decoder plus an LM head: int64 ids [B, T] -> logits [B, T, vocab] (see CausalLM.forward)."""

    decoder_layer_cls = Phi3DecoderLayer
