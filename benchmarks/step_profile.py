"""Where a decode step's time goes: device time per kernel category, from torch.profiler.

The decode benchmark's step is one CUDA graph replay, which hides the kernels behind it; the profile
runs the same forward eagerly (the kernels and their device times are the same; the launch gaps the
graph removes are not counted, as only device time is summed). On CPU the categories sum the operators'
own CPU time instead.

Categories (first match of the kernel or operator name, case-insensitive):

* ``attention``: SDPA's kernels;
* ``gemm``: cuBLAS / cuBLASLt / CUTLASS kernels (gemm and gemv) (BF16 ``F.linear``, ``torch._scaled_mm``), the
  Triton FP8 GEMMs with their split-K reduction, and on CPU the native FP8 W8A16 GEMM (``layerwise::linear_fp8``);
* ``act_quant``: the fused activation quantization (``kernels.fp8_act``);
* ``other``: everything else (norms, rotary, residual adds, KV cache writes, casts, copies).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

GEMM_NAMES = (
    r"gemm|gemv|cutlass|xmma|nvjet|cublas|scaled_mm|split_k_reduce|aten::(linear|matmul|addmm|mm|bmm)\b"
    r"|layerwise::linear_fp8"  # the native CPU W8A16 GEMM (kernels.cpu_native.LINEAR_FP8_PROFILE_NAME)
)
CATEGORIES = (  # attention first: SDPA's memory-efficient kernel is a CUTLASS one (fmha_cutlassF...)
    ("attention", re.compile(r"flash|fmha|attention|attn|softmax", re.I)),
    ("gemm", re.compile(GEMM_NAMES, re.I)),
    ("act_quant", re.compile(r"_act_", re.I)),
)
TOP_KERNELS = 12


def category(name: str) -> str:
    """The category of kernel or operator ``name`` (see the module docstring)."""
    return next((label for label, pattern in CATEGORIES if pattern.search(name)), "other")


def profile_step(step: Callable[[], object], device: torch.device, steps: int = 3) -> dict:
    """Profile ``steps`` calls of ``step`` (after one untimed call) and break their time down per step.

    Returns:
        {"ms_per_step": {category: milliseconds}, "total_ms": sum, "kernels_per_step": count,
        "top": [{"name", "category", "ms", "calls"} per step, the TOP_KERNELS largest]}; device time on
        CUDA, the operators' own CPU time on CPU (``source`` says which).
    """
    from torch.profiler import ProfilerActivity, profile

    step()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    rows = []
    for event in prof.key_averages():
        if cuda:
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = getattr(event, "self_device_time_total", None)
            us = event.self_cuda_time_total if us is None else us
        else:
            us = event.self_cpu_time_total
        if us > 0:
            rows.append((us / 1e3 / steps, event.count / steps, event.key))
    rows.sort(reverse=True)
    ms = {label: 0.0 for label in ("gemm", "act_quant", "attention", "other")}
    for time_ms, _, name in rows:
        ms[category(name)] += time_ms
    return {
        "source": "CUDA kernels, device time" if cuda else "CPU operators, self time",
        "ms_per_step": ms,
        "total_ms": sum(ms.values()),
        "kernels_per_step": sum(calls for _, calls, _ in rows),
        "top": [
            {"name": name[:100], "category": category(name), "ms": time_ms, "calls": calls}
            for time_ms, calls, name in rows[:TOP_KERNELS]
        ],
    }


__all__ = ["CATEGORIES", "category", "profile_step"]
