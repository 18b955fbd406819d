"""What every layer shares in one forward is computed once per forward, not once per decoder layer: the
rotary cos/sin, and with a KV cache the attention mask of each distinct sliding window."""

import torch

import layerwise
import layerwise.models.llama as llama
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


def test_cache_masks_once_per_window(tmp_path, monkeypatch):
    """Qwen3 with a window on layers 1 and 2 only: two masks (full, window 4) for three layers; each layer's
    cached decode equals the one computing its own mask (the model before this change)."""
    kw = dict(num_layers=3, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    path = write_hf_checkpoint(tmp_path / "ckpt", "Qwen3ForCausalLM", **kw)
    model = layerwise.load_model(path, quantization=None, dtype=torch.float32)
    attn = model.model.layers[0].self_attn
    shape = (2, 16, attn.num_kv_heads, attn.head_dim)  # a cache already holding 16 random positions
    caches = [(torch.randn(shape), torch.randn(shape)) for _ in model.model.layers]
    ids, positions = torch.tensor([[5], [7]]), torch.tensor([[9], [12]])
    windows = []
    cache_mask = llama.cache_mask
    monkeypatch.setattr(llama, "cache_mask", lambda *a: windows.append(a[3]) or cache_mask(*a))
    with torch.no_grad():
        shared = model.model(ids, positions, [tuple(c.clone() for c in kv) for kv in caches])
    assert sorted(windows, key=str) == [4, None]
    monkeypatch.undo()
    per_layer = model.model.embed_tokens(ids)
    with torch.no_grad():
        for layer, kv in zip(model.model.layers, caches, strict=True):
            per_layer = layer(positions, per_layer, tuple(c.clone() for c in kv))  # no metadata: its own mask
        per_layer = model.model.norm(per_layer)
    assert torch.equal(shared, per_layer)


def test_q_and_k_rotated_together_in_the_decode_step(tmp_path, monkeypatch):
    """Llama's q and k are adjacent heads of the qkv_proj output: one rotation (one flip) per layer in a
    cached decode step, where Qwen3's per-head norms make two; the logits tests cover the values."""
    flips = []
    flip = torch.Tensor.flip
    monkeypatch.setattr(torch.Tensor, "flip", lambda self, *a, **k: flips.append(self.shape) or flip(self, *a, **k))
    for arch, per_layer in (("LlamaForCausalLM", 1), ("Qwen3ForCausalLM", 2)):
        path = write_hf_checkpoint(tmp_path / arch, arch, num_layers=3)
        model = layerwise.load_model(path, quantization=None)
        attn = model.model.layers[0].self_attn
        shape = (2, 8, attn.num_kv_heads, attn.head_dim)
        caches = [tuple(torch.zeros(shape, dtype=torch.bfloat16) for _ in "kv") for _ in range(3)]
        flips.clear()
        with torch.no_grad():
            model.model(torch.tensor([[5], [7]]), torch.tensor([[3], [4]]), caches)
        assert len(flips) == 3 * per_layer, arch
        if per_layer == 1:
            assert flips[0][2] == attn.num_heads + attn.num_kv_heads  # the joint [B, T, Hq + Hk, D] view
