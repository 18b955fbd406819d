"""What every causal LM shares: construction arguments, weight routing, forward signature."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from layerwise.config import ModelConfig
from layerwise.distributed import NO_TP, TPContext
from layerwise.quant.config import QuantConfig
from layerwise.routing import load_weights


class CausalLM(nn.Module):
    """Base of the ``*ForCausalLM`` models.

    Subclasses build ``self.model`` (embed_tokens, layers, norm) and ``self.lm_head``; with
    ``tie_word_embeddings`` the LM head is the embedding module itself, so one weight serves both.

    Args:
        config: parsed config.json.
        quant_config: which Linear layers are quantized and how.
        params_dtype: checkpoint-format dtype of every parameter.
        device: target device for buffers that are computed rather than loaded (rotary frequencies);
            parameters are created on whatever device is current (meta during a layerwise load).
        tp: the tensor-parallel group every layer is sharded over (default: none). Kept as ``self.tp``;
            ``self.tp_group`` is its ProcessGroup (None without tensor parallelism).
    Raises:
        TensorParallelError: a size of the config does not split over ``tp`` (raised while building,
            before any weight is read).
    """

    def __init__(
        self,
        config: ModelConfig,
        quant_config: QuantConfig,
        params_dtype: torch.dtype,
        device: torch.device,
        *,
        tp: TPContext = NO_TP,
    ):
        super().__init__()
        self.config = config
        self.tp = tp

    @property
    def tp_group(self):
        """The tensor-parallel ProcessGroup the model is sharded over, or None."""
        return self.tp.group

    def skip_checkpoint_key(self, key: str) -> bool:
        """Checkpoint tensors that are not parameters: rotary inv_freq, and lm_head when tied."""
        if key.endswith("rotary_emb.inv_freq"):
            return True
        return self.config.tie_word_embeddings and key.startswith("lm_head.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Route (checkpoint key, tensor) pairs to the parameters' weight loaders (see layerwise/routing.py)."""
        return load_weights(self, weights, skip=self.skip_checkpoint_key)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor | None = None, kv_caches: list | None = None
    ) -> torch.Tensor:
        """Logits for a batch of token ids.

        Args:
            input_ids: int64 [B, T].
            positions: int64 [B, T], default 0..T-1 for every row.
            kv_caches: optional list, one (k_cache, v_cache) per decoder layer, each
                [B, L, num_kv_heads, head_dim]; k/v are written at ``positions`` and attention
                covers cached positions <= each token's own (see layers/attention.py).
        Returns:
            logits [B, T, vocab] in the parameters' dtype, the full vocabulary on every rank.
        """
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.model(input_ids, positions, kv_caches)
        return self.lm_head.compute_logits(hidden)
