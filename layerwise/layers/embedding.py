"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks.

Sharding rule from vLLM (``vllm/model_executor/layers/vocab_parallel_embedding.py``): the vocabulary V
is padded to V_pad = ceil(V/N) * N rows and rank r holds rows [r*V_pad/N, (r+1)*V_pad/N); rows past V are
padding (zeros, never read from the checkpoint). The embedding looks up ids inside its range, writes zero
for the others and all-reduces (sum); the LM head computes its rows' logits and all-gathers them, dropping
the padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerwise.distributed import NO_TP, TPContext
from layerwise.quant.parameters import ModelWeightParameter


class VocabParallelEmbedding(nn.Module):
    """Embedding table [ceil(V/N), hidden] per rank in ``params_dtype`` (never quantized).

    Args:
        num_embeddings: the full vocabulary V; embedding_dim: hidden size.
        tp: the tensor-parallel group (default: none, the whole table).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype, tp: TPContext = NO_TP):
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.rows_per_rank = -(-num_embeddings // tp.size)  # ceil: the padded vocabulary split evenly
        self.vocab_start = tp.rank * self.rows_per_rank
        self.num_real_rows = max(0, min(self.rows_per_rank, num_embeddings - self.vocab_start))
        self.weight = ModelWeightParameter(
            torch.empty(self.rows_per_rank, embedding_dim, dtype=params_dtype), self.weight_loader, output_dim=0
        )

    def weight_loader(self, param, loaded_weight, shard_id=None):
        """Read rows [vocab_start, vocab_start + num_real_rows) of the [V, hidden] checkpoint table; zero
        the padding rows (they count as written, so the module completes)."""
        if self.num_real_rows > 0:  # a rank past the vocabulary (V=5 at tp=4) holds only padding
            param.load_shard(
                loaded_weight,
                0,
                self.num_real_rows,
                dim="output",
                source_start=self.vocab_start,
                source_size=self.num_embeddings,
            )
        if self.num_real_rows < self.rows_per_rank:
            with torch.no_grad():
                param.data[self.num_real_rows :].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids int64 [B, T] (full vocabulary) -> embeddings [B, T, hidden], the same on every rank."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_real_rows)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = out.masked_fill(~inside[..., None], 0)
        return self.tp.all_reduce(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., hidden] -> logits [..., V] over the full vocabulary (all-gathered, padding dropped).

        Also the LM head of models with tied embeddings."""
        logits = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., : self.num_embeddings]


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab, kept in the checkpoint dtype, rows split as the embedding's.
    With tied embeddings the model uses its ``embed_tokens`` module as ``lm_head`` instead (one module,
    one weight)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)
