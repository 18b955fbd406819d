"""The benchmark checkpoints: Llama-shaped, random BF16, written with safetensors one shard at a time.

Sizes (untied lm_head; heads of 128 dims except the two small sizes):

=========  ======  ======  ============  =====  ========  =======  ==========================================
size       layers  hidden  intermediate  heads  kv heads  vocab    what it is
=========  ======  ======  ============  =====  ========  =======  ==========================================
small      4       256     704           4      2         2048     a few MiB: tests
default    24      1024    2816          16     8         32000    0.7 GB: the reference CPU run
0.9b       16      2048    5632          16     8         32000    1.8 GB: issue 14's CPU figures
8b         32      4096    14336         32     8         128256   15 GiB: Llama-3-8B's shapes (GPU runs)
=========  ======  ======  ============  =====  ========  =======  ==========================================

Values: decoder and embedding weights are normal(0, 0.02) times a per-tensor factor in [0.75, 1.25] (the
initializer_range of transformers' Llama, so FP8 scales fall where a real checkpoint's do, and differ from
tensor to tensor); norm weights are ones. Generating 8B normals on a CPU would take longer than the benchmark,
so on CPU each tensor is tiled from one random block of ``BLOCK_NUMEL`` (a prime count, so rows and 128 x 128
blocks never line up with its period) starting at a random offset; with ``device="cuda"`` every element is
drawn by ``torch.randn`` on the GPU. A checkpoint is generated once under ``root`` in a folder named by its
size and a digest of its shapes, and reused while the shapes stay the same.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import torch

SIZES = {
    "default": dict(
        num_hidden_layers=24,
        hidden_size=1024,
        intermediate_size=2816,
        vocab_size=32000,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_shard_size="200MB",
    ),
    "small": dict(
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=704,
        vocab_size=2048,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size="2MB",
    ),
    "0.9b": dict(
        num_hidden_layers=16,
        hidden_size=2048,
        intermediate_size=5632,
        vocab_size=32000,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_shard_size="1GB",
    ),
    "8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_shard_size="5GB",
        rope_theta=500000.0,
        max_position_embeddings=8192,
    ),
}
WEIGHT_STD = 0.02  # transformers' LlamaConfig.initializer_range
BLOCK_NUMEL = 4_194_319  # a prime just above 2**22: the period of the CPU tiling
GENERATOR_VERSION = 1  # part of the folder digest: bump when the values written change
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9}


def shape(size: str) -> dict:
    """The ``size`` checkpoint's config fields (SIZES[size] without max_shard_size): the results' ``shape``."""
    return {k: v for k, v in SIZES[size].items() if k != "max_shard_size"}


def shard_bytes(text: str) -> int:
    """Bytes of a shard-size string such as "200MB" or "5GB" (decimal units, as transformers).

    Raises:
        ValueError: not a number followed by KB, MB or GB.
    """
    for unit, factor in _UNITS.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    raise ValueError(f"shard size {text!r}: expected a number followed by KB, MB or GB")


def tensor_shapes(spec: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face key, shape) of every tensor of a Llama checkpoint with ``spec``'s sizes, in the order
    transformers writes them (embeddings, layer 0..N-1, final norm, lm_head)."""
    h, i, v = spec["hidden_size"], spec["intermediate_size"], spec["vocab_size"]
    head_dim = h // spec["num_attention_heads"]
    q, kv = spec["num_attention_heads"] * head_dim, spec["num_key_value_heads"] * head_dim
    shapes = [("model.embed_tokens.weight", (v, h))]
    for n in range(spec["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (i, h)),
            (p + "mlp.up_proj.weight", (i, h)),
            (p + "mlp.down_proj.weight", (h, i)),
        ]
    return shapes + [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]


def checkpoint_bytes(spec: dict) -> int:
    """Bytes of the BF16 tensors of a checkpoint with ``spec``'s sizes (2 per element)."""
    return sum(2 * math.prod(shape) for _, shape in tensor_shapes(spec))


def checkpoint_dir(size: str, root: Path) -> Path:
    """``root/llama-<size>-<digest of the shapes and GENERATOR_VERSION>``: where ``size`` is cached."""
    key = json.dumps({"spec": SIZES[size], "generator": GENERATOR_VERSION}, sort_keys=True)
    return Path(root) / f"llama-{size}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"


class _Weights:
    """Random BF16 weights, one tensor at a time (see the module docstring for the values)."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self.rng = torch.Generator().manual_seed(seed)
        if device.type == "cpu":
            self.block = torch.randn(BLOCK_NUMEL, generator=self.rng) * WEIGHT_STD  # float32, 16 MiB
        else:
            self.cuda_rng = torch.Generator(device).manual_seed(seed)

    def __call__(self, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """A new contiguous CPU tensor [shape] in bfloat16."""
        if key.endswith("norm.weight"):
            return torch.ones(shape, dtype=torch.bfloat16)
        factor = 0.75 + 0.5 * torch.rand((), generator=self.rng).item()
        numel = math.prod(shape)
        if self.device.type != "cpu":
            drawn = torch.randn(numel, device=self.device, generator=self.cuda_rng).mul_(WEIGHT_STD * factor)
            return drawn.to(torch.bfloat16).cpu().reshape(shape)
        start = int(torch.randint(BLOCK_NUMEL, (), generator=self.rng))
        period = torch.cat([self.block[start:], self.block[:start]]).mul_(factor).to(torch.bfloat16)
        out = torch.empty(numel, dtype=torch.bfloat16)
        whole, rest = divmod(numel, BLOCK_NUMEL)
        if whole:
            out[: whole * BLOCK_NUMEL].view(whole, BLOCK_NUMEL).copy_(period.expand(whole, BLOCK_NUMEL))
        out[whole * BLOCK_NUMEL :].copy_(period[:rest])
        return out.reshape(shape)


def _write_config(spec: dict, folder: Path) -> None:
    import transformers  # its own config class, so that every transformers version reads the file back

    fields = {k: v for k, v in spec.items() if k != "max_shard_size"}
    fields.setdefault("max_position_embeddings", 4096)
    config = transformers.LlamaConfig(
        **fields, tie_word_embeddings=False, torch_dtype="bfloat16", architectures=["LlamaForCausalLM"]
    )
    config.save_pretrained(folder)


def make_checkpoint(size: str, root: Path, device: str | torch.device = "cpu", verbose: bool = False) -> Path:
    """The ``size`` checkpoint under ``root`` (see :func:`checkpoint_dir`), generated the first time and reused
    after; returns its directory.

    Writes config.json (transformers' LlamaConfig), shards of at most the size's ``max_shard_size``
    (``model-0000i-of-0000n.safetensors``, or ``model.safetensors`` when one suffices) and, for several
    shards, ``model.safetensors.index.json``. Host memory: one shard. The folder is written under a temporary
    name and renamed when complete, so an interrupted run never leaves a checkpoint that looks finished.

    Args:
        device: where the random values are drawn ("cuda": torch.randn on the GPU; "cpu": tiled, see above).
        verbose: print the generation time to stderr.
    Raises:
        KeyError: an unknown size.
        ImportError: transformers (which writes config.json) is missing.
    """
    from safetensors.torch import save_file

    spec = SIZES[size]
    path = checkpoint_dir(size, root)
    if path.is_dir():
        return path
    start = time.perf_counter()
    partial = path.with_name(f".{path.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _write_config(spec, partial)
    limit = shard_bytes(spec["max_shard_size"])
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    filled = 0
    for key, shape in tensor_shapes(spec):  # plan the shards first: the file names carry their count
        nbytes = 2 * math.prod(shape)
        if shards[-1] and filled + nbytes > limit:
            shards.append([])
            filled = 0
        shards[-1].append((key, shape))
        filled += nbytes
    weights = _Weights(torch.device(device))
    weight_map = {}
    for n, shard in enumerate(shards, start=1):
        name = "model.safetensors" if len(shards) == 1 else f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file({key: weights(key, shape) for key, shape in shard}, partial / name, metadata={"format": "pt"})
        weight_map.update({key: name for key, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": checkpoint_bytes(spec)}, "weight_map": weight_map}
        (partial / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    partial.rename(path)
    if verbose:
        import sys

        print(
            f"generated {path} ({checkpoint_bytes(spec) / 2**30:.2f} GiB) in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
        )
    return path
