"""The load path pays no import it does not run: a fresh process loads and reloads without importing
torch._dynamo (whose import cost 3-6 s per process, the cold-load overhead measured on an H100), and
`import layerwise` and a CPU load import neither Triton (about 0.75 s) nor the optional libraries."""

import subprocess
import sys

import pytest

from tests.hf_checkpoints import write_hf_checkpoint

SCRIPT = """
import sys
import layerwise
model = layerwise.load_model(sys.argv[1], quantization=sys.argv[2], device="cpu")
layerwise.reload_weights(model, sys.argv[1])
heavy = sorted(m for m in ("torch._dynamo", "torch._inductor", "sympy") if m in sys.modules)
print("HEAVY=" + ",".join(heavy))
print("UNUSED=" + ",".join(sorted(m for m in UNUSED_ON_CPU if m in sys.modules)))
"""
# imported only where they run: Triton on a GPU (or kernel="triton"), the others by an optional scheme or benchmark
UNUSED_ON_CPU = ("triton", "transformers", "torchao", "matplotlib")
SCRIPT = f"UNUSED_ON_CPU = {UNUSED_ON_CPU!r}\n" + SCRIPT


@pytest.mark.parametrize("scheme", ["none", "fp8"])
def test_load_and_reload_import_no_compiler_stack(tmp_path, scheme):
    path = write_hf_checkpoint(tmp_path, "Qwen3ForCausalLM")
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path), scheme], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert "HEAVY=\n" in out, out
    assert "UNUSED=\n" in out, out


def test_import_layerwise_imports_no_triton_nor_optional_library():
    script = f"import sys, layerwise; print(sorted(m for m in {UNUSED_ON_CPU!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]", out


def test_triton_ops_on_parameters_stay_eager():
    # the forward passes layer.weight (an nn.Parameter): the eager path, not the custom op, whose first
    # call imports torch._dynamo
    script = """
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch
from torch import nn
from layerwise.kernels import fp8_dequantize, fp8_quantize_weight
q, s = fp8_quantize_weight(torch.randn(32, 64).bfloat16(), "channel", "torch")
fp8_dequantize(nn.Parameter(q, requires_grad=False), nn.Parameter(s, requires_grad=False), torch.bfloat16, "triton")
print("DYNAMO=" + str("torch._dynamo" in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "DYNAMO=False" in out, out
