"""Architecture registry: config.json ``architectures`` -> model class."""

from __future__ import annotations

from torch import nn

from layerwise.config import ModelConfig
from layerwise.errors import UnsupportedArchitectureError
from layerwise.models.llama import LlamaForCausalLM
from layerwise.models.mistral import MistralForCausalLM
from layerwise.models.mixtral import MixtralForCausalLM
from layerwise.models.phi3 import Phi3ForCausalLM
from layerwise.models.qwen2 import Qwen2ForCausalLM
from layerwise.models.qwen3 import Qwen3ForCausalLM
from layerwise.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(config: ModelConfig, config_file: str | None = None) -> tuple[str, type[nn.Module]]:
    """(architecture name, model class) for the first supported entry of ``config.architectures``.

    Raises:
        UnsupportedArchitectureError: none is supported; the message lists the supported ones.
    """
    for arch in config.architectures:
        if arch in MODEL_REGISTRY:
            return arch, MODEL_REGISTRY[arch]
    raise UnsupportedArchitectureError(
        f"unsupported architecture {config.architectures}; supported: {sorted(MODEL_REGISTRY)}", file=config_file
    )
