"""Each bad input raises a specific exception whose message names the tensor key or the file."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import layerwise
from layerwise.demo import write_checkpoint

TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
KEY = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", TINY, max_shard_bytes=8 << 10)


def _shard_of(path, key):
    with open(path / "model.safetensors.index.json") as f:
        return json.load(f)["weight_map"][key]


def _edit(path, key, fn):
    """Rewrite the shard holding ``key`` with fn(tensors) applied (the index is updated too)."""
    shard = _shard_of(path, key)
    tensors = load_file(str(path / shard))
    fn(tensors)
    save_file(tensors, str(path / shard))
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update({k: shard for k in tensors})
    index_path.write_text(json.dumps(index))
    return shard


def test_clean_checkpoint_loads(ckpt):
    layerwise.load_model(ckpt)


def test_missing_config(ckpt):
    os.remove(ckpt / "config.json")
    with pytest.raises(layerwise.CheckpointError, match="config.json") as e:
        layerwise.load_model(ckpt)
    assert e.value.file == str(ckpt / "config.json")


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    for name in [k for k, v in changes.items() if v is ...]:
        del cfg[name]
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("missing", ["vocab_size", "num_hidden_layers"])
def test_config_without_a_required_field_names_it_and_the_file(ckpt, missing):
    model = layerwise.load_model(ckpt)
    _edit_config(ckpt, **{missing: ...})
    with pytest.raises(layerwise.ConfigError, match=missing) as e:
        layerwise.load_model(ckpt)
    assert e.value.file == str(ckpt / "config.json")
    with pytest.raises(layerwise.ReloadError) as e:  # a reload from that directory: nothing written
        layerwise.reload_weights(model, ckpt)
    assert isinstance(e.value.cause, layerwise.CheckpointError) and e.value.updated_modules == []


@pytest.mark.parametrize(
    "changes,words",
    [
        ({"hidden_size": "32"}, "hidden_size must be a positive integer"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 lacks low_freq_factor, high_freq_factor"),
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 4}}, "longrope lacks long_factor"),
    ],
)
def test_config_values_of_the_wrong_kind_name_the_field_and_the_file(ckpt, changes, words):
    _edit_config(ckpt, **changes)
    with pytest.raises(layerwise.ConfigError, match=words) as e:
        layerwise.load_model(ckpt)
    assert e.value.file == str(ckpt / "config.json")


def test_config_architectures_may_be_one_name_not_a_list(ckpt):
    _edit_config(ckpt, architectures="Qwen3ForCausalLM")
    assert type(layerwise.load_model(ckpt)).__name__ == "Qwen3ForCausalLM"
    _edit_config(ckpt, architectures={"name": "Qwen3ForCausalLM"})
    with pytest.raises(layerwise.ConfigError, match="architectures"):
        layerwise.load_model(ckpt)


def test_config_that_is_not_an_object(ckpt):
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(layerwise.CheckpointError, match="JSON object") as e:
        layerwise.load_model(ckpt)
    assert e.value.file == str(ckpt / "config.json")


def test_tensor_of_an_unsupported_dtype_names_key_and_file(ckpt):
    shard = _shard_of(ckpt, KEY)
    path = ckpt / shard
    raw = path.read_bytes()  # rewrite KEY's header dtype to U16 (a safetensors dtype of BF16's width, not loaded)
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header[KEY]["dtype"] = "U16"
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])
    with pytest.raises(layerwise.CheckpointError, match="unsupported safetensors dtype") as e:
        layerwise.load_model(ckpt)
    assert e.value.key == KEY and e.value.file == str(path)


def test_integer_tensor_for_a_float_expert_is_refused(tmp_path):
    """The MoE experts' loader refuses it too (it does not go through load_shard)."""
    from tests.hf_checkpoints import write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path / "moe", "Qwen3MoeForCausalLM", num_layers=2)
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    _edit(path, key, lambda t: t.update({key: torch.ones(t[key].shape, dtype=torch.int32)}))
    with pytest.raises(layerwise.WeightShapeError, match="torch.int32") as e:
        layerwise.load_model(path, quantization=None)
    assert e.value.key == key


