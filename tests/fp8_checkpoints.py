"""Pre-quantized FP8 checkpoints written by tests from a BF16 checkpoint, with torch's own float8 cast (independent
of layerwise.kernels): the Hugging Face block layout (``weight_scale_inv`` per 128 x 128 block) and the per-tensor
one (``weight_scale``), and the BF16 checkpoint of their dequantized weights as the reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

#: checkpoint names of the linears a decoder layer stores in FP8
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")


def is_fp8_linear(key: str) -> bool:
    return ".layers." in key and key.endswith(".weight") and key.rsplit(".", 2)[-2] in FP8_LINEARS


def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn [N, K], float32 [ceil(N/128), ceil(K/128)] multipliers): amax / 448 per block, torch's cast."""
    w = w.float()
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.nn.functional.pad(w.abs(), (0, kb * block - k, 0, nb * block - n))
    scale = padded.reshape(nb, block, kb, block).amax(dim=(1, 3)) / 448
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    per_element = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
    return (w / per_element).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    n, k = q.shape
    return q.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn, float32 [1] multiplier): amax / 448 over the tensor, torch's cast."""
    scale = (w.float().abs().max() / 448).reshape(1)
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def quantize_channels(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn, float32 [N, 1] multipliers): amax / 448 per row, torch's cast."""
    scale = w.float().abs().amax(dim=1, keepdim=True) / 448
    return (w.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def write_fp8_checkpoint(
    bf16_dir: Path,
    out: Path,
    granularity: str = "block",
    dequantized: Path | None = None,
    ignore: tuple[str, ...] = (),
):
    """Write ``out``: ``bf16_dir`` with every decoder linear weight in FP8 and its scale, and config.json's
    quantization_config: Hugging Face "fp8" ("block": [128, 128] blocks with ``weight_scale_inv``; "tensor": per
    tensor with ``weight_scale``) or compressed-tensors ("channel": ``weight_scale`` [N, 1]). Linears whose key
    contains an entry of ``ignore`` stay BF16 and are listed as unquantized. ``dequantized``: also write there the
    BF16 checkpoint of the FP8 weights x scales (float32 product rounded to BF16), everything else as in
    ``bf16_dir``. Returns {key: (fp8, scale)}."""
    quantizers = {"block": quantize_blocks, "tensor": quantize_tensor, "channel": quantize_channels}
    suffix = "_scale_inv" if granularity == "block" else "_scale"
    out.mkdir(parents=True, exist_ok=True)
    fp8, exact = {}, {}
    for path in sorted(bf16_dir.glob("*.safetensors")):
        tensors = load_file(path)
        quantized, plain = {}, {}
        for key, t in tensors.items():
            if is_fp8_linear(key) and not any(entry in key for entry in ignore):
                q, s = quantizers[granularity](t)
                quantized[key], quantized[key + suffix] = q, s
                w = dequantize_blocks(q, s) if granularity == "block" else q.float() * s
                plain[key] = w.to(torch.bfloat16)
                fp8[key] = (q, s)
            else:
                quantized[key] = plain[key] = t
        save_file(quantized, out / path.name, metadata={"format": "pt"})
        exact[path.name] = plain
    for extra in bf16_dir.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "config.json" and extra.is_file():
            shutil.copy(extra, out / extra.name)
    config = json.loads((bf16_dir / "config.json").read_text())
    if (bf16_dir / "model.safetensors.index.json").exists():
        index = json.loads((bf16_dir / "model.safetensors.index.json").read_text())
        for key in list(index["weight_map"]):
            if key in fp8:
                index["weight_map"][key + suffix] = index["weight_map"][key]
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    if granularity == "channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
        group = {"targets": ["Linear"], "weights": weights, "input_activations": {"dynamic": True}}
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": group}}
        qc["ignore"] = ["lm_head", *ignore]
    else:
        qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": list(ignore)}
        if granularity == "block":
            qc["weight_block_size"] = [128, 128]
    (out / "config.json").write_text(json.dumps(dict(config, quantization_config=qc)))
    if dequantized is not None:
        shutil.copytree(bf16_dir, dequantized, dirs_exist_ok=True)
        for name, plain in exact.items():
            save_file(plain, dequantized / name, metadata={"format": "pt"})
    return fp8
