"""Tensor-parallel rank and world size, read from torch.distributed when it is initialized."""

from __future__ import annotations

import torch.distributed as dist


def get_tp_rank() -> int:
    """This process's tensor-parallel rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def get_tp_size() -> int:
    """Tensor-parallel world size (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
