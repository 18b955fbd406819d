"""Every config.json field of layerwise/config_fields.py's table: honoured (logits equal transformers' forward on a
tiny random model with the field set) or refused (a ConfigError naming the field and value, before any tensor is
read)."""

import json
import re

import pytest
import torch
from safetensors.torch import save_file

import layerwise
from layerwise.checkpoint import _ShardFile
from layerwise.config import ModelConfig
from layerwise.config_fields import ANY, ARCHITECTURES, CONFIG_FIELDS, IMPLEMENTED, render_markdown
from layerwise.registry import MODEL_REGISTRY
from tests.hf_checkpoints import hf_config, hf_logits, write_hf_checkpoint

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
# every optional YaRN key set, off its default
YARN_KEYS = dict(
    YARN,
    factor=8.0,
    original_max_position_embeddings=32,
    beta_fast=16,
    beta_slow=2,
    mscale=1.0,
    mscale_all_dim=0.5,
    truncate=False,
)
# head_dim 16: 8 factors each; sequences of 24 tokens pass original_max_position_embeddings, so the long ones apply
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0],
    "original_max_position_embeddings": 16,
}

# (field, architecture, write_hf_checkpoint keywords): the field set off its default
PARITY = [
    ("mlp_bias", "LlamaForCausalLM", dict(mlp_bias=True)),
    ("attention_bias", "LlamaForCausalLM", dict(attention_bias=True)),
    ("attention_bias", "Qwen3ForCausalLM", dict(attention_bias=True)),
    ("attention_bias", "Qwen3MoeForCausalLM", dict(attention_bias=True)),
    *[("hidden_act", "LlamaForCausalLM", dict(hidden_act=a)) for a in ("swish", "gelu", "gelu_pytorch_tanh", "relu")],
    ("hidden_act", "Qwen2ForCausalLM", dict(hidden_act="gelu_pytorch_tanh")),
    ("head_dim", "LlamaForCausalLM", dict(head_dim=24)),
    ("head_dim", "Qwen3ForCausalLM", dict(head_dim=32)),
    ("head_dim", "Phi3ForCausalLM", dict(head_dim=32)),
    ("head_dim", "MixtralForCausalLM", dict(head_dim=8)),
    ("rms_norm_eps", "Qwen2ForCausalLM", dict(rms_norm_eps=0.05)),
    ("rms_norm_eps", "Qwen3ForCausalLM", dict(rms_norm_eps=0.05)),  # the q/k norms too
    ("tie_word_embeddings", "LlamaForCausalLM", dict(tie=True)),
    ("tie_word_embeddings", "Qwen3MoeForCausalLM", dict(tie=True)),
    ("rope_type", "LlamaForCausalLM", dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0})),
    ("rope_type", "Qwen3ForCausalLM", dict(rope_parameters=YARN)),
    ("rope_type", "MistralForCausalLM", dict(rope_parameters=YARN_KEYS)),
    ("rope_type", "LlamaForCausalLM", dict(rope_parameters=LONGROPE)),
    ("use_sliding_window", "Qwen3MoeForCausalLM", dict(use_sliding_window=True, sliding_window=4)),
    ("decoder_sparse_step", "Qwen3MoeForCausalLM", dict(num_layers=4, decoder_sparse_step=2, mlp_only_layers=[])),
    ("norm_topk_prob", "Qwen3MoeForCausalLM", dict(norm_topk_prob=False)),
    ("moe_intermediate_size", "Qwen3MoeForCausalLM", dict(moe_intermediate_size=16, num_experts=4)),
    ("num_experts_per_tok", "MixtralForCausalLM", dict(num_experts_per_tok=3)),
    ("pretraining_tp", "LlamaForCausalLM", dict(pretraining_tp=2)),  # ignored: transformers 5 ignores it too
]


