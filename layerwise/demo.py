"""Embedded default checkpoints: a small random BF16 Qwen3 model (and a Qwen3-MoE one) written in Hugging Face format.

Nothing is downloaded. The tensors are generated from a fixed seed and written with safetensors
into shards listed by model.safetensors.index.json, exactly as transformers' save_pretrained lays
them out, so the demo exercises the same reader as a real checkpoint. Beside them: a small byte-level
BPE tokenizer (:mod:`layerwise.demo_tokenizer`) and a generation_config.json naming its EOS ids, as a
Qwen2.5 instruct checkpoint has.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from layerwise.checkpoint import CONFIG_NAME, INDEX_FILE
from layerwise.config import is_moe_layer
from layerwise.demo_tokenizer import (
    check_vocab_size,
    special_token_ids,
    tokenizer_fits,
    write_generation_config,
    write_tokenizer,
)
from layerwise.tokenizer import GENERATION_CONFIG_NAME

PROMPT = [1, 17, 42, 7]  # token ids the demos continue greedily (load, reload, sync-demo)
PROMPT_TEXT = "The engine reads the new weights"  # the text prompt of `layerwise demo` and `layerwise generate`
DEMO_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 4096,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "dtype": "bfloat16",
}
#: the mixture-of-experts demo (``torchrun -m layerwise.tp_demo --moe``): Qwen3-MoE, 8 experts, top-2, layer 0 dense;
#: sizes that split over 2 or 4 ranks in either layout (experts, or their intermediate dimension)
DEMO_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 256,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "norm_topk_prob": True,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,  # greedy tokens vary (tied: one token repeated)
    "attention_bias": False,
    "dtype": "bfloat16",
}


def default_cache_dir() -> Path:
    """$LAYERWISE_CACHE, else $XDG_CACHE_HOME/layerwise, else ~/.cache/layerwise."""
    if os.environ.get("LAYERWISE_CACHE"):
        return Path(os.environ["LAYERWISE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "layerwise"


def _qwen3_tensors(cfg: dict, generator: torch.Generator):
    """(key, tensor) in Hugging Face naming for a Qwen3 or Qwen3-MoE config, BF16, std 0.02, norms at 1."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    yield "model.embed_tokens.weight", rand(v, h)
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}"
        yield f"{p}.input_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield f"{p}.post_attention_layernorm.weight", torch.ones(h, dtype=torch.bfloat16)
        yield f"{p}.self_attn.q_proj.weight", rand(nq * d, h)
        yield f"{p}.self_attn.k_proj.weight", rand(nkv * d, h)
        yield f"{p}.self_attn.v_proj.weight", rand(nkv * d, h)
        yield f"{p}.self_attn.o_proj.weight", rand(h, nq * d)
        yield f"{p}.self_attn.q_norm.weight", torch.ones(d, dtype=torch.bfloat16)
        yield f"{p}.self_attn.k_norm.weight", torch.ones(d, dtype=torch.bfloat16)
        sparse = is_moe_layer(
            n, cfg.get("num_experts", 0), cfg.get("mlp_only_layers", []), cfg.get("decoder_sparse_step", 1)
        )
        if sparse:  # router [E, H], then each expert's projections
            experts, moe_i = cfg["num_experts"], cfg["moe_intermediate_size"]
            yield f"{p}.mlp.gate.weight", rand(experts, h)
            for e in range(experts):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", rand(moe_i, h)
                yield f"{p}.mlp.experts.{e}.up_proj.weight", rand(moe_i, h)
                yield f"{p}.mlp.experts.{e}.down_proj.weight", rand(h, moe_i)
        else:
            yield f"{p}.mlp.gate_proj.weight", rand(i, h)
            yield f"{p}.mlp.up_proj.weight", rand(i, h)
            yield f"{p}.mlp.down_proj.weight", rand(h, i)
    yield "model.norm.weight", torch.ones(h, dtype=torch.bfloat16)
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", rand(v, h)


