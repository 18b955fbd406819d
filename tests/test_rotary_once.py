"""The rotary cos/sin are computed once per model forward, not once per decoder layer."""

import torch

import layerwise
from layerwise.layers.rotary import RotaryEmbedding
from tests.hf_checkpoints import write_hf_checkpoint


def test_cos_sin_once_per_forward(tmp_path, monkeypatch):
    path = write_hf_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM", num_layers=3)
    model = layerwise.load_model(path, quantization=None)
    calls = []
    cos_sin = RotaryEmbedding.cos_sin
    monkeypatch.setattr(RotaryEmbedding, "cos_sin", lambda self, *a: calls.append(self) or cos_sin(self, *a))
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3, 4]]))
    assert len(calls) == 1  # three layers, one computation (their results are covered by the logits tests)
