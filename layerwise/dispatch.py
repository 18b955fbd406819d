"""The base of the project's TorchDispatchModes (the memory tracker, the loader-write recorder)."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class EagerDispatchMode(TorchDispatchMode):
    """A TorchDispatchMode that never involves torch._dynamo.

    torch wraps a mode's ``__torch_dispatch__`` in ``torch._disable_dynamo`` unless ``_should_skip_dynamo``
    says no; that wrapper's first call imports torch._dynamo, sympy and Inductor (seconds in a fresh process,
    a cold-load cost even for BF16 loads: ``benchmarks/first_load_profile.py``). Nothing run inside these
    modes is compiled.
    """

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False
