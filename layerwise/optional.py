"""Optional dependencies (the package extras): import them, or say exactly what to install."""

from __future__ import annotations

import importlib
import shlex
from importlib import metadata

from layerwise.errors import MissingDependencyError


def install_hint(extra: str) -> str:
    """The pip command that installs extra ``extra`` ("torchao", "bench", "test"), read from the
    installed package metadata so it always matches pyproject.toml."""
    try:
        requirements = metadata.requires("layerwise") or []
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        requirements = []
    wanted = [
        r.split(";")[0].strip()
        for r in requirements
        if r.replace(" ", "").endswith((f"extra=='{extra}'", f'extra=="{extra}"'))
    ]
    direct = f"pip install {' '.join(shlex.quote(r) for r in wanted)}; " if wanted else ""
    return f"{direct}from a source checkout: pip install -e '.[{extra}]'"


def import_optional(module: str, extra: str, purpose: str):
    """``importlib.import_module(module)``, or a clear error.

    Args:
        module: module to import, e.g. "torchao.quantization".
        extra: the extra that provides it, e.g. "torchao".
        purpose: what needs it, e.g. "quantization='torchao:...'".
    Raises:
        MissingDependencyError: the import failed; the message names the package and the pip line.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        package = module.split(".")[0]
        raise MissingDependencyError(
            f"{purpose} needs {package}, which is not installed. Install it: {install_hint(extra)}"
        ) from e