@pytest.mark.parametrize("field,arch,kw", PARITY, ids=[f"{f}-{a.removesuffix('ForCausalLM')}" for f, a, _ in PARITY])
def test_honoured_field_matches_transformers(tmp_path, field, arch, kw):
    path = write_hf_checkpoint(tmp_path / "ckpt", arch, seed=3, **kw)
    config = json.loads((path / "config.json").read_text())
    assert field in json.dumps(config), f"transformers did not write {field}"
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(path, ids)
    model = layerwise.load_model(path, quantization=None, dtype=torch.float32)
    with torch.no_grad():
        out = model(ids)
    err = (out - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"{field} on {arch}: max |diff| {err}"


# (architecture, config.json change, the refused key, its value)
REFUSED = [
    ("LlamaForCausalLM", {"hidden_act": "gelu_new"}, "hidden_act", "gelu_new"),
    ("MixtralForCausalLM", {"hidden_act": "gelu"}, "hidden_act", "gelu"),
    ("MistralForCausalLM", {"attention_bias": True}, "attention_bias", True),
    ("Qwen2ForCausalLM", {"attention_bias": True}, "attention_bias", True),
    ("Phi3ForCausalLM", {"mlp_bias": True}, "mlp_bias", True),
    ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type", "dynamic"),
    ("Qwen3ForCausalLM", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type", "dynamic"),  # legacy
    ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "rope_type", "linear"),
    ("Qwen3ForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor", 0.5),
    (
        "LlamaForCausalLM",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
        "partial_rotary_factor",
        0.25,
    ),
    ("LlamaForCausalLM", {"sliding_window": 16}, "sliding_window", 16),
    ("MistralForCausalLM", {"use_sliding_window": False}, "use_sliding_window", False),
    ("MistralForCausalLM", {"layer_types": ["full_attention"] * 2}, "layer_types", ["full_attention"] * 2),
    (
        "Qwen2ForCausalLM",
        {"layer_types": ["full_attention", "chunked_attention"]},
        "layer_types",
        ["full_attention", "chunked_attention"],
    ),
    ("Qwen3ForCausalLM", {"num_experts": 8}, "num_experts", 8),
    ("LlamaForCausalLM", {"num_local_experts": 8}, "num_local_experts", 8),
    ("Phi3ForCausalLM", {"num_experts_per_tok": 2}, "num_experts_per_tok", 2),
    ("LlamaForCausalLM", {"moe_intermediate_size": 16}, "moe_intermediate_size", 16),
    ("Qwen3ForCausalLM", {"decoder_sparse_step": 2}, "decoder_sparse_step", 2),
    ("MistralForCausalLM", {"mlp_only_layers": [0]}, "mlp_only_layers", [0]),
    ("Qwen2ForCausalLM", {"norm_topk_prob": True}, "norm_topk_prob", True),
    ("LlamaForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping", 30.0),
    ("Qwen2ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping", 50.0),
    ("Qwen3ForCausalLM", {"query_pre_attn_scalar": 256}, "query_pre_attn_scalar", 256),
    ("LlamaForCausalLM", {"embedding_multiplier": 12.0}, "embedding_multiplier", 12.0),
    ("LlamaForCausalLM", {"attention_multiplier": 0.0078125}, "attention_multiplier", 0.0078125),
    ("MistralForCausalLM", {"residual_multiplier": 0.22}, "residual_multiplier", 0.22),
    ("LlamaForCausalLM", {"logits_scaling": 8.0}, "logits_scaling", 8.0),
    ("LlamaForCausalLM", {"use_qk_norm": True}, "use_qk_norm", True),
]


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Any read of a checkpoint tensor fails the test."""

    def fail(self, key, *args, **kwargs):
        raise AssertionError(f"tensor {key} was read")

    monkeypatch.setattr(_ShardFile, "read", fail)
    monkeypatch.setattr(_ShardFile, "view", fail)


def _config_dir(tmp_path, arch, change):
    """A checkpoint directory: transformers' tiny config of ``arch`` with ``change``, one small safetensors file."""
    config = {**hf_config(arch).to_dict(), "architectures": [arch], **change}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(64, dtype=torch.bfloat16)}, tmp_path / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize(
    "arch,change,key,value", REFUSED, ids=[f"{k}-{a.removesuffix('ForCausalLM')}" for a, _, k, _ in REFUSED]
)
def test_refused_field_is_a_config_error_before_any_read(tmp_path, no_tensor_reads, arch, change, key, value):
    path = _config_dir(tmp_path / "ckpt", arch, change)
    with pytest.raises(layerwise.ConfigError, match=re.escape(f"unsupported {key} {value!r} for {arch}")) as e:
        layerwise.load_model(path)
    assert e.value.file == str(path / "config.json")


def test_every_refusable_key_has_a_refusal_test():
    refusable = {
        key
        for row in CONFIG_FIELDS
        if row.status == IMPLEMENTED
        and (set(row.archs) != set(ARCHITECTURES) or any(v is not ANY for v in row.archs.values()))
        for key in row.keys
    }
    assert refusable == {key for _, _, key, _ in REFUSED}


@pytest.mark.parametrize(
    "arch,change",
    [
        ("MistralForCausalLM", {"attention_bias": False, "mlp_bias": False, "max_window_layers": 28}),
        ("LlamaForCausalLM", {"pretraining_tp": 4, "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 1}}),
        ("Qwen3MoeForCausalLM", {"use_sliding_window": False, "max_window_layers": 48, "sliding_window": None}),
        ("MixtralForCausalLM", {"norm_topk_prob": False, "router_jitter_noise": 0.1, "final_logit_softcapping": None}),
        ("Phi3ForCausalLM", {"rope_parameters": {"rope_type": "su", "short_factor": [1] * 8, "long_factor": [2] * 8}}),
        ("Qwen2ForCausalLM", {"quantization_config": {"quant_method": "fp8"}, "num_experts": 0}),
    ],
)
def test_neutral_and_ignored_values_parse(arch, change):
    """Values that change nothing (a field's default, null, what transformers ignores) are not refused."""
    config = ModelConfig.from_dict({**hf_config(arch).to_dict(), "architectures": [arch], **change})
    assert config.architectures == [arch]


def test_the_table_covers_the_registry_and_renders_compactly():
    assert set(MODEL_REGISTRY) == set(ARCHITECTURES)
    table = render_markdown()
    assert len(table.encode()) < 2500
    for row in CONFIG_FIELDS:
        for key in row.keys:
            assert f"`{key}`" in table
    assert table.count("\n") == len(CONFIG_FIELDS) + 2


def test_mixtral_reads_no_qwen3_moe_field(tmp_path):
    """Mixtral's experts are of intermediate_size in every layer whatever moe_intermediate_size, decoder_sparse_step
    and mlp_only_layers say: transformers' Mixtral reads none of them either."""
    path = write_hf_checkpoint(tmp_path / "ckpt", "MixtralForCausalLM", seed=4)
    config = json.loads((path / "config.json").read_text())
    config.update(moe_intermediate_size=7, decoder_sparse_step=2, mlp_only_layers=[0])
    (path / "config.json").write_text(json.dumps(config))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(path, ids)
    model = layerwise.load_model(path, quantization=None, dtype=torch.float32)
    with torch.no_grad():
        assert (model(ids) - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()
