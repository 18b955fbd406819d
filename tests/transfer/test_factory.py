"""WeightTransferEngineFactory: lazy registration, direct registration, errors."""

import subprocess
import sys
from types import SimpleNamespace

import pytest

from layerwise.transfer import WeightTransferEngineFactory
from tests.transfer.test_base import ListEngine


@pytest.fixture
def registry():
    """Registrations made by a test are removed after it."""
    before = dict(WeightTransferEngineFactory._registry)
    yield WeightTransferEngineFactory
    WeightTransferEngineFactory._registry.clear()
    WeightTransferEngineFactory._registry.update(before)


def test_builtin_backends_are_imported_only_by_create_engine():
    code = (
        "import sys, layerwise.transfer as t\n"
        "mods = lambda: sorted(m for m in ('layerwise.transfer.nccl', 'layerwise.transfer.ipc') if m in sys.modules)\n"
        "assert mods() == [], mods()\n"
        "t.WeightTransferEngineFactory.create_engine('ipc')\n"
        "assert mods() == ['layerwise.transfer.ipc'], mods()\n"
        "t.WeightTransferEngineFactory.create_engine({'backend': 'nccl'}, device='cpu')\n"
        "assert mods() == ['layerwise.transfer.ipc', 'layerwise.transfer.nccl'], mods()\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_lazy_registration_imports_the_module_on_create(registry):
    sys.modules.pop("tests.transfer.fake_backend", None)
    registry.register_engine("fake-lazy", "tests.transfer.fake_backend", "FakeEngine")
    assert "tests.transfer.fake_backend" not in sys.modules
    engine = registry.create_engine(SimpleNamespace(backend="fake-lazy"), device="cpu")
    assert "tests.transfer.fake_backend" in sys.modules
    assert type(engine).__name__ == "FakeEngine"


def test_direct_registration_and_errors(registry):
    registry.register_engine("fake-direct", ListEngine)
    assert isinstance(registry.create_engine("fake-direct"), ListEngine)
    with pytest.raises(ValueError, match="already registered"):
        registry.register_engine("fake-direct", ListEngine)
    with pytest.raises(ValueError, match="class_name is required"):
        registry.register_engine("fake-2", "tests.transfer.fake_backend")
    with pytest.raises(ValueError, match="WeightTransferEngine subclass"):
        registry.register_engine("fake-3", dict)
    registry.register_engine("fake-missing", "tests.transfer.fake_backend", "NoSuchEngine")
    with pytest.raises(ValueError, match="has no NoSuchEngine"):
        registry.create_engine("fake-missing")


def test_unknown_backend_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown weight transfer backend 'rdma'; registered: \[.*'ipc', 'nccl'"):
        WeightTransferEngineFactory.create_engine("rdma")
