"""The subset of a Hugging Face config.json that the models need, under Hugging Face's field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from layerwise.config_fields import ARCHITECTURES, check_config_fields, rope_scaling_of
from layerwise.dtypes import DTYPES
from layerwise.errors import ConfigError

#: the config.json fields every supported architecture needs (the others have defaults), positive integers
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
#: the keys a rope scaling of each type needs (transformers' rope_config_validation; "original_max_position_embeddings"
#: defaults to max_position_embeddings)
ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "linear": ("factor",),
    "longrope": ("short_factor", "long_factor"),
}


@dataclass
class ModelConfig:
    """Decoder-only transformer hyper-parameters (Llama / Qwen2 / Qwen3 / Mistral / Phi-3 family).

    Built with :meth:`from_dict`, which accepts both the transformers >= 5 layout
    (``rope_parameters``) and the older one (``rope_theta`` + ``rope_scaling``).

    ``sliding_window`` and ``partial_rotary_factor`` are parsed for every architecture but used only
    by the attention classes that declare them (every layer: Mistral, Phi-3, Mixtral, Qwen3-MoE; the
    layers ``layer_types`` / ``max_window_layers`` name: Qwen2, Qwen3); a Qwen config whose
    ``use_sliding_window`` is false or absent (transformers' default) parses as None.

    Mixture of experts (0 experts: a dense model): ``num_experts`` (Qwen3-MoE ``num_experts``,
    Mixtral ``num_local_experts``), ``num_experts_per_tok`` (k), ``moe_intermediate_size`` (I per
    expert; Mixtral's experts use ``intermediate_size``), ``decoder_sparse_step`` and
    ``mlp_only_layers`` (Qwen3-MoE: which decoder layers are dense), ``norm_topk_prob`` (Qwen3-MoE
    renormalizes the top-k weights only when set; Mixtral always does).

    Which config.json fields each architecture honours, refuses (ConfigError, raised here) or ignores:
    :data:`layerwise.config_fields.CONFIG_FIELDS`.
    """

    architectures: list
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    layer_types: list | None = None
    max_window_layers: int = 28
    partial_rotary_factor: float = 1.0
    dtype: torch.dtype | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list = field(default_factory=list)
    norm_topk_prob: bool = False
    raw: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> ModelConfig:
        """Parse a config.json dict; ``source``: the file it came from, named by the errors.

        Raises:
            ConfigError: a field of :data:`REQUIRED_FIELDS` is absent, null or not a positive integer, a rope
                scaling lacks a key its type needs (:data:`ROPE_SCALING_KEYS`), or ``architectures`` is neither a
                list nor a string, or a field is set to a value that the architecture does not implement
                (:func:`layerwise.config_fields.check_config_fields`).
        """
        missing = [name for name in REQUIRED_FIELDS if d.get(name) is None]
        if missing:
            raise ConfigError(f"config.json lacks the required field(s) {', '.join(missing)}", file=source)
        for name in REQUIRED_FIELDS:
            if type(d[name]) is not int or d[name] < 1:
                raise ConfigError(f"config.json {name} must be a positive integer, got {d[name]!r}", file=source)
        architectures = d.get("architectures") or []
        if isinstance(architectures, str):  # a single name where a list belongs: read as that one name
            architectures = [architectures]
        if not isinstance(architectures, (list, tuple)):
            raise ConfigError(
                f"config.json architectures must be a list of class names, got {architectures!r}", file=source
            )
        # the first supported architecture, as the registry picks it (None: the registry refuses them all)
        arch = next((a for a in architectures if a in ARCHITECTURES), None)
        check_config_fields(d, arch, source)
        rope = dict(d.get("rope_parameters") or {})
        rope_theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        partial_rotary_factor = rope.pop("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        scaling = rope_scaling_of(d) if d.get("rope_scaling") else rope
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type in ("llama3", "yarn", "longrope"):  # as transformers' standardize_rope_params
            original = d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
            scaling = dict(scaling, original_max_position_embeddings=original or d.get("max_position_embeddings"))
        absent = [key for key in ROPE_SCALING_KEYS.get(rope_type, ()) if scaling.get(key) is None]
        if absent:
            raise ConfigError(f"config.json rope scaling of type {rope_type} lacks {', '.join(absent)}", file=source)
        heads = d["num_attention_heads"]
        dtype_name = d.get("dtype") or d.get("torch_dtype")
        # Qwen2 / Qwen3 / Qwen3-MoE gate the window with use_sliding_window (transformers' default: False);
        # Mistral, Mixtral and Phi-3 have no such flag: their window applies whenever sliding_window is set
        qwen = str(d.get("model_type", "")).startswith("qwen") or any(str(a).startswith("Qwen") for a in architectures)
        use_window = d.get("use_sliding_window", not qwen)
        return cls(
            architectures=list(architectures),
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=None if rope_type == "default" else dict(scaling, rope_type=rope_type),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            hidden_act=d.get("hidden_act") or "silu",
            sliding_window=d.get("sliding_window") if use_window else None,
            layer_types=list(d["layer_types"]) if d.get("layer_types") else None,
            # transformers' Qwen2Config / Qwen3Config default: 28
            max_window_layers=28 if d.get("max_window_layers") is None else int(d["max_window_layers"]),
            partial_rotary_factor=float(partial_rotary_factor if partial_rotary_factor is not None else 1.0),
            dtype=DTYPES.get(dtype_name.lower()) if isinstance(dtype_name, str) else None,
            num_experts=int(d.get("num_experts") or d.get("num_local_experts") or 0),
            num_experts_per_tok=int(d.get("num_experts_per_tok") or 0),
            # Mixtral's experts are of intermediate_size (transformers' MixtralConfig has no moe_intermediate_size)
            moe_intermediate_size=int(
                (arch != "MixtralForCausalLM" and d.get("moe_intermediate_size")) or d["intermediate_size"]
            ),
            decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
            mlp_only_layers=list(d.get("mlp_only_layers") or []),
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            raw=d,
        )

    def is_sliding_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` of a Qwen2/Qwen3 model attends over ``sliding_window`` keys
        only, by transformers' rule: ``layer_types[layer_idx] == "sliding_attention"``, or, for a config
        without ``layer_types``, a window (``use_sliding_window`` set) and ``layer_idx >= max_window_layers``.
        Raises ConfigError when ``layer_types`` has not one entry per layer."""
        if self.sliding_window is None:
            return False
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(
                    f"config.json layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
                )
            return self.layer_types[layer_idx] == "sliding_attention"
        return layer_idx >= self.max_window_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has a sparse MoE block (:func:`is_moe_layer`)."""
        return is_moe_layer(layer_idx, self.num_experts, self.mlp_only_layers, self.decoder_sparse_step)


def is_moe_layer(layer_idx: int, num_experts: int, mlp_only_layers, decoder_sparse_step: int) -> bool:
    """Whether decoder layer ``layer_idx`` has a sparse MoE block, by transformers' Qwen3-MoE rule: not listed in
    ``mlp_only_layers``, ``num_experts > 0`` and ``(layer_idx + 1) % decoder_sparse_step == 0``."""
    return layer_idx not in mlp_only_layers and num_experts > 0 and (layer_idx + 1) % decoder_sparse_step == 0
