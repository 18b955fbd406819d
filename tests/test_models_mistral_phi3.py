"""Mistral (sliding-window attention) and Phi-3 (fused checkpoint tensors, partial RoPE, LongRoPE)
against transformers' own forward on checkpoints that transformers wrote."""

import json
import shutil

import pytest
import torch

import layerwise
from layerwise.checkpoint import Checkpoint
from layerwise.engine import Engine
from layerwise.layers.attention import cached_attention, causal_attention
from tests.engine_helpers import greedy
from tests.hf_checkpoints import hf_logits, sqnr_db, write_hf_checkpoint

WINDOW = 8  # hf_config's sliding_window for both architectures
# Phi-4-mini's shape of Phi3ForCausalLM: tied, RoPE on 3/4 of each head, LongRoPE, no window.
# original_max_position_embeddings 16: sequences of 17+ tokens take the long factors, of 16 the short ones.
LONGROPE = dict(
    tie=True,
    sliding_window=None,
    original_max_position_embeddings=16,
    rope_parameters={
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0, 1.2, 1.5, 2.0, 3.0, 4.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    },
)


def _legacy_config(src, dst, rope_type):
    """A copy of checkpoint ``src`` whose config.json uses the pre-transformers-5 layout: rope_theta and
    partial_rotary_factor at the top level, rope_scaling with ``"type": rope_type``."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    scaling = {"type": rope_type, "short_factor": rope["short_factor"], "long_factor": rope["long_factor"]}
    cfg.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"], rope_scaling=scaling)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mistral-phi3")
    ckpts = {
        "mistral": write_hf_checkpoint(root / "mistral", "MistralForCausalLM"),
        "phi3": write_hf_checkpoint(root / "phi3", "Phi3ForCausalLM"),
        "phi3-longrope": write_hf_checkpoint(root / "phi3-longrope", "Phi3ForCausalLM", **LONGROPE),
    }
    # "yarn" is one of Phi3Config's old names for longrope ("su", the other, transformers 5.23 fails to load)
    for rope_type in ("longrope", "yarn"):
        ckpts[f"phi3-legacy-{rope_type}"] = _legacy_config(
            ckpts["phi3-longrope"], root / f"legacy-{rope_type}", rope_type
        )
    return ckpts


def _ids(length, seed, batch=2):
    return torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window", [1, 3, WINDOW, None])
def test_attention_window_is_transformers_mask(window):
    """Both attention paths equal SDPA under transformers' own mask function: keys in (p - W, p]."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    g = torch.Generator().manual_seed(0)
    b, t, length = 2, 20, 32
    q = torch.randn(b, t, 4, 16, generator=g)  # 4 query heads
    k, v = (torch.randn(b, t, 2, 16, generator=g) for _ in range(2))  # 2 kv heads
    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    idx = torch.arange(t)
    mask = fn(0, 0, idx[:, None], idx[None, :])  # [T, T]
    ref = (
        torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2).repeat_interleave(2, 1),
            v.transpose(1, 2).repeat_interleave(2, 1),
            attn_mask=mask,
            scale=0.25,
        )
        .transpose(1, 2)
        .reshape(b, t, 64)
    )
    torch.testing.assert_close(causal_attention(q, k, v, 0.25, window), ref)
    cache = (torch.zeros(b, length, 2, 16), torch.zeros(b, length, 2, 16))
    torch.testing.assert_close(cached_attention(q, k, v, idx.expand(b, t), cache, 0.25, window), ref)
    if window == 1:  # each token sees only itself: the output is its own value vector
        torch.testing.assert_close(ref, v.repeat_interleave(2, 2).reshape(b, t, 64))


@pytest.mark.parametrize(
    "name,length",
    [
        ("mistral", 24),
        ("phi3", 24),
        ("phi3-longrope", 16),
        ("phi3-longrope", 24),
        ("phi3-legacy-longrope", 24),
        ("phi3-legacy-yarn", 24),
    ],
)
def test_unquantized_float32_matches_transformers(checkpoints, name, length):
    path = checkpoints[name]
    ids = _ids(length, seed=1)
    ref = hf_logits(path, ids)
    model = layerwise.load_model(path, quantization=None, dtype=torch.float32)
    with torch.no_grad():
        out = model(ids)
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"{name}: max |diff| {err}"


@pytest.mark.parametrize("name", ["mistral", "phi3", "phi3-longrope"])
def test_fp8_w8a16_sqnr(checkpoints, name):
    path = checkpoints[name]
    ids = _ids(24, seed=3)
    ref = hf_logits(path, ids)
    model = layerwise.load_model(path, quantization="fp8", dtype=torch.float32, fp8_mode="w8a16")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    with torch.no_grad():
        db = sqnr_db(ref, model(ids))
    assert db >= 18.0, f"{name}: SQNR {db:.1f} dB"


