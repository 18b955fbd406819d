"""Qwen2 / Qwen3 with ``use_sliding_window``: the window applies to the layers transformers names
(``layer_types``, derived from ``max_window_layers``), full attention to the others."""

import json

import pytest
import torch

import layerwise
from layerwise.engine import Engine
from tests.engine_helpers import greedy
from tests.hf_checkpoints import hf_logits, write_hf_checkpoint

WINDOW = 4
ARCHS = ["Qwen2ForCausalLM", "Qwen3ForCausalLM"]


@pytest.fixture(scope="module", params=ARCHS)
def windowed(request, tmp_path_factory):
    """3 layers, a window of 4 on layers 1 and 2 (max_window_layers 1), layer 0 full."""
    root = tmp_path_factory.mktemp(request.param)
    kw = dict(num_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    return write_hf_checkpoint(root / "ckpt", request.param, seed=2, **kw)


def test_the_window_is_on_the_layers_transformers_names(windowed):
    config = json.loads((windowed / "config.json").read_text())
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    model = layerwise.load_model(windowed, quantization=None)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, WINDOW, WINDOW]


def test_logits_match_transformers_beyond_the_window(windowed):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(windowed, ids)
    model = layerwise.load_model(windowed, quantization=None, dtype=torch.float32)
    with torch.no_grad():
        out = model(ids)
    err = (out - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), err
    for layer in model.model.layers:  # the same model with full attention everywhere differs beyond the window
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        full = model(ids)
    torch.testing.assert_close(full[:, :WINDOW], out[:, :WINDOW])
    assert (full[:, WINDOW:] - ref[:, WINDOW:]).abs().amax() > 100 * err


def test_config_without_layer_types_uses_max_window_layers(windowed, tmp_path):
    """An older config.json (no layer_types) gets the same layers from max_window_layers."""
    import shutil

    copy = tmp_path / "no-layer-types"
    shutil.copytree(windowed, copy)
    config = json.loads((copy / "config.json").read_text())
    del config["layer_types"]
    (copy / "config.json").write_text(json.dumps(config))
    model = layerwise.load_model(copy, quantization=None)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, WINDOW, WINDOW]


def test_engine_kv_cache_matches_full_recompute_beyond_the_window(windowed):
    from layerwise.demo import greedy_tokens

    # float32: in BF16 this random model's logits have near-ties that cached and full recomputation round apart
    engine = Engine.from_pretrained(windowed, max_batch_size=2, max_seq_len=32, dtype=torch.float32)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1]]
    new = 10
    assert greedy(engine, prompts, new) == [greedy_tokens(engine.model, p, new) for p in prompts]


@pytest.mark.parametrize("drop", [("layer_types", "max_window_layers"), ("layer_types", "use_sliding_window")])
def test_absent_keys_take_transformers_defaults(windowed, tmp_path, drop):
    """Without max_window_layers the window starts at layer 28 (none of 3); without use_sliding_window a Qwen
    config has no window at all: transformers' defaults, checked against its own logits."""
    import shutil

    copy = tmp_path / "defaults"
    shutil.copytree(windowed, copy)
    config = json.loads((copy / "config.json").read_text())
    for key in drop:
        config.pop(key, None)
    (copy / "config.json").write_text(json.dumps(config))
    model = layerwise.load_model(copy, quantization=None, dtype=torch.float32)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, None, None]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    ref = hf_logits(copy, ids)
    with torch.no_grad():
        assert (model(ids) - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
