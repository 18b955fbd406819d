"""Optional dependencies (the package extras): import them, or say exactly what to install."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from collections.abc import Sequence
from importlib import metadata

from layerwise.errors import MissingDependencyError


def _project_name(requirement: str) -> str:
    """ "torchao>=0.10; extra == 'bench'" -> "torchao"."""
    return re.split(r"[\s<>=!~;\[(]", requirement.strip(), maxsplit=1)[0].lower()


def install_hint(extra: str, packages: Sequence[str] | None = None) -> str:
    """The pip command that installs ``packages`` (default: every package of extra ``extra``: "torchao", "bench",
    "test") with the version bounds the extra gives them, read from the installed package metadata so it always
    matches pyproject.toml; then the command that installs the whole extra from a source checkout."""
    try:
        requirements = metadata.requires("layerwise") or []
    except metadata.PackageNotFoundError:  # running from a source tree that was never installed
        requirements = []
    of_extra = {
        _project_name(r): r.split(";")[0].strip()
        for r in requirements
        if r.replace(" ", "").endswith((f"extra=='{extra}'", f'extra=="{extra}"'))
    }
    names = list(of_extra) if packages is None else [p.lower() for p in packages]
    wanted = [of_extra.get(name, name) for name in names]
    direct = f"pip install {' '.join(shlex.quote(r) for r in wanted)}; " if wanted else ""
    return f"{direct}from a source checkout, the whole extra: pip install -e '.[{extra}]'"


def require(modules: Sequence[str], extra: str, purpose: str) -> None:
    """Import each of ``modules`` now, before any work starts.

    Every package is looked up first (``importlib.util.find_spec``: nothing is imported, so nothing logs), and
    those not installed are named together; then the modules are imported in order, and the first that fails
    (installed, but broken or hidden) is named.

    Args:
        modules: modules to import, e.g. ["transformers", "torchao.quantization"].
        extra: the extra that provides them, e.g. "bench".
        purpose: what needs them, e.g. "layerwise bench".
    Raises:
        MissingDependencyError: some are not installed or do not import; the message names only those packages
            (their top-level names) and the pip line that installs them.
    """
    packages = list(dict.fromkeys(module.split(".")[0] for module in modules))
    missing = [package for package in packages if importlib.util.find_spec(package) is None]
    if missing:
        raise _not_installed(missing, extra, purpose)
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            package = module.split(".")[0]
            raise MissingDependencyError(
                f"{purpose} needs {module}, which is installed but fails to import ({type(e).__name__}: {e}); "
                f"reinstall it: {install_hint(extra, [package])}"
            ) from e


def _not_installed(packages: list[str], extra: str, purpose: str) -> MissingDependencyError:
    listed = packages[0] if len(packages) == 1 else f"{', '.join(packages[:-1])} and {packages[-1]}"
    verb, pronoun = ("is", "it") if len(packages) == 1 else ("are", "them")
    return MissingDependencyError(
        f"{purpose} needs {listed}, which {verb} not installed. Install {pronoun}: {install_hint(extra, packages)}"
    )


def import_optional(module: str, extra: str, purpose: str):
    """``importlib.import_module(module)``, or a clear error.

    Args:
        module: module to import, e.g. "torchao.quantization".
        extra: the extra that provides it, e.g. "torchao".
        purpose: what needs it, e.g. "quantization='torchao:...'".
    Raises:
        MissingDependencyError: the import failed; the message names the package and the pip line.
    """
    require([module], extra, purpose)
    return importlib.import_module(module)
