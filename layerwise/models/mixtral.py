"""Mixtral (Jiang et al., 2024, "Mixtral of Experts"): Mistral's attention with a sparse
mixture-of-experts block in every decoder layer.

Checkpoint keys: ``model.layers.N.block_sparse_moe.gate.weight`` (router [E, H]) and
``model.layers.N.block_sparse_moe.experts.<e>.{w1,w3,w2}.weight`` (gate, up, down). Routing
(transformers' ``MixtralTopKRouter``): softmax in float32, top ``num_experts_per_tok``, always
renormalized, weights kept in float32. Sliding-window attention when config.json sets
``sliding_window``. Under tensor parallelism the experts are sharded in one of vLLM's two layouts
(``layerwise/layers/fused_moe.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.config import ModelConfig
from layerwise.distributed import TPContext
from layerwise.layers.fused_moe import MIXTRAL_EXPERT_SHARDS
from layerwise.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from layerwise.models.mistral import MistralAttention
from layerwise.models.qwen3_moe import sparse_moe_block
from layerwise.quant.config import QuantConfig


class MixtralDecoderLayer(LlamaDecoderLayer):
    """x + attn(norm(x)), then h + block_sparse_moe(norm(h))."""

    attention_cls = MistralAttention
    mlp_name = "block_sparse_moe"  # the checkpoint's name for the feed-forward block

    def make_mlp(
        self, config: ModelConfig, quant_config: QuantConfig, params_dtype: torch.dtype, prefix: str, tp: TPContext
    ) -> nn.Module:
        """The sparse MoE block (router + fused experts) of every Mixtral layer."""
        return sparse_moe_block(
            config,
            quant_config,
            params_dtype,
            prefix,
            renormalize=True,
            scores_in_logits_dtype=False,
            expert_shards=MIXTRAL_EXPERT_SHARDS,
            tp=tp,
        )


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral decoder plus an LM head: int64 ids [B, T] -> logits [B, T, vocab] (see CausalLM.forward).

    Raises:
        TensorParallelError: a size of the config does not split over the tensor-parallel group.
    """

    decoder_layer_cls = MixtralDecoderLayer
