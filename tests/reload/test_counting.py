"""layerwise/reload/counting.py: what a weight loader writes, measured on the meta device, equals what
the same loader writes into a real tensor."""

import pytest
import torch

from layerwise.quant.parameters import ModelWeightParameter, default_weight_loader
from layerwise.reload.counting import record_loader, written_numel
from layerwise.reload.types import coverage


def _real_written(loader, shape, loaded, shard_id):
    """Elements a loader writes, by running it on a NaN-filled real parameter."""
    param = ModelWeightParameter(torch.full(shape, float("nan")), default_weight_loader, output_dim=0)
    loader(param, loaded, shard_id)
    return int((~torch.isnan(param)).sum())


def _shard_loader(offsets):
    def loader(param, loaded_weight, shard_id=None):
        offset, size = offsets[shard_id]
        param.load_shard(loaded_weight, offset, size)

    return loader


@pytest.mark.parametrize("shard_id", ["q", "k", "v"])
def test_a_fused_shard_write_is_counted_exactly(shard_id):
    offsets = {"q": (0, 8), "k": (8, 4), "v": (12, 4)}
    loader = _shard_loader(offsets)
    meta = ModelWeightParameter(torch.empty(16, 5, device="meta"), loader, output_dim=0)
    loaded = torch.randn(offsets[shard_id][1], 5)
    writes = record_loader(loader, meta, loaded, shard_id)[0]
    assert written_numel(writes) == _real_written(loader, (16, 5), loaded, shard_id) == loaded.numel()
    unwritten, doubled = coverage(writes, meta.numel())
    assert (unwritten, doubled) == (meta.numel() - loaded.numel(), 0)


def test_three_shards_cover_the_parameter_and_a_repeat_is_a_double_write():
    offsets = {"q": (0, 8), "k": (8, 4), "v": (12, 4)}
    loader = _shard_loader(offsets)
    meta = ModelWeightParameter(torch.empty(16, 5, device="meta"), loader, output_dim=0)
    writes = []
    for shard_id, (_, size) in offsets.items():
        writes += record_loader(loader, meta, torch.randn(size, 5), shard_id)[0]
    assert coverage(writes, meta.numel()) == (0, 0)
    writes += record_loader(loader, meta, torch.randn(4, 5), "k")[0]
    assert coverage(writes, meta.numel()) == (0, 20)


def test_recording_touches_no_real_memory_and_passes_loader_errors_through():
    from layerwise.errors import WeightShapeError

    loader = _shard_loader({"q": (0, 8)})
    meta = ModelWeightParameter(torch.empty(16, 5, device="meta"), loader, output_dim=0)
    loaded = torch.randn(8, 5)
    before = loaded.clone()
    record_loader(loader, meta, loaded, "q")
    assert torch.equal(loaded, before) and meta.device.type == "meta"
    with pytest.raises(WeightShapeError):
        record_loader(loader, meta, torch.randn(7, 5), "q")
