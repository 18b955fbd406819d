"""Small Hugging Face checkpoints written by transformers' own save_pretrained (BF16, sharded).

Norm weights and biases are randomized (transformers initializes them to 1 and 0), so that a
routing mistake in any of them changes the logits.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MOE_ARCHS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")  # mixture-of-experts: 8 experts, top-2


def hf_config(
    arch: str,
    num_layers: int = 2,
    hidden: int = 64,
    intermediate: int = 160,
    vocab: int = 128,
    tie: bool | None = None,
    **overrides,
):
    """A tiny transformers config of ``arch``; ``overrides`` replace its fields."""
    import transformers

    common = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        vocab_size=vocab,
        initializer_range=0.05,
        max_position_embeddings=256,
    )
    if arch == "LlamaForCausalLM":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(
            **{**common, "rope_parameters": rope, "tie_word_embeddings": False if tie is None else tie, **overrides}
        )
    if arch == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(
            **{
                **common,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                "tie_word_embeddings": True if tie is None else tie,
                **overrides,
            }
        )
    if arch == "Qwen3ForCausalLM":
        return transformers.Qwen3Config(
            **{
                **common,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                "tie_word_embeddings": False if tie is None else tie,
                **overrides,
            }
        )
    # a window of 8 under test sequences of 16-24 tokens, so that it matters
    if arch == "MistralForCausalLM":
        return transformers.MistralConfig(
            **{
                **common,
                "sliding_window": 8,
                "tie_word_embeddings": bool(tie),
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                **overrides,
            }
        )
    if arch == "Phi3ForCausalLM":  # Phi3Config's token ids (32000) lie outside the tiny vocabulary
        return transformers.Phi3Config(
            **{
                **common,
                "sliding_window": 8,
                "tie_word_embeddings": bool(tie),
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                **overrides,
            }
        )
    moe = dict(num_experts_per_tok=2, tie_word_embeddings=bool(tie))
    if arch == "Qwen3MoeForCausalLM":  # 8 experts, top-2; layer 0 dense (mlp_only_layers)
        return transformers.Qwen3MoeConfig(
            **{
                **common,
                **moe,
                "intermediate_size": 48,
                "moe_intermediate_size": 32,
                "num_experts": 8,
                "mlp_only_layers": [0],
                "norm_topk_prob": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                **overrides,
            }
        )
    if arch == "MixtralForCausalLM":  # 8 experts of intermediate_size, top-2, a window of 8
        return transformers.MixtralConfig(
            **{
                **common,
                **moe,
                "intermediate_size": 32,
                "num_local_experts": 8,
                "sliding_window": 8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
                **overrides,
            }
        )
    raise ValueError(arch)


def write_hf_checkpoint(
    path: Path, arch: str, seed: int = 0, max_shard_size: str = "64KB", outlier_rows: bool = False, **kw
) -> Path:
    """Build a random model of ``arch`` with transformers and save_pretrained it in BF16.

    outlier_rows: scale one output row of every decoder Linear weight by 50.
    """
    import transformers

    torch.manual_seed(seed)
    config = hf_config(arch, **kw)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):  # a wider router, so that the top-k choice is clear-cut
                p.normal_(0.0, 1.0)
            elif outlier_rows and "layers." in name and name.endswith("proj.weight"):
                p[len(name) % p.shape[0]] *= 50
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size=max_shard_size)
    return Path(path)


def add_text_files(path: Path, *, tokenizer: bool = True, eos_token_ids: int | list[int] | None = None) -> dict:
    """Add the demo tokenizer (layerwise/demo_tokenizer.py) and/or chosen EOS ids to the checkpoint at ``path``.

    Args:
        tokenizer: write tokenizer.json, tokenizer_config.json and special_tokens_map.json for config.json's
            ``vocab_size``, which must be 259 or more (``write_hf_checkpoint(..., vocab=512)``; the default 128 is too
            small). Its ids: bytes 0-255, merges, then ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``.
        eos_token_ids: written as generation_config.json's ``eos_token_id`` (its other fields kept). Note that
            save_pretrained already writes a generation_config.json, with eos_token_id 2 for Llama, Mistral, Phi3
            and Mixtral (their configs' default) and none for the Qwen architectures.
    config.json is never changed: transformers builds the same model from it.
    Returns:
        the special tokens' ids, e.g. ``{"<|endoftext|>": 601, "<|im_start|>": 602, "<|im_end|>": 603}`` for a
        vocabulary of 604 or more ({} with ``tokenizer=False``).
    Raises:
        ValueError: ``tokenizer=True`` with a vocabulary below 259 ids.
    """
    from layerwise.demo_tokenizer import special_token_ids, write_tokenizer
    from layerwise.tokenizer import GENERATION_CONFIG_NAME

    path = Path(path)
    ids = {}
    if tokenizer:
        vocab_size = json.loads((path / "config.json").read_text())["vocab_size"]
        write_tokenizer(path, vocab_size)
        ids = special_token_ids(vocab_size)
    if eos_token_ids is not None:
        file = path / GENERATION_CONFIG_NAME
        generation = json.loads(file.read_text()) if file.is_file() else {}
        file.write_text(json.dumps({**generation, "eos_token_id": eos_token_ids}, indent=2))
    return ids


def hf_logits(path: Path, input_ids: torch.Tensor) -> torch.Tensor:
    """transformers' own float32 forward of the checkpoint at ``path``: logits [B, T, vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return model(input_ids).logits.float()


def sqnr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB, as torchao's compute_error."""
    noise = (reference.double() - test.double()).pow(2).sum()
    return float(10 * torch.log10(reference.double().pow(2).sum() / noise))
