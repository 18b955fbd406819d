"""Typed parameters: shard placement and tensor-parallel narrowing of checkpoint tensors."""

import pytest
import torch

from layerwise.errors import WeightShapeError
from layerwise.quant.parameters import ModelWeightParameter, default_weight_loader


def _param(shape, output_dim=None, input_dim=None):
    return ModelWeightParameter(torch.zeros(shape), default_weight_loader, output_dim, input_dim)


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_column_parallel_rank_takes_its_rows_into_a_fused_shard(tp_rank):
    full = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)  # checkpoint shard, 8 output rows
    p = _param((10, 3), output_dim=0)  # this rank's fused weight: 4 rows of this shard at offset 6
    p.load_shard(full, shard_offset=6, shard_size=4, tp_rank=tp_rank, tp_size=2)
    assert torch.equal(p[6:10], full[4 * tp_rank : 4 * tp_rank + 4])
    assert not p[:6].any()


@pytest.mark.parametrize("tp_rank", [0, 1])
def test_row_parallel_rank_takes_its_columns(tp_rank):
    full = torch.arange(3 * 8, dtype=torch.float32).view(3, 8)
    p = _param((3, 4), input_dim=1)
    p.load_shard(full, tp_rank=tp_rank, tp_size=2)
    assert torch.equal(p, full[:, 4 * tp_rank : 4 * tp_rank + 4])


def test_shape_mismatch_names_both_shapes():
    p = _param((4, 3), output_dim=0)
    with pytest.raises(WeightShapeError, match=r"\(5, 3\).*\(8, 3\)"):
        p.load_shard(torch.zeros(5, 3), tp_size=2)


def test_with_data_keeps_type_and_layout():
    p = _param((4, 3), output_dim=0, input_dim=1)
    q = p.with_data(torch.ones(4, 3))
    assert type(q) is ModelWeightParameter and (q.output_dim, q.input_dim) == (0, 1)
    assert q.weight_loader is p.weight_loader and not q.requires_grad
    with pytest.raises(ValueError):
        p.with_data(torch.ones(3, 4))
