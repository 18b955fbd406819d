"""Reload on CUDA from a pinned in-memory stream: no host synchronization while it streams (Limitations 12).

Skipped without a GPU. What CPU CI proves of the same session code: tests/test_reload_deferred.py (deferral
forced on the CPU: no host read while streaming, equal to a fresh load, NaN reported at finalize).
"""

import pytest
import torch

import layerwise
import layerwise.api as api
from layerwise.checkpoint import Checkpoint
from layerwise.reload.session import layerwise_session
from layerwise.routing import stream_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCHEMES = [None, "fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]


@pytest.fixture
def pair(qwen3_pair):
    return qwen3_pair


def _pinned(path, nan_key=None):
    out = []
    for key, t in Checkpoint(path):
        t = t.clone().pin_memory()
        if key == nan_key:
            t.view(-1)[5] = float("nan")
        out.append((key, t))
    return out


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8).cpu()


def _stream_without_sync(model, stream):
    """Stream ``stream`` into ``model`` in a session that defers its checks; any host synchronization raises."""
    with layerwise_session(model, defer_checks=True):
        torch.cuda.set_sync_debug_mode("error")
        try:
            stream_weights(model, stream)
        finally:
            torch.cuda.set_sync_debug_mode(0)


def _assert_equals_a_fresh_load(model, path, scheme):
    fresh = layerwise.load_model(path, quantization=scheme, device="cuda").state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_bytes(t), _bytes(fresh[name])), name


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s or "bf16")
def test_streaming_a_pinned_list_never_synchronizes(pair, scheme):
    a, b = pair
    model = layerwise.load_model(a, quantization=scheme, device="cuda")
    stream = _pinned(b)
    assert api._defers_checks(model, stream)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    _stream_without_sync(model, stream)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    _assert_equals_a_fresh_load(model, b, scheme)


@pytest.mark.parametrize("scheme", [None, "fp8-per-tensor"], ids=lambda s: s or "bf16")
def test_nan_in_a_pinned_list_is_raised_at_the_end_naming_its_key(pair, scheme):
    a, b = pair
    key = "model.layers.1.mlp.up_proj.weight"
    model = layerwise.load_model(a, quantization=scheme, device="cuda")
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _pinned(b, key))
    assert isinstance(e.value, layerwise.NonFiniteWeightError) and e.value.key == key
    assert "found at the end of the stream" in str(e.value)
    assert "model.layers.2.mlp.down_proj" in e.value.updated_modules  # written after the NaN module


def test_an_iterator_still_stops_at_the_nan(pair):
    a, b = pair
    key = "model.layers.1.mlp.up_proj.weight"
    model = layerwise.load_model(a, quantization="fp8-per-tensor", device="cuda")
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, iter(_pinned(b, key)))
    assert e.value.key == key and "found at the end of the stream" not in str(e.value)
    assert "model.layers.2.mlp.down_proj" not in e.value.updated_modules


@pytest.mark.parametrize("source", ["pinned", "cuda"])
@pytest.mark.parametrize("scheme", [None, "fp8-per-tensor", "fp8-per-block"], ids=lambda s: s or "bf16")
def test_streaming_a_moe_list_never_synchronizes(tmp_path_factory, scheme, source):
    """MoE experts (unit-wise modules) defer their checks too: each expert's replay, scale and quantize stay on the
    device, and an expert's first projection of a device stream is held as the caller's tensor, not copied to the
    host (tests/test_reload_deferred.py forces the deferral on the CPU)."""
    from tests.moe_helpers import checkpoint_pair

    _, a, b = checkpoint_pair(tmp_path_factory, "Qwen3MoeForCausalLM", "cuda-moe")
    model = layerwise.load_model(a, quantization=scheme, device="cuda")
    stream = _pinned(b) if source == "pinned" else [(k, t.to("cuda")) for k, t in Checkpoint(b)]
    _stream_without_sync(model, stream)
    _assert_equals_a_fresh_load(model, b, scheme)
