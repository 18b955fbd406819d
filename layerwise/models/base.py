"""What every causal LM shares: construction arguments, weight routing, forward signature."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from layerwise.config import ModelConfig
from layerwise.distributed import NO_TP, TPContext
from layerwise.quant.config import QuantConfig
from layerwise.routing import load_weights

_ID_DTYPES = (torch.int64, torch.int32)  # what torch.nn.functional.embedding takes


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

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Refuse ids the embedding would fail on with an IndexError deep inside (or, on CUDA, a device-side assert).

        The shape and dtype are checked on every device (tensor metadata: no work, safe inside a CUDA graph
        capture). The range [0, vocab_size) is checked on CPU tensors only, with one min/max reduction: on another
        device it would read the result back to the host, a synchronization in every decode step that a CUDA graph
        capture also forbids (:meth:`layerwise.engine.Engine.generate` checks its prompts on the host instead), and
        not while torch.compile traces (a data-dependent host read would break the graph).

        Raises:
            ValueError: not a 2-D int64 / int32 tensor [batch, seq] (names the dtype and shape), or an id outside
                [0, vocab_size) (names the id and the vocabulary size).
        """
        if not isinstance(input_ids, torch.Tensor):
            raise ValueError(f"input_ids must be a 2-D integer tensor [batch, seq], got a {type(input_ids).__name__}")
        if input_ids.dim() != 2 or input_ids.dtype not in _ID_DTYPES:
            one_sequence = "; for one sequence pass input_ids[None]" if input_ids.dim() == 1 else ""
            raise ValueError(
                f"input_ids must be a 2-D integer tensor [batch, seq] (int64 or int32), got {input_ids.dtype} of "
                f"shape {tuple(input_ids.shape)}{one_sequence}"
            )
        if input_ids.device.type != "cpu" or input_ids.numel() == 0 or torch.compiler.is_compiling():
            return
        low, high = (int(x) for x in torch.aminmax(input_ids))
        vocab = self.config.vocab_size
        if low < 0 or high >= vocab:
            raise ValueError(
                f"input_ids holds token id {low if low < 0 else high}, outside the vocabulary [0, {vocab}) "
                f"(vocab_size of config.json)"
            )

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
        Raises:
            ValueError: ``input_ids`` is not a 2-D int64 / int32 tensor, or (on the CPU) holds an id outside
                [0, vocab_size); see :meth:`check_input_ids`.
        """
        self.check_input_ids(input_ids)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        hidden = self.model(input_ids, positions, kv_caches)
        return self.lm_head.compute_logits(hidden)
