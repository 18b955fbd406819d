"""A reload that defers its finiteness checks (Limitations 12): no host read while it streams, one at finalize.

On CUDA this is what keeps the GPU busy while Python routes the next module; the session logic is the same on
every device, so it is forced here on the CPU (``api._defers_checks``), with the native extension off so
that the CPU takes the torch code the CUDA path takes (a native call reads its answer without torch). A host
read is ``aten._local_scalar_dense`` (``bool(t)``, ``t.item()``), seen by a dispatch mode. The CUDA side, under
``torch.cuda.set_sync_debug_mode("error")``, is in tests/test_cuda.py.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import layerwise
import layerwise.api as api
from layerwise.api import model_digest
from layerwise.checkpoint import Checkpoint
from layerwise.kernels import cpu_native
from layerwise.quant.parameters import ModelWeightParameter, async_host_copies, default_weight_loader

SCHEMES = [None, "fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]
NAN_KEY = "model.layers.1.mlp.up_proj.weight"
NAN_MODULE = "model.layers.1.mlp.gate_up_proj"


@pytest.fixture
def pair(qwen3_pair):
    return qwen3_pair


@pytest.fixture
def deferred(monkeypatch):
    """Every reload of a list defers its checks, here on the CPU; torch code instead of the native extension."""
    monkeypatch.setattr(api, "_defers_checks", lambda model, stream: isinstance(stream, (list, tuple)))
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value on the host (``bool``, ``item``: ``aten._local_scalar_dense``) and records
    the ``non_blocking`` argument of every ``copy_``."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        if func is torch.ops.aten.copy_.default:
            self.copies.append(bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def _stream(path, nan_key=None):
    """The checkpoint as a list of (key, tensor), ``nan_key``'s tensor with one NaN."""
    out = []
    for key, t in Checkpoint(path):
        t = t.clone()
        if key == nan_key:
            t.view(-1)[5] = float("nan")
        out.append((key, t))
    return out


def _modules_with_parameters(model):
    return {prefix for prefix, m in model.named_modules() if m._parameters}


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s or "bf16")
def test_deferred_reload_equals_a_fresh_load_and_reads_the_host_once(pair, scheme, deferred):
    a, b = pair
    model = layerwise.load_model(a, quantization=scheme)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    stream = _stream(b)
    with HostReads() as reads:
        report = layerwise.reload_weights(model, stream)
    # one host read for the whole reload would be the flags at finalize; on the CPU that read (tolist) is not
    # even dispatched, so: none at all, where each module's check otherwise reads once (next test)
    assert reads.reads == 0
    assert set(report.updated_modules) == _modules_with_parameters(model)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    fresh = layerwise.load_model(b, quantization=scheme).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_bytes(t), _bytes(fresh[name])), name


def test_a_reload_that_checks_as_it_goes_reads_the_host_per_module(pair, monkeypatch):
    """The probe of the test above sees host reads: without deferral, each module's check reads one."""
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    a, b = pair
    model = layerwise.load_model(a, quantization="fp8-per-tensor")
    stream = _stream(b)
    with HostReads() as reads:
        report = layerwise.reload_weights(model, stream)
    assert reads.reads >= len(report.updated_modules)


@pytest.mark.parametrize("scheme", [None, "fp8-per-channel"], ids=lambda s: s or "bf16")
def test_nan_found_at_finalize_names_the_key_and_every_written_module(pair, scheme, deferred):
    a, b = pair
    model = layerwise.load_model(a, quantization=scheme)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _stream(b, NAN_KEY))
    assert isinstance(e.value.cause, layerwise.NonFiniteWeightError)
    assert e.value.key == NAN_KEY and NAN_MODULE in str(e.value)
    # every module of the stream was written, the one with the NaN and those after it included
    fresh = layerwise.load_model(b, quantization=scheme)
    assert "found at the end of the stream" in str(e.value)
    assert set(e.value.updated_modules) == _modules_with_parameters(model)
    weight = model.model.layers[1].mlp.gate_up_proj.weight
    assert (torch.isnan(weight) if scheme is None else ((_bytes(weight) & 0x7F) == 0x7F)).any()
    state, fresh_state = model.state_dict(), fresh.state_dict()
    for name in state:
        if not name.startswith(NAN_MODULE):
            assert torch.equal(_bytes(state[name]), _bytes(fresh_state[name])), name


def test_atomic_deferred_reload_with_a_nan_changes_nothing(pair, deferred):
    a, b = pair
    model = layerwise.load_model(a, quantization="fp8-per-block")
    before = model_digest(model)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _stream(b, NAN_KEY), atomic=True)
    assert e.value.updated_modules == [] and e.value.key == NAN_KEY
    assert model_digest(model) == before
    layerwise.reload_weights(model, _stream(b), atomic=True)  # the session was closed: the model reloads
    fresh = layerwise.load_model(b, quantization="fp8-per-block").state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_bytes(t), _bytes(fresh[name])), name


def test_only_a_sequence_on_cuda_without_tensor_parallelism_defers(pair):
    a, _ = pair
    model = layerwise.load_model(a)
    stream = _stream(a)
    assert not api._defers_checks(model, stream)  # on the CPU, no synchronization to save
    assert not api._defers_checks(model, iter(stream))


def test_load_shard_copies_without_waiting_only_inside_async_host_copies():
    source = torch.randn(4, 3)
    for target, inside, expected in [
        ("meta", True, True),  # a device tensor (meta stands in for CUDA): the copy may return early
        ("meta", False, False),
        ("cpu", True, False),  # never into host memory
    ]:
        param = ModelWeightParameter(torch.empty(4, 3, device=target), default_weight_loader)
        with HostReads() as probe:
            if inside:
                with async_host_copies():
                    param.load_shard(source)
            else:
                param.load_shard(source)
        assert probe.copies == [expected], (target, inside)