@pytest.mark.parametrize("name", ["mistral", "phi3"])
def test_engine_kv_cache_matches_full_recompute_beyond_the_window(checkpoints, name):
    from layerwise.demo import greedy_tokens

    engine = Engine.from_pretrained(checkpoints[name], max_batch_size=2, max_seq_len=32)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1]]
    new = 14  # the longer sequence reaches 24 tokens, three windows
    assert greedy(engine, prompts, new) == [greedy_tokens(engine.model, p, new) for p in prompts]


def test_window_changes_logits_only_beyond_it(checkpoints):
    """Without the window, the first WINDOW positions keep their logits and later ones change, in the
    full forward and in the KV-cached path alike (a model that ignored the window would fail here)."""
    model = layerwise.load_model(checkpoints["mistral"], quantization=None, dtype=torch.float32)
    attns = [layer.self_attn for layer in model.model.layers]
    assert [a.sliding_window for a in attns] == [WINDOW] * len(attns)
    ids = _ids(24, seed=4)
    positions = torch.arange(24).expand(2, 24)

    def logits(cached):
        shape = (2, 32, attns[0].num_kv_heads, attns[0].head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in attns] if cached else None
        with torch.no_grad():
            return model(ids, positions, caches)

    windowed = logits(cached=False)
    torch.testing.assert_close(logits(cached=True), windowed)
    for a in attns:
        a.sliding_window = None
    for cached in (False, True):
        full = logits(cached)
        torch.testing.assert_close(full[:, :WINDOW], windowed[:, :WINDOW])
        beyond = (full[:, WINDOW:] - windowed[:, WINDOW:]).abs().amax(dim=-1)  # [B, T - WINDOW]
        assert (beyond > 1e-3).all(), beyond


@pytest.mark.parametrize("name", ["phi3", "phi3-longrope"])
def test_phi3_fp8_bytes_of_fused_checkpoint_tensors(checkpoints, name):
    """qkv_proj / gate_up_proj come whole from the checkpoint; one per-tensor scale covers the fused
    tensor, and the bytes equal torch's own float8 cast."""
    path = checkpoints[name]
    model = layerwise.load_model(path, quantization="fp8")
    modules = dict(model.named_modules())
    fused = 0
    for key, w in Checkpoint(path):
        layer = key.removesuffix(".weight")
        if not layer.endswith(("qkv_proj", "gate_up_proj", "o_proj", "down_proj")):
            continue
        fused += layer.endswith(("qkv_proj", "gate_up_proj"))
        scale = w.float().abs().max() / 448
        q = (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        module = modules[layer]
        assert torch.equal(module.weight_scale, scale.reshape(1)), key
        assert torch.equal(module.weight.view(torch.uint8), q.view(torch.uint8)), key
    assert fused == 2 * model.config.num_hidden_layers


@pytest.mark.parametrize("name", ["phi3", "phi3-longrope"])
def test_phi3_fused_layers_take_the_parts_too(checkpoints, name):
    """A reload stream that splits qkv_proj into q/k/v_proj and gate_up_proj into gate/up_proj gives the
    bytes and logits of a fresh load (rotary buffers, LongRoPE's included, survive the reload)."""
    path = checkpoints[name]
    cfg = layerwise.load_model(path, quantization=None).config
    q_size, kv_size = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    stream = []
    for key, w in Checkpoint(path):
        if key.endswith("qkv_proj.weight"):
            parts = zip(("q_proj", "k_proj", "v_proj"), w.split([q_size, kv_size, kv_size]), strict=True)
        elif key.endswith("gate_up_proj.weight"):
            parts = zip(("gate_proj", "up_proj"), w.chunk(2), strict=True)
        else:
            stream.append((key, w))
            continue
        stream += [(key.replace(key.split(".")[-2], part_name), part.clone()) for part_name, part in parts]
    assert len(stream) > len(list(Checkpoint(path)))
    for quantization in ("fp8", None):
        model = layerwise.load_model(path, quantization=quantization)
        reference = layerwise.load_model(path, quantization=quantization)
        with torch.no_grad():  # make the reload visible: every parameter changes first
            for p in model.parameters():
                p.view(torch.uint8).zero_()
        layerwise.reload_weights(model, stream)
        state, expected = model.state_dict(), reference.state_dict()
        assert state.keys() == expected.keys()
        for key, p in state.items():
            assert torch.equal(p.view(torch.uint8), expected[key].view(torch.uint8)), key
        with torch.no_grad():
            assert torch.equal(model(_ids(24, seed=5)), reference(_ids(24, seed=5)))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type 'dynamic'"),
        ({"sliding_window": 0}, "sliding_window"),
    ],
)
def test_phi3_rejects_unsupported_config(checkpoints, tmp_path, change, message):
    path = shutil.copytree(checkpoints["phi3"], tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(change)
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(layerwise.ConfigError, match=message) as e:  # names the file
        layerwise.load_model(path)
    assert e.value.file == str(path / "config.json")
