"""The CPU memory tracker (layerwise.memory) stays off torch's compiler stack: ``layerwise load --report``
tracks every load with it, and importing torch._dynamo on its first dispatch cost seconds per process."""

import subprocess
import sys

CODE = """
import sys, torch
from layerwise.memory import DeviceMemoryTracker
with DeviceMemoryTracker("cpu") as tracker:
    x = torch.ones(1000) + 1
assert tracker.peak_bytes == 8000, tracker.peak_bytes  # ones(1000) and the sum, float32
print(sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules))
"""


def test_tracking_a_cpu_load_imports_no_compiler_module():
    proc = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