def write_checkpoint(
    path: str | os.PathLike,
    config: dict,
    seed: int = 0,
    max_shard_bytes: int = 4 << 20,
    *,
    tokenizer: bool | None = None,
) -> Path:
    """Write a random BF16 checkpoint for a Qwen3 or Qwen3-MoE ``config`` (HF field names) into ``path``.

    Shards hold at most ``max_shard_bytes`` of tensor data (a larger tensor gets its own shard).

    Args:
        tokenizer: also write the demo tokenizer (:func:`write_text_files`: tokenizer files, generation_config.json
            and ``eos_token_id`` in config.json). Default: when ``config["vocab_size"]`` has room for it (259 ids
            or more); tiny test configs stay without one, as before.
    Returns:
        the directory.
    Raises:
        ValueError: ``tokenizer=True`` with a vocabulary below 259 ids.
    """
    if tokenizer is None:
        tokenizer = tokenizer_fits(config["vocab_size"])
    elif tokenizer:
        check_vocab_size(config["vocab_size"])  # before any file is written
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards, current, size = [], {}, 0
    for key, tensor in _qwen3_tensors(config, gen):
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = tensor
        size += nbytes
    shards.append(current)
    weight_map = {}
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
    with open(path / INDEX_FILE, "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if tokenizer:
        write_text_files(path, config)  # config.json with eos_token_id, then the tokenizer, the generation config
    else:
        with open(path / CONFIG_NAME, "w") as f:
            json.dump(config, f, indent=2)
    return path


def write_text_files(path: str | os.PathLike, config: dict) -> None:
    """The text side of a checkpoint written for ``config``: config.json with ``eos_token_id`` (``<|im_end|>``), the
    demo tokenizer for ``config["vocab_size"]`` and generation_config.json with ``eos_token_id`` [``<|im_end|>``,
    ``<|endoftext|>``] (as Qwen2.5's), written last: :func:`demo_checkpoint` takes its presence to mean complete.

    Raises:
        ValueError: a vocabulary below 259 ids.
    """
    path = Path(path)
    ids = special_token_ids(config["vocab_size"])
    with open(path / CONFIG_NAME, "w") as f:
        json.dump({**config, "eos_token_id": ids["<|im_end|>"]}, f, indent=2)
    write_tokenizer(path, config["vocab_size"])
    write_generation_config(
        path, eos_token_ids=[ids["<|im_end|>"], ids["<|endoftext|>"]], pad_token_id=ids["<|endoftext|>"]
    )


def demo_checkpoint(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """The demo checkpoint's directory, generated on first use (about 52 MiB of BF16), with its tokenizer.

    ``seed`` selects the weights (seed 1 is the "new policy" used by ``layerwise reload``). A directory cached by an
    earlier version without the tokenizer gets it (and the generation config) added; its weights are kept.
    """
    name = "demo-qwen3-8l" if seed == 0 else f"demo-qwen3-8l-seed{seed}"
    path = Path(cache_dir or default_cache_dir()) / name
    if not (path / INDEX_FILE).exists():
        write_checkpoint(path, DEMO_CONFIG, seed=seed, tokenizer=True)
    elif not (path / GENERATION_CONFIG_NAME).exists():
        write_text_files(path, DEMO_CONFIG)
    return path


def demo_moe_checkpoint(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """The mixture-of-experts demo checkpoint's directory (:data:`DEMO_MOE_CONFIG`, about 16 MiB of BF16, with the
    demo tokenizer), generated on first use like :func:`demo_checkpoint`."""
    name = "demo-qwen3-moe-4l" if seed == 0 else f"demo-qwen3-moe-4l-seed{seed}"
    path = Path(cache_dir or default_cache_dir()) / name
    if not (path / GENERATION_CONFIG_NAME).exists():  # written last: its presence means complete
        write_checkpoint(path, DEMO_MOE_CONFIG, seed=seed, tokenizer=True)
    return path


@torch.inference_mode()
def greedy_tokens(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by full re-computation (no KV cache): prompt -> new token ids."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt], device=device)
    out = []
    for _ in range(max_new_tokens):
        nxt = model(ids)[0, -1].argmax().item()
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out
