"""Mixtral (Jiang et al., 2024, "Mixtral of Experts"): Mistral's attention with a sparse
mixture-of-experts block in every decoder layer.

Checkpoint keys: ``model.layers.N.block_sparse_moe.gate.weight`` (router [E, H]) and
``model.layers.N.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` (gate, up, down). Routing
(transformers' ``MixtralTopKRouter``): softmax in float32, top ``num_experts_per_tok``, always
renormalized, weights kept in float32. Sliding-window attention when config.json sets
``sliding_window``. No tensor parallelism (TensorParallelError).
"""

from __future__ import annotations

import torch

from layerwise.config import ModelConfig
from layerwise.distributed import NO_TP, TPContext
from layerwise.layers.fused_moe import MIXTRAL_EXPERT_SHARDS
from layerwise.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from layerwise.models.mistral import MistralAttention
from layerwise.models.qwen3_moe import sparse_moe_block
from layerwise.quant.config import QuantConfig


class MixtralDecoderLayer(LlamaDecoderLayer):
    """x + attn(norm(x)), then h + block_sparse_moe(norm(h))."""

    attention_cls = MistralAttention

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig,
        dtype: torch.dtype,
        device: torch.device,
        prefix: str,
        *,
        tp: TPContext = NO_TP,
    ):
        super().__init__(config, quant_config, dtype, device, prefix, tp=tp)
        del self.mlp  # the dense MLP Llama builds (on meta); Mixtral's checkpoint names the block differently
        self.block_sparse_moe = sparse_moe_block(
            config,
            quant_config,
            dtype,
            f"{prefix}.block_sparse_moe",
            renormalize=True,
            scores_in_logits_dtype=False,
            expert_shards=MIXTRAL_EXPERT_SHARDS,
            tp=tp,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv_cache: tuple | None = None) -> torch.Tensor:
        h = x + self.self_attn(positions, self.input_layernorm(x), kv_cache)
        return h + self.block_sparse_moe(self.post_attention_layernorm(h))


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral decoder plus an LM head: int64 ids [B, T] -> logits [B, T, vocab] (see CausalLM.forward).

    Raises:
        TensorParallelError: built with a tensor-parallel group of more than one rank.
    """

    decoder_layer_cls = MixtralDecoderLayer
