"""Tensor parallelism: the explicit group a model is sharded over (never the default group).

:class:`TPContext` is handed to every layer constructor, so rank and size come from the group given to
``load_model(..., tp_group=...)`` and from nothing else: a model loaded inside a trainer whose default
group spans many processes is not sharded unless it is given a group. ``NO_TP`` (group None, rank 0 of 1)
means no tensor parallelism, whatever torch.distributed's state.

Collectives: all_reduce (sum for row-parallel outputs and the vocab-parallel embedding, max for global
FP8 amax) and all_gather (vocab-parallel logits); gloo on CPU, NCCL on CUDA, whatever backend the group has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from layerwise.errors import TensorParallelError


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group of a model and this process's place in it.

    Attributes:
        group: a torch.distributed ProcessGroup, or None (no tensor parallelism).
        rank: this process's rank within ``group`` (0 without one).
        size: the number of ranks in ``group`` (1 without one).
        expert_parallel: how mixture-of-experts layers use the group (vLLM's ``enable_expert_parallel``): False,
            every rank holds every expert with its intermediate dimension sharded (tensor parallelism over the
            experts); True, rank r holds experts [r*E/N, (r+1)*E/N) whole. Dense layers ignore it.
    """

    group: Any = None
    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    @classmethod
    def of(cls, group: Any, expert_parallel: bool = False) -> TPContext:
        """The context of ``group`` (None: ``NO_TP``). Rank and size are read from the group only.

        Raises:
            TensorParallelError: a group is given but torch.distributed is not initialized.
        """
        if group is None:
            return NO_TP
        if not (dist.is_available() and dist.is_initialized()):
            raise TensorParallelError("tp_group given, but torch.distributed is not initialized")
        return cls(group, dist.get_rank(group), dist.get_world_size(group), bool(expert_parallel))

    def divide(self, total: int, what: str) -> int:
        """``total // size``, for a size that must split evenly across the ranks.

        Raises:
            TensorParallelError: ``total`` is not a multiple of the group size (names ``what`` and both sizes).
        """
        if total % self.size:
            raise TensorParallelError(f"{what}={total} is not divisible by the tensor-parallel size {self.size}")
        return total // self.size

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` in place over the group ("sum" or "max"); the identity without TP.

        Raises:
            ValueError: another ``op`` (checked with or without TP, so a typo fails on one rank too).
        """
        if op not in ("sum", "max"):
            raise ValueError(f"all_reduce op must be 'sum' or 'max', got {op!r}")
        if self.size > 1:  # ReduceOp only here: a torch built without distributed has none
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim`` in rank order; the identity without TP."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor, group=self.group)
        return torch.cat(parts, dim=dim)


#: no tensor parallelism
NO_TP = TPContext()
