"""Helpers shared by the mixture-of-experts tests: an independent FP8 reference, stream loads."""

from __future__ import annotations

import torch

from layerwise.checkpoint import Checkpoint
from layerwise.config import ModelConfig
from layerwise.quant.config import QuantConfig
from layerwise.registry import get_model_class
from layerwise.reload.session import layerwise_session, record_metadata_for_reloading
from layerwise.routing import stream_weights

#: checkpoint name of each fused block and of its gate/up/down projections, per architecture
MOE_NAMES = {
    "Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2"),
}


def checkpoint_pair(tmp_path_factory, arch: str, tag: str):
    """(arch, A, B): two 3-layer checkpoints of MoE architecture ``arch`` written by transformers with
    different weights (seeds 0 and 1), under a temporary folder named after ``tag``."""
    from tests.hf_checkpoints import write_hf_checkpoint

    root = tmp_path_factory.mktemp(f"{tag}-{arch}")
    return (
        arch,
        write_hf_checkpoint(root / "a", arch, seed=0, num_layers=3),
        write_hf_checkpoint(root / "b", arch, seed=1, num_layers=3),
    )


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def torch_fp8_reference(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own float8 cast of a [N, K] weight, with scales computed here, independently of layerwise:
    scale = amax / 448 per tensor / row / 128 x 128 block; q = (w.float() / scale).clamp(-448, 448).to(e4m3fn).
    Returns (q [N, K], scale [] / [N, 1] / [ceil(N/128), ceil(K/128)])."""
    w = w.float()
    n, k = w.shape
    if granularity == "tensor":
        scale = w.abs().max() / 448.0
        return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    if granularity == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / 448.0
        return (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale
    rb, cb = -(-n // 128), -(-k // 128)
    scale = torch.empty(rb, cb)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for i in range(rb):
        for j in range(cb):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = block.abs().max() / 448.0
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def expert_weights(path, arch: str, layer: int, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H] = cat(gate, up), w2 [H, I]) of one expert, read from the checkpoint files."""
    block, gate, up, down = MOE_NAMES[arch]
    ckpt = Checkpoint(path)
    prefix = f"model.layers.{layer}.{block}.experts.{expert}"
    w13 = torch.cat([ckpt.get_tensor(f"{prefix}.{gate}.weight"), ckpt.get_tensor(f"{prefix}.{up}.weight")])
    w2 = ckpt.get_tensor(f"{prefix}.{down}.weight")
    return w13, w2


def load_from_stream(path, stream, quantization=None, device="cpu"):
    """A first load of ``path``'s architecture from an arbitrary (key, tensor) stream, through the same
    session and routing as ``layerwise.load_model``."""
    ckpt = Checkpoint(path)
    config = ModelConfig.from_dict(ckpt.config)
    _, model_cls = get_model_class(config)
    quant_config = QuantConfig(quantization)
    with torch.device("meta"):
        model = model_cls(config, quant_config, torch.bfloat16, torch.device(device))
    record_metadata_for_reloading(model)
    with layerwise_session(model, device=torch.device(device)):
        stream_weights(model, stream)
    return model.eval()


def moe_block(model, layer: int):
    """The SparseMoeBlock of decoder layer ``layer`` (``mlp`` or ``block_sparse_moe``)."""
    decoder = model.model.layers[layer]
    return getattr(decoder, "block_sparse_moe", None) or decoder.mlp
