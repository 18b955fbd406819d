"""Streaming reader for Hugging Face safetensors checkpoints.

A checkpoint directory holds ``config.json`` and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``weight_map``: tensor key -> shard file). Tensors are streamed one at a
time, in decoder-layer order whatever the shard order, so no shard is ever read into memory whole.

Two ways to read a tensor:

* :meth:`Checkpoint.iter_lazy` (what load and reload stream) yields :class:`LazyTensor` handles. A weight
  loader narrows one to its rows or columns (tensor parallelism) before reading it; the read is an
  ``os.preadv`` from the shard's open descriptor into host memory (reused buffers), at the offsets of the
  safetensors header (8-byte little-endian header length, JSON header, ``data_offsets`` from the end of the
  header), of only the slice's bytes (``Checkpoint.bytes_read`` counts them). No memory-mapped page is
  touched, so a shard truncated meanwhile is an error, never a SIGBUS. ``Checkpoint(path, mmap=True)`` makes
  them views of the memory map instead (no copy; a first load, which has no live model to lose).
* :meth:`Checkpoint.get_tensor` and iterating the checkpoint give views of the memory-mapped file
  (``safetensors.safe_open``; nothing is copied), for callers that know the files stay as they are.

Every shard's size, mtime and inode are recorded when the checkpoint opens it (:class:`FileIdentity`) and
compared before every tensor is read and once more when a stream ends: a shard truncated, rewritten or
replaced meanwhile raises :class:`~layerwise.errors.CheckpointChangedError` naming it and what changed (a
reload wraps it in a ReloadError; Limitations 13 in ``layerwise/reload/__init__.py`` says what is not seen).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone

import numpy as np
import torch
from safetensors import safe_open

from layerwise.errors import CheckpointChangedError, CheckpointError

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
_ADVICE = (
    "a checkpoint must stay as it is while it is read: write a new one to a new directory (or replace its files "
    "between reloads, never during one), then reload"
)


def _utc(ns: int) -> str:
    return f"{datetime.fromtimestamp(ns // 10**9, timezone.utc):%Y-%m-%dT%H:%M:%S}.{ns % 10**9:09d}Z"


@dataclass(frozen=True)
class FileIdentity:
    """What a shard file was when the checkpoint opened it: its size, ``st_mtime_ns`` and inode (``st_dev``,
    ``st_ino``). A file truncated, rewritten in place or replaced (another inode at its path, as ``os.replace``
    leaves it) differs in one of them; one that keeps its size and inode and is rewritten within the
    filesystem's mtime granularity does not (Limitations 13 in ``layerwise/reload/__init__.py``)."""

    size: int
    mtime_ns: int
    dev: int
    ino: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino)

    def changes(self, now: FileIdentity | None) -> list[str]:
        """What differs in ``now`` (None: no file at the path any more), in words; [] when nothing does."""
        if now is None:
            return ["deleted (no file at its path)"]
        out = []
        if (now.dev, now.ino) != (self.dev, self.ino):
            out.append(f"replaced by another file (inode {self.dev}:{self.ino} -> {now.dev}:{now.ino})")
        if now.size != self.size:
            out.append(f"size {self.size} -> {now.size} bytes")
        if now.mtime_ns != self.mtime_ns:
            out.append(f"mtime {_utc(self.mtime_ns)} -> {_utc(now.mtime_ns)}")
        return out


def _runs(shape: tuple, box: tuple[tuple[int, int], ...]) -> tuple[list[int], int]:
    """The box of a row-major tensor of ``shape`` as runs of elements contiguous in the file, in the box's own
    row-major order: (each run's first element, elements per run). The whole tensor, or a box narrowed in its
    first dimension only (column-parallel rows), is one run; a box narrowed in dimension d is one run per index
    of the dimensions before d (row-parallel columns of a [rows, cols] weight: one run per row)."""
    d = len(shape)
    while d > 0 and box[d - 1] == (0, shape[d - 1]):
        d -= 1
    if d == 0:
        return [0], math.prod(shape)
    d -= 1  # the last dimension the box narrows; every one after it is whole
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    first = box[d][0] * strides[d]
    outer = itertools.product(*(range(start, stop) for start, stop in box[:d]))
    starts = [first + sum(i * s for i, s in zip(index, strides, strict=False)) for index in outer]
    return starts, (box[d][1] - box[d][0]) * strides[d]


