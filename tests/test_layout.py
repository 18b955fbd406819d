"""The package layout: one import namespace, and imports that flow layerwise -> quant -> kernels.

kernels/ and quant/ are folders at the repository's top level, installed as layerwise.kernels and
layerwise.quant; the leaf modules layerwise.errors and layerwise.optional may be imported by all.
"""

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
LEAVES = {"layerwise.errors", "layerwise.optional"}
ALLOWED = {  # folder -> project packages its modules may import
    "kernels": {"layerwise.kernels"},
    "quant": {"layerwise.quant", "layerwise.kernels"},
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            if node.module == "layerwise":  # from layerwise import api: the module it names
                names += [f"layerwise.{a.name}" for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}: a relative import (the layout rules read absolute ones)")
    return names


@pytest.mark.parametrize("folder", ["kernels", "quant", "layerwise", "benchmarks"])
def test_no_top_level_kernels_quant_or_benchmarks_imports(folder):
    for path in (ROOT / folder).rglob("*.py"):
        for name in _imports(path):
            assert name.split(".")[0] not in ("kernels", "quant", "benchmarks"), f"{path}: import {name}"


@pytest.mark.parametrize("folder", list(ALLOWED))
def test_imports_flow_layerwise_to_quant_to_kernels(folder):
    for path in (ROOT / folder).rglob("*.py"):
        for name in _imports(path):
            if name == "layerwise" or name.startswith("layerwise."):
                ok = name in LEAVES or any(name == p or name.startswith(p + ".") for p in ALLOWED[folder])
                assert ok, f"{path.relative_to(ROOT)} imports {name}"


@pytest.mark.parametrize("folder", ["reload", "transfer", "layers", "models"])
def test_the_machinery_below_the_public_api_never_imports_it(folder):
    """layerwise.api is the facade over the session, routing and transfer machinery: they must not reach back up
    through it (STYLE rule 4: hidden coupling)."""
    for path in (ROOT / "layerwise" / folder).rglob("*.py"):
        for name in _imports(path):
            assert name != "layerwise.api", f"{path.relative_to(ROOT)} imports {name}"


def test_the_wheel_installs_only_the_layerwise_namespace():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert all(p == "layerwise" or p.startswith("layerwise.") for p in config["packages"])
    for package, folder in config["package-dir"].items():
        assert (ROOT / folder / "__init__.py").is_file() and package == f"layerwise.{folder}"
    on_disk = {
        p.parent.relative_to(ROOT).as_posix().replace("/", ".") for p in (ROOT / "layerwise").rglob("__init__.py")
    }
    assert on_disk <= set(config["packages"]), "a layerwise subpackage is missing from pyproject's packages"
