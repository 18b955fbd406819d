"""Qwen3-MoE (Qwen team, 2025; Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k
RMSNorm) with sparse mixture-of-experts MLPs.

Decoder layer i has a sparse block (``mlp.gate`` router [E, H] + ``mlp.experts.<e>.{gate,up,down}_proj``)
unless i is in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers' rule), in
which case it has Qwen3's dense MLP of ``intermediate_size``. Routing: softmax in float32, top
``num_experts_per_tok``, renormalized only with ``norm_topk_prob``, weights cast back to the
activation dtype (transformers' ``Qwen3MoeTopKRouter``). Sliding-window attention on every layer when
``use_sliding_window`` is set, as transformers does. Under tensor parallelism the experts are sharded in one of
vLLM's two layouts (``layerwise/layers/fused_moe.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.config import ModelConfig
from layerwise.distributed import TPContext
from layerwise.layers.fused_moe import QWEN_EXPERT_SHARDS, SparseMoeBlock
from layerwise.models.llama import LlamaDecoderLayer, LlamaForCausalLM, layer_index
from layerwise.models.qwen3 import Qwen3Attention
from layerwise.quant.config import QuantConfig


class Qwen3MoeAttention(Qwen3Attention):
    """Qwen3 attention; honours ``sliding_window`` (None unless config.json sets use_sliding_window)."""

    def attention_window(self, config: ModelConfig, layer_idx: int) -> int | None:
        return config.sliding_window  # every layer, as transformers' Qwen3-MoE (no layer_types)


def sparse_moe_block(
    config: ModelConfig,
    quant_config: QuantConfig,
    params_dtype: torch.dtype,
    prefix: str,
    *,
    renormalize: bool,
    scores_in_logits_dtype: bool,
    expert_shards,
    tp: TPContext,
) -> SparseMoeBlock:
    """The MoE block of one decoder layer, its experts quantized as ``quant_config`` says.

    Raises:
        ValueError: a scheme with no MoE method (see :meth:`layerwise.quant.config.QuantConfig.get_moe_method`).
        TensorParallelError: the experts (expert parallelism) or their intermediate size do not split over ``tp``.
    """
    return SparseMoeBlock(
        config.num_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.moe_intermediate_size,
        renormalize=renormalize,
        scores_in_logits_dtype=scores_in_logits_dtype,
        quant_method=quant_config.get_moe_method(f"{prefix}.experts"),
        params_dtype=params_dtype,
        expert_shards=expert_shards,
        prefix=prefix,
        tp=tp,
    )


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """Pre-norm decoder layer: attention, then a sparse MoE block (or, per the config, a dense MLP)."""

    attention_cls = Qwen3MoeAttention

    def make_mlp(
        self, config: ModelConfig, quant_config: QuantConfig, params_dtype: torch.dtype, prefix: str, tp: TPContext
    ) -> nn.Module:
        """The sparse MoE block, or Qwen3's dense MLP where the config makes layer ``prefix`` dense."""
        if not config.is_moe_layer(layer_index(prefix)):  # prefix: "model.layers.<i>.mlp"
            return super().make_mlp(config, quant_config, params_dtype, prefix, tp)
        return sparse_moe_block(
            config,
            quant_config,
            params_dtype,
            prefix,
            renormalize=config.norm_topk_prob,
            scores_in_logits_dtype=True,
            expert_shards=QWEN_EXPERT_SHARDS,
            tp=tp,
        )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE decoder plus an LM head: int64 ids [B, T] -> logits [B, T, vocab] (see CausalLM.forward).

    Raises:
        TensorParallelError: a size of the config does not split over the tensor-parallel group.
    """

    decoder_layer_cls = Qwen3MoeDecoderLayer