class _ReadBuffers:
    """The host memory preads land in, reused within one checkpoint: a buffer comes back once the last tensor over
    it is freed (a ``weakref.finalize`` on the numpy view a tensor holds), so a stream of reads pays the page
    faults of fresh memory only for its first tensors. A read takes the smallest free buffer that holds it, else
    a new one, dropping the free buffers too small for it: so there are never more buffers than tensors alive at
    once, each at most the largest read. Numpy allocations, made outside torch's dispatcher (like a memory-mapped
    view), so :class:`layerwise.memory.DeviceMemoryTracker` does not count them; RssAnon does."""

    def __init__(self):
        self.free: list[np.ndarray] = []
        self.keep = True  # False once the checkpoint is closed: buffers freed later are not kept

    def take(self, nbytes: int) -> np.ndarray:
        fits = [i for i, b in enumerate(self.free) if b.nbytes >= nbytes]
        if fits:
            base = self.free.pop(min(fits, key=lambda i: self.free[i].nbytes))
        else:
            self.free.clear()  # all too small for this read
            base = np.empty(nbytes, dtype=np.uint8)
        view = base[:nbytes]
        weakref.finalize(view, self._give_back, base)
        return view

    def _give_back(self, base: np.ndarray) -> None:
        if self.keep:
            self.free.append(base)

    def release(self) -> None:
        self.free.clear()
        self.keep = False


