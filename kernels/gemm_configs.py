"""Tuned launch configurations of the Triton FP8 GEMMs, per GPU, weight shape and batch size.

The right tile for a decode GEMM (M <= 16 rows against a 4096 x 14336 FP8 weight) depends on the GPU's
SM count, memory system and the shape, so, as vLLM does for its fused MoE and block FP8 kernels
(``configs/N=...,K=...,device_name=....json``), the measured best configuration is stored in a JSON file
per device and looked up at launch; shapes and devices without an entry use the heuristic tables of
``kernels.fp8_gemm``. ``python -m layerwise.benchmarks.gemm_tune --write-configs`` writes the file.

File ``configs/<device slug>.json`` (slug: :func:`device_slug` of ``torch.cuda.get_device_name``)::

    {"device_name": "NVIDIA H100 80GB HBM3", "commit": ..., "versions": {...},
     "configs": {"w8a16": {"6144,4096": {"16": [16, 64, 256, 4, 4, 4], ...}, ...},
                 "w8a16-block": {...}, "w8a8-block": {...}, "w8a8": {...}}}

Under each kind and "N,K", the key is the largest M a configuration was tuned for (the rows are
:class:`kernels.fp8_gemm.GemmTiles` fields in order); M takes the first key >= M, and M beyond the
largest key takes the heuristic table. A row may be ``null``: tuned, and the Triton GEMM lost there (kind
"w8a8": ``torch._scaled_mm`` runs), so that an M it lost at never takes the tiles of a larger M it won at.
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
FIELDS = 6  # block_m, block_n, block_k, split_k, num_warps, num_stages (kernels.fp8_gemm.GemmTiles)
# W8A16 per tensor / channel, W8A16 per block, W8A8 per block, W8A8 per tensor / channel (x quantized inside the
# GEMM: kernels.fp8_gemm.dynamic_w8a8_gemm), the last with null rows where the activation quantization kernel and
# torch._scaled_mm, which quant.fp8 runs otherwise, were faster
KINDS = ("w8a16", "w8a16-block", "w8a8-block", "w8a8")


def device_slug(name: str) -> str:
    """File stem for device ``name``: lower case, runs of other characters as one '-'
    ("NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3")."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def config_path(device_name: str, directory: Path | None = None) -> Path:
    """Where the tuned configurations of ``device_name`` live (in ``directory``, default CONFIG_DIR)."""
    return (CONFIG_DIR if directory is None else directory) / f"{device_slug(device_name)}.json"


@functools.cache
def _load(path: Path) -> dict:
    """kind -> "N,K" -> sorted [(max M, tiles fields or None)], or {} when ``path`` does not exist.

    Raises:
        ValueError: the file is not a configuration file of the documented layout (named in the message).
    """
    if not path.exists():
        return {}
    try:
        configs = json.loads(path.read_text())["configs"]
        table = {
            kind: {shape: sorted((int(m), None if fields is None else tuple(int(v) for v in fields))
                                 for m, fields in rows.items())
                   for shape, rows in shapes.items()}
            for kind, shapes in configs.items()
        }  # fmt: skip
        for kind, shapes in table.items():
            for shape, rows in shapes.items():
                for m, fields in rows:
                    if fields is not None and (len(fields) != FIELDS or min(fields) < 1):
                        raise ValueError(f"{kind} {shape} M={m}: {list(fields)} is not {FIELDS} positive integers")
        return table
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a GEMM configuration file ({type(e).__name__}: {e})") from e


def lookup(path: Path, kind: str, n: int, k: int, m: int) -> tuple[int, ...] | None:
    """The configuration in file ``path`` for an [m, k] x [n, k]^T GEMM of ``kind``: the fields of
    :class:`kernels.fp8_gemm.GemmTiles`, or None (no file, no entry for the shape, M beyond the tuned range, or
    the first tuned M at or above M is a null row: the Triton GEMM lost there)."""
    rows = _load(path).get(kind, {}).get(f"{n},{k}", ())
    return next((fields for max_m, fields in rows if m <= max_m), None)


@functools.lru_cache(maxsize=4096)
def tuned_fields(kind: str, n: int, k: int, m: int, device: torch.device) -> tuple[int, ...] | None:
    """:func:`lookup` in the file of CUDA ``device``'s GPU; None on other devices. Cached: every GEMM launch
    asks (``clear_caches`` after the file changes)."""
    if device.type != "cuda":
        return None
    return lookup(config_path(_device_name(device.index)), kind, n, k, m)


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def write_configs(path: Path, device_name: str, best: dict, provenance: dict) -> None:
    """Write (replace) the configuration file ``path``: ``best`` is kind -> "N,K" -> {max M: fields or None}.
    Atomically (a temporary file renamed over it): every GEMM launch on the GPU reads it, and the tuner rewrites
    it after each slice, so an interrupted write must not leave a truncated file."""
    configs = {
        kind: {shape: {str(m): None if f is None else list(f) for m, f in sorted(rows.items())}
               for shape, rows in shapes.items()}
        for kind, shapes in best.items()
    }  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"device_name": device_name, **provenance, "configs": configs}, indent=1) + "\n")
    os.replace(tmp, path)
    clear_caches()


def clear_caches() -> None:
    """Forget what was read from the configuration files (they are read once, at the first launch)."""
    _load.cache_clear()
    tuned_fields.cache_clear()


__all__ = [
    "CONFIG_DIR",
    "KINDS",
    "clear_caches",
    "config_path",
    "device_slug",
    "lookup",
    "tuned_fields",
    "write_configs",
]
