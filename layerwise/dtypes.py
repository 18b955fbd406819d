"""The dtype names layerwise accepts, in one table: config.json's ``torch_dtype`` / ``dtype`` values
and the ``dtype=`` / ``--dtype`` option (case-insensitive, with the short aliases)."""

from __future__ import annotations

import torch

DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def parse_dtype(dtype) -> torch.dtype | None:
    """torch.dtype from a dtype or a name ("bfloat16", "BF16", "fp32", "torch.float16"); None stays None.

    Raises:
        ValueError: an unknown name (the message lists the accepted ones).
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower().removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]