class _ShardFile:
    """One safetensors file of a checkpoint, opened once: a descriptor, the :class:`FileIdentity` it had then,
    each tensor's first byte in the file (from its header), and safetensors' memory-mapped handle for views.

    :meth:`close` closes the descriptor and the handle; a later read opens the path again and is compared with
    the identity recorded the first time, so a file replaced in between is still refused."""

    def __init__(self, path: str, buffers: _ReadBuffers):
        self.path = path
        self.buffers = buffers
        self._fd: int | None = None
        self._closer = None
        self._handle = None
        fd = self.fd()
        self.identity = FileIdentity.of(os.fstat(fd))
        self.handle()  # safetensors checks the header against the file size; its errors say what is wrong
        header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
        data_start = 8 + header_len
        header = json.loads(os.pread(fd, header_len, 8))
        self.offsets = {  # key -> first byte of its data in the file
            key: data_start + entry["data_offsets"][0] for key, entry in header.items() if key != "__metadata__"
        }
        self.check()  # the file safetensors opened is the one described here

    def fd(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            self._closer = weakref.finalize(self, os.close, self._fd)
        return self._fd

    def handle(self):
        if self._handle is None:
            self._handle = safe_open(self.path, framework="pt", device="cpu")
        return self._handle

    def close(self) -> None:
        if self._closer is not None:
            self._closer()
        self._fd = self._closer = self._handle = None

    def check(self, key: str | None = None, *, path: bool = True) -> None:
        """Raise CheckpointChangedError when the file differs from its :attr:`identity`: the open descriptor's
        size or mtime (truncated, or written in place), or with ``path`` what its path now names (replaced,
        deleted)."""
        try:
            changes = self.identity.changes(FileIdentity.of(os.fstat(self.fd())))
            at_path = FileIdentity.of(os.stat(self.path)) if path else self.identity
        except FileNotFoundError:  # deleted (a descriptor closed by close() cannot open it again)
            changes, at_path = [], None
        if at_path is None or (at_path.dev, at_path.ino) != (self.identity.dev, self.identity.ino):
            changes = self.identity.changes(at_path)  # replaced: what the path names now
        if changes:
            raise CheckpointChangedError(
                f"checkpoint file changed while it was being read: {', '.join(changes)}; {_ADVICE}",
                key=key,
                file=self.path,
            )

    def read(self, key: str, shape: tuple, dtype: torch.dtype, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The box of tensor ``key`` read with ``os.preadv`` into host memory (:class:`_ReadBuffers`), the file
        checked before and after: the bytes returned were all read from the file as it was when opened (to its
        mtime granularity)."""
        self.check(key)
        out_shape = tuple(stop - start for start, stop in box)
        nbytes = math.prod(out_shape) * dtype.itemsize
        buffer = self.buffers.take(nbytes)
        if nbytes:
            begin = self.offsets[key]
            starts, run = _runs(shape, box)
            run_bytes = run * dtype.itemsize
            view = memoryview(buffer)
            for i, start in enumerate(starts):
                self._read_exactly(view[i * run_bytes : (i + 1) * run_bytes], begin + start * dtype.itemsize, key)
            self.check(key, path=False)  # written while it was read: refused before anyone uses the bytes
        return torch.from_numpy(buffer).view(dtype).view(out_shape)

    def view(self, key: str, box: tuple[tuple[int, int], ...], whole: bool) -> torch.Tensor:
        """The box of tensor ``key`` from safetensors' memory map, after checking the file (a view for the whole
        tensor; safetensors' slice otherwise). Its pages are read when it is used: see ``Checkpoint(mmap=True)``."""
        self.check(key)
        if whole:
            return self.handle().get_tensor(key)
        return self.handle().get_slice(key)[tuple(slice(start, stop) for start, stop in box)]

    def _read_exactly(self, into: memoryview, offset: int, key: str) -> None:
        done = 0
        while done < len(into):
            try:
                n = os.preadv(self.fd(), [into[done:]], offset + done)
            except OSError as e:
                raise CheckpointError(
                    f"cannot read {len(into)} bytes at offset {offset}: {e}", key=key, file=self.path
                ) from e
            if n == 0:
                size = os.fstat(self.fd()).st_size
                raise CheckpointChangedError(
                    f"checkpoint file changed while it was being read: a short read ({done} of {len(into)} bytes "
                    f"at offset {offset}), the file is now {size} bytes where it was {self.identity.size} "
                    f"(truncated); {_ADVICE}",
                    key=key,
                    file=self.path,
                )
            done += n


class LazyTensor:
    """A checkpoint tensor (or a box-shaped slice of one) that is read only when materialized.

    What the load path needs of a tensor before reading it: ``shape``, ``dtype``, ``device`` (cpu),
    ``numel()``, ``element_size()``, ``to("meta")`` (for counting a loader's writes), and
    ``narrow(dim, start, length)``, which returns a smaller LazyTensor. ``materialize()`` reads the box (only
    its bytes: one ``os.preadv`` for the whole tensor or a range of rows, one per row for a range of columns)
    into host memory, checking before and after that the file did not change since the checkpoint opened it
    (``Checkpoint(mmap=True)``: a view of the memory-mapped file, checked before), and adds its bytes to
    ``checkpoint.bytes_read``.
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
        """Read the box from the file (see the class docstring): a CPU tensor of :attr:`shape` in the file's dtype.

        Raises:
            CheckpointChangedError: the file was truncated, rewritten or replaced since the checkpoint opened it
                (also a read that comes back short); names the file and what changed.
            CheckpointError: the read failed (an OSError of the file system, kept as ``__cause__``).
        """
        tensor = self.checkpoint._read(self.key, self.box)
        self.checkpoint.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def __repr__(self) -> str:
        return f"LazyTensor({self.key!r}, box={self.box})"


class Checkpoint:
    """A Hugging Face safetensors checkpoint directory.

    Args:
        path: directory with config.json and model.safetensors or model.safetensors.index.json.
        mmap: :class:`LazyTensor` reads return views of safetensors' memory map (as :meth:`get_tensor`) instead of
            ``os.preadv`` copies: no copy into host memory (a weight is quantized where the page cache holds it),
            and the files are checked the same way before each read and at the end of :meth:`iter_lazy`, but a
            file truncated while a view is used kills the process with SIGBUS. For a caller with nothing to lose
            to that (a first load); a reload of a live model reads with pread (Limitations 13 in
            ``layerwise/reload/__init__.py``).
    Attributes:
        config: the parsed config.json (a dict); config_path: its path.
    Raises:
        CheckpointError: not a directory (for a string shaped like a hub id: how to download it), config.json
            missing, invalid JSON or not an object, no safetensors weights (these two name the .bin / .pt / .gguf
            files found and the conversion they need), a shard listed in index.json is absent (the message names
            the shard and one of its keys), a listed key is not in its shard, or a tensor of a dtype
            not loaded here (U16, C64, ...; names key and file).
    """

    def __init__(self, path: str | os.PathLike, *, mmap: bool = False):
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
        self.mmap = mmap
        self._buffers = _ReadBuffers()
        weakref.finalize(self, self._buffers.release)  # a tensor read may outlive the checkpoint, not its spares
        self._shards: dict[str, _ShardFile] = {}  # every file opened (all of them, for their headers)
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
        return {key: SINGLE_FILE for key in self._shard(SINGLE_FILE).handle().keys()}

    def _shard(self, shard: str) -> _ShardFile:
        """The open file of a shard named in the index; opened (and its :class:`FileIdentity` recorded) once."""
        file = self._shards.get(shard)
        if file is None:
            full = self.file_of_shard(shard)
            try:
                file = _ShardFile(full, self._buffers)
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot open safetensors file: {_diagnose(full) or e}", file=full) from e
            self._shards[shard] = file
        return file

    def _read(self, key: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        info = self.tensors[key]
        self._buffers.keep = True  # read after close(): reuse again
        if self.mmap:
            return self._shard(info.file).view(key, box, whole=box == tuple((0, n) for n in info.shape))
        return self._shard(info.file).read(key, info.shape, _TORCH_DTYPES[info.dtype], box)

    def check_unchanged(self) -> None:
        """Raise CheckpointChangedError (naming the file and what changed) when a file of the checkpoint was
        truncated, rewritten or replaced since it was opened. :meth:`iter_lazy` and iteration call it after
        their last tensor, so that a file changed after its last read is refused too."""
        for file in self._shards.values():
            file.check()

    def _read_headers(self, weight_map: dict[str, str]) -> dict[str, TensorInfo]:
        infos = {}
        for key, shard in weight_map.items():
            handle = self._shard(shard).handle()
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
        """The tensor ``key`` as a CPU view of the memory-mapped file, in the file's dtype (nothing is copied),
        once the file is checked unchanged since it was opened. The view's pages are read when it is used: a file
        truncated while a view is alive kills the process with SIGBUS when that view is read; :meth:`iter_lazy`
        reads without a mapping. Raises KeyError for a key the checkpoint does not hold (:attr:`keys` lists
        them), CheckpointChangedError for a file that changed."""
        file = self._shard(self.tensors[key].file)
        file.check(key)
        return file.handle().get_tensor(key)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (key, tensor) in decoder-layer order, one tensor at a time (views: see :meth:`get_tensor`);
        after the last, check every file once more (:meth:`check_unchanged`)."""
        for key in self.keys:
            yield key, self.get_tensor(key)
        self.check_unchanged()

    def iter_lazy(self) -> Iterator[tuple[str, LazyTensor]]:
        """Yield (key, :class:`LazyTensor`) in decoder-layer order; nothing is read until a loader
        materializes (a slice of) the tensor. After the last, every file is checked once more
        (:meth:`check_unchanged`): a file changed after its last read ends the stream with an error too."""
        for key in self.keys:
            yield key, LazyTensor(self, key)
        self.check_unchanged()

    def close(self) -> None:
        """Close the files' descriptors and safetensors handles (their mmaps close when the last view is freed).
        A later read opens a file again and still compares it with what it was the first time."""
        for file in self._shards.values():
            file.close()
        self._buffers.release()
