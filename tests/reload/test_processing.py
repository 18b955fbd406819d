"""layerwise/reload/processing.py: what a processed module leaves in the CPU staging buffer."""

import pytest
import torch

import layerwise
from layerwise.reload.session import staging_bytes
from tests.test_zero_weights import KEY, _bytes, _tensors, _write

pytest.importorskip("torchao.quantization")


@pytest.mark.parametrize("scheme", ["torchao:Int8WeightOnlyConfig", "torchao:Float8WeightOnlyConfig", "fp8"])
def test_an_atomic_reload_after_one_that_kept_the_staging_buffer(tmp_path, scheme):
    """A non-atomic reload keeps its staging buffer on the model (Limitations 8); an atomic reload after it processes a
    torchao module outside that buffer and must not ask the buffer to release it (a torchao tensor subclass has no
    storage of its own: that raised "invalid python storage")."""
    model = layerwise.load_model(_write(tmp_path / "a", _tensors(0)), quantization=scheme)
    layerwise.reload_weights(model, [(KEY, _tensors(1)[KEY].float())])  # a cast: staged, not taken as pieces
    assert staging_bytes(model) > 0
    layerwise.reload_weights(model, [(KEY, _tensors(0)[KEY])], atomic=True)
    fresh = layerwise.load_model(tmp_path / "a", quantization=scheme)
    got, want = model.model.layers[0].mlp.down_proj.weight, fresh.model.layers[0].mlp.down_proj.weight
    assert torch.equal(_bytes(got), _bytes(want))
