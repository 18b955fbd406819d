"""Streaming reader for Hugging Face safetensors checkpoints.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``weight_map``: tensor key -> shard file). Tensors are read one at
a time through ``safetensors.safe_open`` (memory-mapped: a tensor is a view of the file's pages, so
no shard is ever read into memory whole), in decoder-layer order whatever the shard order.

Under tensor parallelism a rank needs only a slice of most tensors: :meth:`Checkpoint.iter_lazy` yields
:class:`LazyTensor` handles that the weight loaders narrow to their rows or columns before reading them
(``safe_open(...).get_slice(key)[rows, cols]``); ``Checkpoint.bytes_read`` counts what was read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open

from layerwise.errors import CheckpointError

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_TORCH_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


# what a directory may hold instead of layerwise's safetensors layout, by file suffix, and what to do about it
_TORCH_PICKLE = (
    "PyTorch pickle weights, which layerwise does not read (safetensors only). Convert them once: "
    "transformers.AutoModelForCausalLM.from_pretrained({dir!r}, torch_dtype='auto').save_pretrained(OUT, "
    "safe_serialization=True), or for a plain state dict safetensors.torch.save_file(torch.load({path!r}, "
    "weights_only=True), 'OUT/model.safetensors') next to a copy of config.json; then pass OUT"
)
_OTHER_LAYOUTS = {
    ".safetensors": f"layerwise reads {SINGLE_FILE}, or the shards that {INDEX_FILE} lists; rename a single file "
    f"to {SINGLE_FILE}",
    ".bin": _TORCH_PICKLE,
    ".pt": _TORCH_PICKLE,
    ".pth": _TORCH_PICKLE,
    ".gguf": "GGUF weights, which layerwise does not read (safetensors only). transformers reads GGUF: "
    "transformers.AutoModelForCausalLM.from_pretrained({dir!r}, gguf_file={name!r}, torch_dtype=torch.bfloat16)"
    ".save_pretrained(OUT, safe_serialization=True) writes config.json and safetensors (a quantized GGUF is "
    "dequantized); then pass OUT",
}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def missing_directory_reason(path: str) -> str:
    """Why ``path``, which does not exist, is no checkpoint: "no such directory", and for a string shaped like a
    Hugging Face hub id ("Qwen/Qwen3-8B": one slash) that hub ids are not downloaded and how to get a directory."""
    if _HUB_ID.fullmatch(path):
        return (
            f"no such directory; if {path} is a Hugging Face hub id: layerwise reads local directories and downloads "
            f"nothing. Download it first (huggingface-cli download {path} --local-dir DIR, or "
            f"huggingface_hub.snapshot_download({path!r}, local_dir=DIR)), then pass DIR"
        )
    return "no such directory; give a directory with config.json and *.safetensors"


def other_weight_files(path: str) -> str | None:
    """The weight files directory ``path`` holds that layerwise does not read as they are (.bin, .pt, .pth, .gguf,
    safetensors under other names), by format, each with what to do (the commands name ``path`` and its first
    such file); None when it holds none."""
    by_advice: dict[str, list[str]] = {}
    for name in sorted(os.listdir(path)):
        advice = _OTHER_LAYOUTS.get(os.path.splitext(name)[1].lower())
        if advice is not None:
            by_advice.setdefault(advice, []).append(name)
    if not by_advice:
        return None
    return "; ".join(
        f"it holds {', '.join(names)}: {advice.format(dir=path, name=names[0], path=os.path.join(path, names[0]))}"
        for advice, names in by_advice.items()
    )


def decoder_layer(name: str) -> int | None:
    """The decoder-layer index i of a checkpoint key or module prefix with a ``layers.<i>`` component
    ("model.layers.3.mlp.up_proj.weight", "model.layers.3"), else None."""
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


def layer_group(key: str) -> tuple[int, int]:
    """Sort key placing a tensor by decoder layer: embeddings first, then layer 0..N-1, then the rest.

    Returns (0, 0) for ``*embed_tokens*``, (1, i) for ``*.layers.i.*``, (2, 0) otherwise.
    """
    i = decoder_layer(key)
    if i is not None:
        return (1, i)
    return (0, 0) if "embed_tokens" in key else (2, 0)


def group_name(key: str) -> str:
    """Human name of a key's load group: "layers.3", "embed_tokens" or the key's module prefix."""
    kind, idx = layer_group(key)
    if kind == 1:
        return f"layers.{idx}"
    return key.rsplit(".", 1)[0]


def _diagnose(path: str) -> str | None:
    """Why a safetensors file does not open, in words, when it is truncated: the file format is an
    8-byte little-endian header length, a JSON header with each tensor's data_offsets, then the data."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return f"the file is truncated: {size} bytes, shorter than the 8-byte header length"
        header_len = int.from_bytes(prefix, "little")
        if 8 + header_len > size:
            return (
                f"the file is truncated: {size} bytes, but its header alone needs {8 + header_len} "
                f"(an interrupted download or copy?)"
            )
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            return None
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and "data_offsets" in t]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return (
            f"the file is truncated: {size} bytes where its header describes {expected} "
            f"(an interrupted download or copy?)"
        )
    return None


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one checkpoint tensor: file (basename), dtype name ("BF16"), shape, nbytes."""

    key: str
    file: str
    dtype: str
    shape: tuple
    nbytes: int


_CPU = torch.device("cpu")


class LazyTensor:
    """A checkpoint tensor (or a box-shaped slice of one) that is read only when materialized.

    What the load path needs of a tensor before reading it: ``shape``, ``dtype``, ``device`` (cpu),
    ``numel()``, ``element_size()``, ``to("meta")`` (for counting a loader's writes), and
    ``narrow(dim, start, length)``, which returns a smaller LazyTensor. ``materialize()`` reads the box:
    the whole tensor as a memory-mapped view, or a slice through ``get_slice(key)[...]`` (a copy of only
    those bytes), and adds its bytes to ``checkpoint.bytes_read``.
    """

    def __init__(self, checkpoint: Checkpoint, key: str, box: tuple[tuple[int, int], ...] | None = None):
        info = checkpoint.tensors[key]
        self.checkpoint, self.key, self.full_shape = checkpoint, key, info.shape
        self.box = box if box is not None else tuple((0, n) for n in info.shape)  # (start, stop) per dim
        self.shape = torch.Size(stop - start for start, stop in self.box)
        self.dtype = _TORCH_DTYPES[info.dtype]  # checked when the headers were read
        self.device = _CPU

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def to(self, device, *args, **kwargs):
        """An empty tensor of this shape on ``device`` "meta" (nothing read); any other device: the data."""
        if torch.device(device).type == "meta":
            return torch.empty(self.shape, dtype=self.dtype, device="meta")
        return self.materialize().to(device, *args, **kwargs)

    def narrow(self, dim: int, start: int, length: int) -> LazyTensor:
        """Elements [start, start + length) along ``dim`` of this box (as ``torch.Tensor.narrow``)."""
        lo, hi = self.box[dim]
        if not (0 <= start and length >= 0 and start + length <= hi - lo):
            raise IndexError(f"{self.key}: narrow({dim}, {start}, {length}) outside size {hi - lo}")
        box = list(self.box)
        box[dim] = (lo + start, lo + start + length)
        return LazyTensor(self.checkpoint, self.key, tuple(box))

    def materialize(self) -> torch.Tensor:
        """Read the box from the file (see the class docstring): a CPU tensor of :attr:`shape` in the file's dtype
        (a memory-mapped view for the whole tensor, a copy for a slice). Raises what safetensors raises for an
        unreadable file (OSError, SafetensorError)."""
        handle = self.checkpoint._open(self.checkpoint.tensors[self.key].file)
        if all((start, stop) == (0, n) for (start, stop), n in zip(self.box, self.full_shape, strict=True)):
            tensor = handle.get_tensor(self.key)
        else:
            tensor = handle.get_slice(self.key)[tuple(slice(start, stop) for start, stop in self.box)]
        self.checkpoint.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self.key!r}, box={self.box})"


class Checkpoint:
    """A Hugging Face safetensors checkpoint directory.

    Args:
        path: directory with config.json and model.safetensors or model.safetensors.index.json.
    Attributes:
        config: the parsed config.json (a dict); config_path: its path.
    Raises:
        CheckpointError: not a directory (for a string shaped like a hub id: how to download it), config.json
            missing, invalid JSON or not an object, no safetensors weights (these two name the .bin / .pt / .gguf
            files found and the conversion they need), a shard listed in index.json is absent (the message names
            the shard and one of its keys), a listed key is not in its shard, or a tensor of a dtype
            not loaded here (U16, C64, ...; names key and file).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if os.path.isfile(self.path):
            raise CheckpointError(
                f"{self.path} is a file; pass the checkpoint directory that holds config.json "
                f"and the *.safetensors files",
                file=self.path,
            )
        if not os.path.isdir(self.path):
            raise CheckpointError(
                f"checkpoint directory {self.path}: {missing_directory_reason(self.path)}", file=self.path
            )
        self.config_path = os.path.join(self.path, CONFIG_NAME)
        if not os.path.isfile(self.config_path):
            others = other_weight_files(self.path)
            raise CheckpointError(
                f"config.json is missing in {self.path}" + (f"; {others}" if others else ""), file=self.config_path
            )
        try:
            with open(self.config_path) as f:
                self.config: dict = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"config.json is not valid JSON: {e}", file=self.config_path) from e
        if not isinstance(self.config, dict):
            raise CheckpointError("config.json does not hold a JSON object", file=self.config_path)
        self._handles: dict[str, object] = {}
        self.bytes_read = 0  # payload bytes materialized through LazyTensor (slices: only their bytes)
        self.tensors: dict[str, TensorInfo] = self._read_headers(self._weight_map())
        self.keys: list[str] = sorted(self.tensors, key=lambda k: (layer_group(k), k))

    def _weight_map(self) -> dict[str, str]:
        index_path = os.path.join(self.path, INDEX_FILE)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{INDEX_FILE} has no valid weight_map: {e}", file=index_path) from e
            for key, shard in weight_map.items():
                if not os.path.isfile(os.path.join(self.path, shard)):
                    raise CheckpointError(
                        f"shard {shard!r} listed in {INDEX_FILE} is missing",
                        key=key,
                        file=os.path.join(self.path, shard),
                    )
            return weight_map
        single = os.path.join(self.path, SINGLE_FILE)
        if not os.path.isfile(single):
            raise CheckpointError(
                f"no {SINGLE_FILE} or {INDEX_FILE} in {self.path}; {other_weight_files(self.path) or 'no weights'}",
                file=self.path,
            )
        return {key: SINGLE_FILE for key in self._open(SINGLE_FILE).keys()}

    def _open(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            full = os.path.join(self.path, shard)
            try:
                handle = safe_open(full, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open safetensors file: {_diagnose(full) or e}", file=full) from e
            self._handles[shard] = handle
        return handle

    def _read_headers(self, weight_map: dict[str, str]) -> dict[str, TensorInfo]:
        infos = {}
        for key, shard in weight_map.items():
            handle = self._open(shard)
            try:
                sl = handle.get_slice(key)
            except Exception as e:
                raise CheckpointError(
                    f"tensor listed in {INDEX_FILE} is not in its shard: {e}", key=key, file=self.file_of_shard(shard)
                ) from e
            shape, dtype = tuple(sl.get_shape()), sl.get_dtype()
            if dtype not in _TORCH_DTYPES:
                raise CheckpointError(
                    f"unsupported safetensors dtype {dtype} (supported: {', '.join(_TORCH_DTYPES)})",
                    key=key,
                    file=self.file_of_shard(shard),
                )
            numel = 1
            for s in shape:
                numel *= s
            infos[key] = TensorInfo(key, shard, dtype, shape, numel * _TORCH_DTYPES[dtype].itemsize)
        return infos

    def file_of_shard(self, shard: str) -> str:
        """Full path of a shard file named in the index."""
        return os.path.join(self.path, shard)

    def file_of(self, key: str) -> str | None:
        """Full path of the file holding ``key`` (None for an unknown key)."""
        info = self.tensors.get(key)
        return self.file_of_shard(info.file) if info else None

    @property
    def total_bytes(self) -> int:
        """Sum of all tensor payload bytes (headers excluded)."""
        return sum(t.nbytes for t in self.tensors.values())

    def group_bytes(self) -> dict[str, int]:
        """Payload bytes per load group (see :func:`group_name`), in load order."""
        out: dict[str, int] = {}
        for key in self.keys:
            name = group_name(key)
            out[name] = out.get(name, 0) + self.tensors[key].nbytes
        return out

    def get_tensor(self, key: str) -> torch.Tensor:
        """The tensor ``key`` as a CPU view of the memory-mapped file, in the file's dtype (nothing is copied).
        Raises KeyError for a key the checkpoint does not hold (:attr:`keys` lists them)."""
        return self._open(self.tensors[key].file).get_tensor(key)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (key, tensor) in decoder-layer order, one tensor at a time."""
        for key in self.keys:
            yield key, self.get_tensor(key)

    def iter_lazy(self) -> Iterator[tuple[str, LazyTensor]]:
        """Yield (key, :class:`LazyTensor`) in decoder-layer order; nothing is read until a loader
        materializes (a slice of) the tensor."""
        for key in self.keys:
            yield key, LazyTensor(self, key)

    def close(self) -> None:
        """Drop the open file handles (their mmaps close when the last tensor view is freed)."""
        self._handles.clear()
