"""Registry of weight-transfer backends, imported lazily: a backend's module is imported only when
``create_engine`` asks for it (so ``import layerwise.transfer`` never imports torch.distributed backends).

Design after vLLM's ``vllm/distributed/weight_transfer/factory.py``: built-in backends are registered in
one place, at the bottom of this file. The registry maps names to classes (or to how to import them),
never to engines or models.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, ClassVar

from layerwise.transfer.base import WeightTransferEngine


class WeightTransferEngineFactory:
    """Creates weight-transfer engines by backend name ("nccl", "ipc", or any registered one)."""

    _registry: ClassVar[dict[str, Callable[[], type[WeightTransferEngine]]]] = {}

    @classmethod
    def register_engine(
        cls, name: str, module_path_or_cls: str | type[WeightTransferEngine], class_name: str | None = None
    ) -> None:
        """Register a backend, lazily or directly.

        ``register_engine(name, "package.module", "ClassName")``: the module is imported by the first
        ``create_engine(name)``. ``register_engine(name, EngineClass)``: the class itself.

        Raises:
            ValueError: ``name`` is already registered, a module path without a class name, or a class
                that is not a WeightTransferEngine subclass.
        """
        if name in cls._registry:
            raise ValueError(f"weight transfer engine {name!r} is already registered")
        if isinstance(module_path_or_cls, str):
            if not class_name:
                raise ValueError(
                    f"register_engine({name!r}, {module_path_or_cls!r}): class_name is required with a module path"
                )
            module_path = module_path_or_cls

            def load() -> type[WeightTransferEngine]:
                engine_cls = getattr(importlib.import_module(module_path), class_name, None)
                if engine_cls is None:
                    raise ValueError(f"weight transfer engine {name!r}: {module_path} has no {class_name}")
                return engine_cls

            cls._registry[name] = load
            return
        if not (isinstance(module_path_or_cls, type) and issubclass(module_path_or_cls, WeightTransferEngine)):
            raise ValueError(
                f"register_engine({name!r}, ...): expected a module path or a WeightTransferEngine "
                f"subclass, got {module_path_or_cls!r}"
            )
        engine_cls = module_path_or_cls
        cls._registry[name] = lambda: engine_cls

    @classmethod
    def registered_engines(cls) -> list[str]:
        """Names of the registered backends, sorted."""
        return sorted(cls._registry)

    @classmethod
    def get_engine_class(cls, name: str) -> type[WeightTransferEngine]:
        """The class registered as ``name`` (importing its module if lazy).

        Raises:
            ValueError: ``name`` is not registered; lists the registered names.
        """
        load = cls._registry.get(name)
        if load is None:
            raise ValueError(f"unknown weight transfer backend {name!r}; registered: {cls.registered_engines()}")
        return load()

    @classmethod
    def create_engine(cls, name_or_config: Any, **kwargs) -> WeightTransferEngine:
        """A new, not yet initialized engine.

        Args:
            name_or_config: a backend name, a dict with a "backend" key, or an object with a ``backend``
                attribute (as vLLM's WeightTransferConfig).
            kwargs: passed to the engine's constructor, e.g. ``device="cuda:0"`` (both built-ins) and
                ``worker_rank=0`` (nccl).
        Raises:
            ValueError: an unknown backend (the message lists the registered ones).
        """
        if isinstance(name_or_config, str):
            name = name_or_config
        elif isinstance(name_or_config, dict):
            name = name_or_config.get("backend")
        else:
            name = getattr(name_or_config, "backend", None)
        return cls.get_engine_class(name)(**kwargs)


# Built-in backends, registered lazily in this one place.
WeightTransferEngineFactory.register_engine("nccl", "layerwise.transfer.nccl", "NCCLWeightTransferEngine")
WeightTransferEngineFactory.register_engine("ipc", "layerwise.transfer.ipc", "IPCWeightTransferEngine")
