"""Where and with what a benchmark ran: the fields every results JSON carries.

``describe_machine(device)`` goes under the ``machine`` key (hardware and versions), ``provenance(device,
size)`` at the top level: ``device_name`` (the GPU's name, or the CPU model), ``versions``, ``commit``
(short git sha of the repository the benchmarks were imported from; "unknown" outside a git checkout,
or ``$LAYERWISE_COMMIT`` when set, for copies of a working tree), ``date`` (UTC, ISO 8601) and the
checkpoint's ``size`` and ``shape``.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

from layerwise.kernels import cpu_native

_PACKAGES = ("torch", "triton", "transformers", "torchao", "safetensors")


def versions() -> dict[str, str | None]:
    """Installed versions of torch, triton, transformers, torchao, safetensors (None: not installed)."""
    out = {}
    for name in _PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__  # the imported one (a CUDA build names its CUDA version)
    out["cuda"] = torch.version.cuda
    return out


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else platform.processor(), else "unknown cpu")."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown cpu"


def device_name(device: str | torch.device) -> str:
    """``torch.cuda.get_device_name`` for a CUDA device, else the CPU model."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return cpu_model()


@functools.cache
def git_commit() -> str:
    """Short sha of HEAD of the checkout holding this file ("+dirty" when tracked files changed);
    ``$LAYERWISE_COMMIT`` when set; "unknown" when neither git nor a checkout is there."""
    if os.environ.get("LAYERWISE_COMMIT"):
        return os.environ["LAYERWISE_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        )
        if sha.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second ("2026-11-23T03:05:00Z")."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def describe_machine(device: str) -> dict:
    """Platform, Python, torch, CPU count and threads, the device's name (and the GPU's on cuda)."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        # the native CPU quantize's path: a table lookup per scale needs AVX-512 VBMI, else the generic loop (several
        # times slower per element), so CPU load and reload figures are comparable only between equal paths
        "cpu_fp8_table": cpu_native.table_path(),
    }
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def provenance(device: str | torch.device, size: str | None = None, shape: dict | None = None) -> dict:
    """The top-level fields of a results JSON: device_name, versions, commit, date, size, shape."""
    return {
        "device_name": device_name(device),
        "versions": versions(),
        "commit": git_commit(),
        "date": utc_now(),
        "size": size,
        "shape": shape,
    }