def test_integer_tensor_for_a_float_weight_is_refused(ckpt):
    shape = (TINY["intermediate_size"], TINY["hidden_size"])
    shard = _edit(ckpt, KEY, lambda t: t.update({KEY: torch.ones(shape, dtype=torch.int32)}))
    with pytest.raises(layerwise.WeightShapeError, match="torch.int32") as e:  # a copy would cast it silently
        layerwise.load_model(ckpt, quantization=None)
    assert e.value.key == KEY and shard in str(e.value)


def test_unknown_architecture_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(layerwise.UnsupportedArchitectureError) as e:
        layerwise.load_model(ckpt)
    msg = str(e.value)
    assert "MambaForCausalLM" in msg and "config.json" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_parameter_never_provided(ckpt):
    _edit(ckpt, KEY, lambda t: t.pop(KEY))
    with pytest.raises(layerwise.MissingWeightError) as e:
        layerwise.load_model(ckpt)
    # the fused parameter that up_proj feeds, and how much of it is missing
    assert "model.layers.1.mlp.gate_up_proj.weight" in str(e.value)
    assert f"{TINY['intermediate_size'] * TINY['hidden_size']} of" in str(e.value)


def test_unexpected_tensor(ckpt):
    shard = _edit(ckpt, KEY, lambda t: t.update({"model.layers.1.mlp.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(layerwise.UnexpectedWeightError) as e:
        layerwise.load_model(ckpt)
    assert e.value.key == "model.layers.1.mlp.extra_proj.weight"
    assert "extra_proj" in str(e.value) and shard in str(e.value)


def test_rotary_inv_freq_is_skipped(ckpt):
    key = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _edit(ckpt, "model.layers.0.self_attn.q_proj.weight", lambda t: t.update({key: torch.ones(4)}))
    ref = layerwise.load_model(ckpt, quantization=None)
    assert ref.model.layers[0].self_attn.rotary_emb.inv_freq.shape == (4,)


def test_shape_mismatch(ckpt):
    shard = _edit(
        ckpt,
        KEY,
        lambda t: t.update(
            {KEY: torch.zeros(TINY["intermediate_size"] + 1, TINY["hidden_size"], dtype=torch.bfloat16)}
        ),
    )
    with pytest.raises(layerwise.WeightShapeError) as e:
        layerwise.load_model(ckpt)
    assert e.value.key == KEY
    assert KEY in str(e.value) and shard in str(e.value) and "(65, 32)" in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("key", [KEY, "model.layers.0.input_layernorm.weight"])
def test_non_finite_weight(ckpt, bad, key):
    def poison(t):
        t[key] = t[key].clone()
        t[key].view(-1)[3] = bad

    _edit(ckpt, key, poison)
    with pytest.raises(layerwise.NonFiniteWeightError) as e:
        layerwise.load_model(ckpt)
    assert e.value.key == key and key in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), -float("inf")])
@pytest.mark.parametrize("quantization", ["fp8", "fp8-per-channel", "fp8-per-block", "none"])
def test_non_finite_bias(tmp_path_factory, bad, quantization):
    from tests.hf_checkpoints import write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path_factory.mktemp("qwen2"), "Qwen2ForCausalLM")  # q/k/v carry a bias
    key = "model.layers.1.self_attn.k_proj.bias"

    def poison(t):
        t[key] = t[key].clone()
        t[key][5] = bad

    _edit(path, key, poison)
    with pytest.raises(layerwise.NonFiniteWeightError) as e:
        layerwise.load_model(path, quantization=quantization)
    assert e.value.key == key and key in str(e.value)


def test_shard_listed_in_index_is_absent(ckpt):
    shard = _shard_of(ckpt, KEY)
    os.remove(ckpt / shard)
    with pytest.raises(layerwise.CheckpointError) as e:
        layerwise.load_model(ckpt)
    assert shard in str(e.value) and e.value.file == str(ckpt / shard)


def test_no_weights_at_all(tmp_path, ckpt):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(ckpt / "config.json", empty / "config.json")
    with pytest.raises(layerwise.CheckpointError, match="model.safetensors"):
        layerwise.load_model(empty)
