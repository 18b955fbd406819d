"""What layerwise does with each config.json field of the supported architectures: one table, :data:`CONFIG_FIELDS`.

Every field of transformers' config classes (LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config,
Qwen3Config, Qwen3MoeConfig) that changes shapes or math is either honoured, with a parity test against transformers'
logits (tests/test_config_fields.py), or refused by :func:`check_config_fields` with a ConfigError that names the
field, its value and what to do, while config.json is parsed (``ModelConfig.from_dict``), before any tensor is read.
Training-only fields and token ids are listed as ignored. A few fields of other families (softcapping, Granite's
multipliers) are refused too: none of the supported architectures reads them, so a config that sets them describes
another model. Fields the table does not name are not checked. :func:`render_markdown` writes the table for the README.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F

from layerwise.errors import ConfigError

#: the supported architectures (layerwise/registry.py maps each to its model class), in the table's order
ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)
MOE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
DENSE = tuple(a for a in ARCHITECTURES if a not in MOE)

#: ``hidden_act`` -> the torch function transformers' ACT2FN calls for it (the dense MLPs use it)
ACTIVATIONS: dict[str, Callable] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
}
MOE_ACTIVATIONS = ("silu", "swish")  # the experts (quant/moe_base.py) compute silu(gate) * up

#: rope types of layers/rotary.py; Phi-3 takes only longrope ("su", "yarn": its old names), as transformers' Phi3Config
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
PHI3_ROPE_TYPES = ("default", "longrope", "su", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")

IMPLEMENTED, IGNORED, FP8 = "implemented", "ignored (training/inference-irrelevant)", "see FP8 checkpoints"
ANY = None  # an architecture that takes every value of the field


def rope_scaling_of(d: dict) -> dict:
    """The rope dict in force: the legacy ``rope_scaling`` when set, else ``rope_parameters`` (transformers >= 5)."""
    return dict(d.get("rope_scaling") or d.get("rope_parameters") or {})


def _top_level(d: dict, key: str) -> Any:
    return d.get(key)


def _rope_type(d: dict, key: str) -> Any:
    scaling = rope_scaling_of(d)
    return scaling.get("rope_type", scaling.get("type")) if scaling else None


def _partial_rotary_factor(d: dict, key: str) -> Any:
    value = rope_scaling_of(d).get(key)
    return d.get(key) if value is None else value


@dataclass(frozen=True)
class Field:
    """One row of the table: config.json keys and what each architecture does with them.

    Attributes:
        keys: the config.json keys of the row (``rope_type``: the type inside rope_parameters / rope_scaling); an
            ignored row may name a group (``output_*``).
        doc: what the implementing architectures do (the table's note).
        status: :data:`IMPLEMENTED` (checked), :data:`IGNORED` or :data:`FP8` (never checked).
        archs: architecture -> the values it implements (:data:`ANY`: all); the architectures not named refuse every
            value but ``neutral``.
        neutral: values that change nothing (the default): taken by every architecture. A null or absent key is
            never checked.
        refusal: what a refused value means and what to do (the ConfigError's last words).
        read: (config dict, key) -> the value, None when absent.
        per_entry: a list value is checked entry by entry (layer_types).
    """

    keys: tuple[str, ...]
    doc: str
    status: str = IMPLEMENTED
    archs: dict[str, tuple | None] = field(default_factory=dict)
    neutral: tuple = ()
    refusal: str = ""
    read: Callable[[dict, str], Any] = _top_level
    per_entry: bool = False


def _all(values: tuple | None = ANY, archs: tuple[str, ...] = ARCHITECTURES) -> dict[str, tuple | None]:
    return dict.fromkeys(archs, values)


_OTHER_MODEL = "the checkpoint is of another architecture (load it with transformers)"

#: the table: one row per field group (see :class:`Field`)
CONFIG_FIELDS: tuple[Field, ...] = (
    Field(
        ("architectures", "model_type", "dtype", "torch_dtype"), "model class; parameters' default dtype", archs=_all()
    ),
    Field(
        ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"),
        "shapes",
        archs=_all(),
    ),
    Field(("num_key_value_heads", "head_dim"), "GQA; head_dim may differ from hidden_size / heads", archs=_all()),
    Field(("rms_norm_eps",), "every RMSNorm (Qwen3: q/k norms too)", archs=_all()),
    Field(
        ("hidden_act",),
        "activation of the gated MLP",
        archs={**_all(tuple(ACTIVATIONS), DENSE), **_all(MOE_ACTIVATIONS, MOE)},
        refusal="other activations are not implemented (the MoE experts compute silu only)",
    ),
    Field(("tie_word_embeddings",), "lm_head is embed_tokens", archs=_all()),
    Field(
        ("attention_bias",),
        "bias on q/k/v/o_proj (Qwen2: q/k/v always)",
        archs=_all(ANY, ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
        neutral=(False,),
        refusal="transformers' model of this architecture has no such biases either; " + _OTHER_MODEL,
    ),
    Field(
        ("mlp_bias",),
        "bias on gate/up/down_proj",
        archs=_all(ANY, ("LlamaForCausalLM",)),
        neutral=(False,),
        refusal="transformers' model of this architecture has no MLP biases either; " + _OTHER_MODEL,
    ),
    Field(
        ("rope_type",),
        "in rope_parameters (or rope_scaling), with rope_theta and the type's keys",
        archs={**_all(ROPE_TYPES), "Phi3ForCausalLM": PHI3_ROPE_TYPES},
        refusal="this RoPE scaling is not implemented (dynamic NTK rescales with the sequence length; Phi-3 takes "
        "longrope only, as in transformers); use a checkpoint of a supported type",
        read=_rope_type,
    ),
    Field(
        ("partial_rotary_factor",),
        "RoPE on a fraction of each head",
        archs=_all(ANY, ("Phi3ForCausalLM",)),
        neutral=(1.0,),
        refusal="partial RoPE is implemented for Phi3ForCausalLM only; " + _OTHER_MODEL,
        read=_partial_rotary_factor,
    ),
    Field(
        ("max_position_embeddings", "original_max_position_embeddings"),
        "LongRoPE / YaRN / llama3 defaults",
        archs=_all(),
    ),
    Field(
        ("sliding_window",),
        "window of keys per query",
        archs=_all(ANY, ARCHITECTURES[1:]),
        refusal="transformers' Llama has no sliding window; " + _OTHER_MODEL,
    ),
    Field(
        ("use_sliding_window",),
        "Qwen: whether sliding_window applies",
        archs=_all(ANY, ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")),
        neutral=(True,),
        refusal="the window of this architecture applies whenever sliding_window is set, as in transformers",
    ),
    Field(
        ("layer_types",),
        "Qwen2/3: the windowed layers",
        archs=_all(LAYER_TYPES, ("Qwen2ForCausalLM", "Qwen3ForCausalLM")),
        refusal="per-layer attention types are implemented for Qwen2 / Qwen3 only, as full_attention or "
        "sliding_attention; " + _OTHER_MODEL,
        per_entry=True,
    ),
    Field(("max_window_layers",), "Qwen2/3 without layer_types: first windowed layer", archs=_all()),
    Field(
        ("num_experts", "num_local_experts", "num_experts_per_tok"),
        "experts, top-k",
        archs=_all(ANY, MOE),
        neutral=(0,),
        refusal="a dense architecture has no experts; " + _OTHER_MODEL,
    ),
    Field(
        ("moe_intermediate_size", "decoder_sparse_step", "mlp_only_layers"),
        "Qwen3Moe: expert size, dense layers (Mixtral: unread, as in transformers)",
        archs=_all(ANY, MOE),
        neutral=(1, []),
        refusal="a dense architecture has no experts; " + _OTHER_MODEL,
    ),
    Field(
        ("norm_topk_prob",),
        "renormalize top-k weights (Mixtral: always)",
        archs=_all(ANY, MOE),
        neutral=(False,),
        refusal="a dense architecture has no experts; " + _OTHER_MODEL,
    ),
    Field(
        (
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "query_pre_attn_scalar",
            "embedding_multiplier",
            "attention_multiplier",
            "residual_multiplier",
            "logits_scaling",
            "use_qk_norm",
        ),
        "other families' fields",
        neutral=(False, 1.0),
        refusal="nor does transformers for this architecture; " + _OTHER_MODEL,
    ),
    Field(
        (
            "pretraining_tp",
            "attention_dropout",
            "resid_pdrop",
            "embd_pdrop",
            "initializer_range",
            "use_cache",
            "router_aux_loss_coef",
            "router_jitter_noise",
            "output_router_logits",
            "output_*",
            "return_dict",
            "chunk_size_feed_forward",
            "pad/bos/eos_token_id",
        ),
        "training, outputs, token ids; pretraining_tp: one matmul split",
        status=IGNORED,
    ),
    Field(("quantization_config",), "pre-quantized checkpoints", status=FP8),
)

SHORT_NAMES = {arch: arch.removesuffix("ForCausalLM") for arch in ARCHITECTURES}


def _is_one_of(value: Any, values: tuple) -> bool:
    """``value in values``, but a bool equals only a bool (True is not 1.0, False is not 0)."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values)


def _accepts(value: Any, accepted: tuple | None, per_entry: bool = False) -> bool:
    if accepted is ANY:
        return True
    if per_entry:
        return isinstance(value, list) and all(_is_one_of(v, accepted) for v in value)
    return _is_one_of(value, accepted)


def check_config_fields(d: dict, arch: str, source: str | None = None) -> None:
    """Refuse a config.json dict ``d`` of architecture ``arch`` that sets a field of :data:`CONFIG_FIELDS` to a value
    that ``arch`` does not implement. An architecture outside :data:`ARCHITECTURES` is not checked (the registry
    refuses it).

    Raises:
        ConfigError: names the field, its value, the architecture, what is supported and what to do; ``file`` is
            ``source``.
    """
    if arch not in ARCHITECTURES:
        return
    for row in CONFIG_FIELDS:
        if row.status != IMPLEMENTED:
            continue
        for key in row.keys:
            value = row.read(d, key)
            if value is None or _accepts(value, row.neutral):
                continue
            if arch in row.archs:
                accepted = row.archs[arch]
                if _accepts(value, accepted, row.per_entry):
                    continue
                supported = f"supported: {', '.join(map(str, accepted))}"
            else:
                implementing = _archs_text(list(row.archs))
                supported = f"implemented for {implementing}" if implementing else "read by no supported architecture"
            raise ConfigError(
                f"unsupported {key} {value!r} for {arch} in config.json ({supported}): {row.refusal}", file=source
            )


def _archs_text(archs: list[str]) -> str:
    """Short architecture names; "all" or "all but ..." when that is shorter."""
    for name, group in (("all", ARCHITECTURES), ("dense", DENSE), ("MoE", MOE)):
        if set(archs) == set(group):
            return name
    if len(archs) > len(ARCHITECTURES) // 2:
        return "all but " + ", ".join(SHORT_NAMES[a] for a in ARCHITECTURES if a not in archs)
    return ", ".join(SHORT_NAMES[a] for a in archs)


def _honoured_by(row: Field) -> str:
    if row.status != IMPLEMENTED:
        return row.status
    groups: dict[tuple | None, list[str]] = {}
    for arch, values in row.archs.items():
        groups.setdefault(values, []).append(arch)
    parts = []
    for values, archs in groups.items():
        parts.append(_archs_text(archs) + ("" if values is ANY else f" ({', '.join(map(str, values))})"))
    return "; ".join(parts) or "none: refused"


def render_markdown(notes: bool = True) -> str:
    """:data:`CONFIG_FIELDS` as a Markdown table: the fields, the architectures that honour them (and with which
    values) and, with ``notes``, what each does. Every other architecture refuses a value that changes anything
    (ConfigError). ``notes=False`` is the README's table, without the ignored fields and quantization_config;
    docs/api.md has the whole one with notes (tests/test_docs.py checks both against this function)."""
    if notes:
        lines = ["| config.json field | honoured by (else: ConfigError) | note |", "|---|---|---|"]
        for row in CONFIG_FIELDS:
            lines.append(f"| {', '.join(f'`{k}`' for k in row.keys)} | {_honoured_by(row)} | {row.doc} |")
        return "\n".join(lines) + "\n"
    by_support: dict[str, list[str]] = {}  # without notes: one row per distinct "honoured by", ignored rows left out
    for row in CONFIG_FIELDS:
        if row.status in (IGNORED, FP8):
            continue
        by_support.setdefault(_honoured_by(row), []).extend(row.keys)
    lines = ["| config.json field | honoured by (else: ConfigError) |", "|---|---|"]
    lines += [f"| {', '.join(f'`{k}`' for k in keys)} | {support} |" for support, keys in by_support.items()]
    return "\n".join(lines) + "\n"
