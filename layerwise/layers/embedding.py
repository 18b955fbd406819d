"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerwise.distributed import get_tp_rank, get_tp_size
from layerwise.quant.parameters import ModelWeightParameter


class VocabParallelEmbedding(nn.Module):
    """Embedding table [vocab / tp_size, hidden] in ``params_dtype`` (never quantized)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.weight = ModelWeightParameter(
            torch.empty(num_embeddings // self.tp_size, embedding_dim, dtype=params_dtype),
            self.weight_loader,
            output_dim=0,
        )

    def weight_loader(self, param, loaded_weight, shard_id=None):
        param.load_shard(loaded_weight, tp_rank=self.tp_rank, tp_size=self.tp_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids LongTensor [B, T] -> embeddings [B, T, hidden] (tp_size == 1)."""
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab, kept in the checkpoint dtype. With tied embeddings the
    model uses its ``embed_tokens`` module as ``lm_head`` instead (one module, one weight)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
