"""Peak device memory of MoE loads and reloads: one expert at a time, measured by the independent tracker."""

import gc

import pytest
import torch

import layerwise
from layerwise.checkpoint import Checkpoint
from layerwise.kernels import cpu_native, reference
from layerwise.memory import DeviceMemoryTracker, tensor_bytes
from layerwise.reload import staging_bytes
from tests.hf_checkpoints import write_hf_checkpoint

H, INTER, E = 64, 512, 8  # experts outweigh every dense module here, so the expert units set the peak
EXPERT_BF16 = 3 * INTER * H * 2  # one expert's gate + up + down in BF16: 196608 bytes
W13_UNIT = 2 * INTER * H * 2  # one expert's fused gate + up in BF16: 131072 bytes
SCHEMES = [None, "fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]
# what the torch reference adds where the native CPU kernels are not built: its float32 work buffer (<= 1 MiB)
WORK = 0 if cpu_native.available() else 4 * reference.CHUNK_NUMEL


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-memory")
    kw = dict(num_layers=2, hidden=H, intermediate=48, moe_intermediate_size=INTER, max_shard_size="256KB")
    return (
        write_hf_checkpoint(root / "a", "Qwen3MoeForCausalLM", seed=0, **kw),
        write_hf_checkpoint(root / "b", "Qwen3MoeForCausalLM", seed=1, **kw),
    )


@pytest.fixture
def no_gc():
    """Frees happen by reference counting only, at the moment the code drops a tensor."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.mark.parametrize("quantization", SCHEMES)
def test_load_peak_is_model_plus_at_most_one_expert(pair, quantization, no_gc):
    a, _ = pair
    model, report = layerwise.load_model_with_report(a, quantization=quantization)
    assert report.model_bytes == tensor_bytes(model, torch.device("cpu"))
    # measured (bytes): none 131083 (one BF16 unit, staged); FP8 experts and dense weights are quantized from the
    # memory-mapped checkpoint tensors: per-tensor 11, per-channel 4032 (the layer's experts quantized together:
    # the float32 scales of both projections, while the modules after them are not allocated yet), per-block 11.
    # Before pieces: 133828 to 141760 for every scheme.
    measured = {None: 131083, "fp8-per-tensor": 11, "fp8-per-channel": 4032, "fp8-per-block": 11}[quantization]
    assert report.peak_bytes - report.model_bytes <= measured + 64 + (WORK if quantization else 0)
    # the whole MoE layer in BF16 (what a module-at-a-time session would materialize) is 8x that
    assert E * EXPERT_BF16 > 7 * (report.peak_bytes - report.model_bytes)
    assert report.largest_unit_bytes == W13_UNIT
    assert report.unit_bytes_by_layer["layers.1"] == W13_UNIT
    assert report.unit_bytes_by_layer["layers.0"] == (H + 2 * 32) * H * 2  # the dense layer's largest: qkv_proj


@pytest.mark.parametrize("quantization", SCHEMES)
def test_expert_reload_transient_is_at_most_one_unit(pair, quantization, no_gc):
    a, b = pair
    model = layerwise.load_model(a, quantization=quantization)
    stream = [(k, t) for k, t in Checkpoint(b) if ".mlp.experts." in k]
    with DeviceMemoryTracker("cpu") as tracker:  # counts only what the reload allocates
        report = layerwise.reload_weights(model, stream)
    assert report.updated_modules == ["model.layers.1.mlp.experts"]
    if quantization is None:  # each unit staged in BF16 and copied in: the buffer is kept for the next reload
        assert tracker.final_bytes == staging_bytes(model) == W13_UNIT
        assert tracker.peak_bytes <= W13_UNIT + 11 + 64  # measured: the unit + 11 bytes
        return
    # FP8: each expert quantized from the stream's tensors straight into the live slices: no staging buffer;
    # measured (bytes): per-tensor 21, per-channel 19460 (the [2I, 1] amaxes and scales), per-block 156
    assert tracker.final_bytes == staging_bytes(model) == 0
    measured = {"fp8-per-tensor": 21, "fp8-per-channel": 19460, "fp8-per-block": 156}[quantization]
    assert tracker.peak_bytes <= measured + 64 + WORK


def test_atomic_expert_reload_stages_one_fp8_layer(pair, no_gc):
    a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    experts = model.model.layers[1].mlp.experts
    layer_fp8 = sum(t.numel() * t.element_size() for t in experts.parameters())
    stream = [(k, t) for k, t in Checkpoint(b) if ".layers.1.mlp.experts." in k]
    with DeviceMemoryTracker("cpu") as tracker:
        layerwise.reload_weights(model, stream, atomic=True)
    # the staged copy of the layer's kernel tensors (committed at finalize), and nothing else: each expert is
    # quantized from the stream's tensors into that copy (measured: the copy + 21 bytes; no staging buffer)
    assert tracker.final_bytes == staging_bytes(model) == 0
    assert layer_fp8 <= tracker.peak_bytes <= layer_fp8 + 21 + 64 + WORK
