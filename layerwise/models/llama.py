"""Llama (Touvron et al., 2023; Llama 3, 2024): pre-norm decoder with GQA attention, RoPE, SwiGLU MLP.

Module and parameter names follow the Hugging Face checkpoint (model.layers.N.self_attn.*, mlp.*),
except that q/k/v and gate/up are fused layers that declare the checkpoint names they absorb.
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.checkpoint import decoder_layer
from layerwise.config import ModelConfig
from layerwise.config_fields import ACTIVATIONS
from layerwise.distributed import NO_TP, TPContext
from layerwise.errors import ConfigError
from layerwise.layers.attention import AttentionMetadata, attention, cache_mask
from layerwise.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from layerwise.layers.kv_cache import LayerKVCache, as_layer_cache
from layerwise.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from layerwise.layers.norm import RMSNorm
from layerwise.layers.rotary import RotaryEmbedding
from layerwise.models.base import CausalLM
from layerwise.quant.config import QuantConfig


class LlamaMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)), gate and up fused as gate_up_proj; act is ``config.hidden_act``
    (:data:`~layerwise.config_fields.ACTIVATIONS`, SiLU by default), biases with ``config.mlp_bias``."""

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig,
        params_dtype: torch.dtype,
        prefix: str,
        *,
        tp: TPContext = NO_TP,
    ):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            checkpoint_shards={"gate_proj": 0, "up_proj": 1},
            bias=config.mlp_bias,
            quant_method=quant_config.get_linear_method(f"{prefix}.gate_up_proj"),
            params_dtype=params_dtype,
            prefix=f"{prefix}.gate_up_proj",
            tp=tp,
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=config.mlp_bias,
            quant_method=quant_config.get_linear_method(f"{prefix}.down_proj"),
            params_dtype=params_dtype,
            prefix=f"{prefix}.down_proj",
            tp=tp,
        )
        self.act_fn = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., hidden] -> [..., hidden] in x.dtype."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def layer_index(prefix: str) -> int:
    """The decoder-layer index of a module prefix "model.layers.<i>[.<module>...]".

    Raises:
        ValueError: the prefix names no decoder layer.
    """
    index = decoder_layer(prefix) if prefix.startswith("model.layers.") else None
    if index is None:
        raise ValueError(f"{prefix!r} is not inside a decoder layer (model.layers.<i>)")
    return index


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with rotary positions."""

    qkv_bias = None  # None: from config.attention_bias; Qwen2 forces True

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
        super().__init__()
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        bias = config.attention_bias if self.qkv_bias is None else self.qkv_bias
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=bias,
            quant_method=quant_config.get_linear_method(f"{prefix}.qkv_proj"),
            params_dtype=params_dtype,
            prefix=f"{prefix}.qkv_proj",
            tp=tp,
        )
        # this rank's heads (the kv head replicated when tp > num_key_value_heads)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads_per_rank, self.qkv_proj.num_kv_heads_per_rank
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim,
            config.hidden_size,
            bias=config.attention_bias and self.qkv_bias is None,
            quant_method=quant_config.get_linear_method(f"{prefix}.o_proj"),
            params_dtype=params_dtype,
            prefix=f"{prefix}.o_proj",
            tp=tp,
        )
        self.rotary_emb = self.make_rotary(config, device)
        self.sliding_window = self.attention_window(config, layer_index(prefix))
        if self.sliding_window is not None and (type(self.sliding_window) is not int or self.sliding_window < 1):
            raise ConfigError(
                f"config.json sliding_window must be a positive integer or null, got {self.sliding_window!r}"
            )

    def make_rotary(self, config: ModelConfig, device: torch.device) -> RotaryEmbedding:
        """Hook for the rotary embedding (Phi-3 rotates part of each head)."""
        return RotaryEmbedding(
            self.head_dim,
            config.rope_theta,
            config.rope_scaling,
            device,
            max_position_embeddings=config.max_position_embeddings,
        )

    def attention_window(self, config: ModelConfig, layer_idx: int) -> int | None:
        """Hook: how many keys (own included) each query of decoder layer ``layer_idx`` sees; None: all
        (Llama). Mistral, Phi-3, Mixtral and Qwen3-MoE: ``config.sliding_window`` on every layer; Qwen2 and
        Qwen3: on the layers ``config.is_sliding_layer`` names."""
        return None

    # Hook for per-head q/k normalization between the projection and the rotation: None in Llama; Qwen3 defines
    # qk_norm(q, k) -> (q, k). Without it q and k are rotated together, as one view of the qkv_proj output.
    qk_norm = None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: LayerKVCache | tuple | None = None,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """x [B, T, H] at int64 positions [B, T] -> [B, T, H]; ``attn_metadata``: the model's rotary cos/sin
        and cache masks for this forward (computed here when not given)."""
        b, t, _ = x.shape
        heads, kv_heads, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        if attn_metadata is None:
            attn_metadata = AttentionMetadata(self.rotary_emb.cos_sin(positions, qkv.dtype))
        v = qkv[..., (heads + kv_heads) * d :].view(b, t, kv_heads, d)
        if self.qk_norm is None:  # q and k heads are adjacent in qkv: one rotation for both (fewer kernels)
            qk = qkv[..., : (heads + kv_heads) * d].view(b, t, heads + kv_heads, d)
            q, k = self.rotary_emb.rotate(qk, *attn_metadata.position_embeddings).split([heads, kv_heads], dim=2)
        else:
            q = qkv[..., : heads * d].view(b, t, heads, d)
            k = qkv[..., heads * d : (heads + kv_heads) * d].view(b, t, kv_heads, d)
            q, k = self.qk_norm(q, k)
            q, k = self.rotary_emb.apply(q, k, *attn_metadata.position_embeddings)
        mask = attn_metadata.masks.get(self.sliding_window) if attn_metadata.masks else None
        return self.o_proj(attention(q, k, v, positions, kv_cache, self.scale, self.sliding_window, mask))


class LlamaDecoderLayer(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)).

    Subclasses change the feed-forward block through :meth:`make_mlp` and its checkpoint name through
    ``mlp_name`` (Mixtral: "block_sparse_moe"); the module is registered under that name, which the
    checkpoint keys route through.
    """

    attention_cls = LlamaAttention
    mlp_name = "mlp"

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
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype)
        self.self_attn = self.attention_cls(config, quant_config, params_dtype, device, f"{prefix}.self_attn", tp=tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype)
        self.add_module(
            self.mlp_name, self.make_mlp(config, quant_config, params_dtype, f"{prefix}.{self.mlp_name}", tp)
        )

    def make_mlp(
        self, config: ModelConfig, quant_config: QuantConfig, params_dtype: torch.dtype, prefix: str, tp: TPContext
    ) -> nn.Module:
        """The feed-forward block at ``prefix``: [..., H] -> [..., H] (Llama: the gated SiLU MLP)."""
        return LlamaMLP(config, quant_config, params_dtype, prefix, tp=tp)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: LayerKVCache | tuple | None = None,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """x [B, T, hidden] at int64 positions [B, T] -> [B, T, hidden]; ``kv_cache`` and ``attn_metadata`` as in
        :meth:`LlamaAttention.forward`."""
        h = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, attn_metadata)
        return h + self._modules[self.mlp_name](self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """embed_tokens -> N decoder layers -> final norm."""

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig,
        params_dtype: torch.dtype,
        device: torch.device,
        layer_cls=LlamaDecoderLayer,
        *,
        tp: TPContext = NO_TP,
    ):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, params_dtype=params_dtype, tp=tp
        )
        self.layers = nn.ModuleList(
            layer_cls(config, quant_config, params_dtype, device, f"model.layers.{i}", tp=tp)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, params_dtype=params_dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list | None = None) -> torch.Tensor:
        """input_ids and positions int64 [B, T] -> final-norm hidden states [B, T, hidden] in the model's dtype.

        ``kv_caches``: None (attention over the sequence itself), or one ``LayerKVCache`` (or (k_cache, v_cache)
        tuple) per decoder layer, each [B, L, kv heads of this rank, head_dim], written at ``positions``
        (``layers.attention.cached_attention``).
        """
        x = self.embed_tokens(input_ids)
        # once per forward, not once per layer (fewer kernels per decode step): the rotary cos/sin, from the
        # first layer's rotary embedding (every layer's is built from the same config), in the activations'
        # dtype, which q and k keep; with a cache, one mask per distinct sliding window
        first = self.layers[0].self_attn
        metadata = AttentionMetadata(first.rotary_emb.cos_sin(positions, x.dtype))
        if kv_caches is not None:
            kv_caches = [as_layer_cache(c) for c in kv_caches]
            length, groups = kv_caches[0].length, first.num_heads // first.num_kv_heads
            windows = {layer.self_attn.sliding_window for layer in self.layers}
            metadata.masks = {w: cache_mask(positions, length, groups, w, x.dtype) for w in windows}
        for i, layer in enumerate(self.layers):
            x = layer(positions, x, None if kv_caches is None else kv_caches[i], metadata)
        return self.norm(x)


class LlamaForCausalLM(CausalLM):
    """Llama decoder plus an LM head (tied to embed_tokens when tie_word_embeddings)."""

    decoder_layer_cls = LlamaDecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig,
        params_dtype: torch.dtype,
        device: torch.device,
        *,
        tp: TPContext = NO_TP,
    ):
        super().__init__(config, quant_config, params_dtype, device, tp=tp)
        self.model = LlamaModel(config, quant_config, params_dtype, device, self.decoder_layer_cls, tp=tp)
        if config.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=params_dtype, tp=tp)
