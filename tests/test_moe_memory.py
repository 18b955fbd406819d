"""Peak device memory of MoE loads and reloads: one expert at a time, measured by the independent tracker."""

import gc

import pytest
import torch

import layerwise
from layerwise.checkpoint import Checkpoint
from layerwise.kernels import cpu_native
from layerwise.memory import DeviceMemoryTracker, tensor_bytes
from layerwise.reload import staging_bytes
from tests.hf_checkpoints import write_hf_checkpoint

H, INTER, E = 64, 512, 8  # experts outweigh every dense module here, so the expert units set the peak
EXPERT_BF16 = 3 * INTER * H * 2  # one expert's gate + up + down in BF16: 196608 bytes
W13_UNIT = 2 * INTER * H * 2  # one expert's fused gate + up in BF16: 131072 bytes
SCHEMES = [None, "fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]


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
    # measured: none 88784, per-tensor 133828, per-channel 141760, per-block 133884 (bytes)
    assert report.peak_bytes - report.model_bytes <= EXPERT_BF16
    # the whole MoE layer in BF16 (what a module-at-a-time session would materialize) is 8x that
    assert E * EXPERT_BF16 > 7 * (report.peak_bytes - report.model_bytes)
    assert report.largest_unit_bytes == W13_UNIT
    assert report.unit_bytes_by_layer["layers.1"] == W13_UNIT
    assert report.unit_bytes_by_layer["layers.0"] == (H + 2 * 32) * H * 2  # the dense layer's largest: qkv_proj


@pytest.mark.parametrize("quantization", SCHEMES)
def test_expert_reload_transient_is_one_unit_plus_a_tile(pair, quantization, no_gc):
    a, b = pair
    model = layerwise.load_model(a, quantization=quantization)
    stream = [(k, t) for k, t in Checkpoint(b) if ".mlp.experts." in k]
    with DeviceMemoryTracker("cpu") as tracker:  # counts only what the reload allocates
        report = layerwise.reload_weights(model, stream)
    assert report.updated_modules == ["model.layers.1.mlp.experts"]
    assert tracker.final_bytes == staging_bytes(model) == W13_UNIT  # the staging buffer, kept for the next reload
    assert W13_UNIT <= tracker.peak_bytes <= EXPERT_BF16
    # at the measured level: the BF16 unit and the scale/amax tensors (per-channel: 2 x [2I, 1] float32); measured
    # over the unit with the native CPU kernels: none +11, per-tensor +4, per-channel +4096, per-block +32 bytes.
    # The torch reference adds one tile's float32 work buffer (4 bytes per element of 1/8 of the unit).
    tile_numel = 0 if cpu_native.available() else 2 * INTER * H // 8
    transient = 0 if quantization is None else 4 * tile_numel + 2 * 2 * INTER * 4
    assert tracker.peak_bytes - W13_UNIT <= transient + 128


def test_atomic_expert_reload_stages_one_fp8_layer(pair, no_gc):
    a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    experts = model.model.layers[1].mlp.experts
    layer_fp8 = sum(t.numel() * t.element_size() for t in experts.parameters())
    stream = [(k, t) for k, t in Checkpoint(b) if ".layers.1.mlp.experts." in k]
    with DeviceMemoryTracker("cpu") as tracker:
        layerwise.reload_weights(model, stream, atomic=True)
    assert tracker.final_bytes == staging_bytes(model) == W13_UNIT  # kept for the next reload
    # the staged copy of the layer's kernel tensors, plus one BF16 unit and a tile at a time
    assert layer_fp8 + W13_UNIT <= tracker.peak_bytes <= layer_fp8 + EXPERT_BF16
