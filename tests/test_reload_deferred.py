"""A reload that defers its finiteness checks (Limitations 12): no host read while it streams, one at finalize.

On CUDA this is what keeps the GPU busy while Python routes the next module; the session logic is the same on
every device, so it is forced here on the CPU (``api._defers_checks``), with the native extension off so
that the CPU takes the torch code the CUDA path takes (a native call reads its answer without torch). A host
read is ``aten._local_scalar_dense`` (``bool(t)``, ``t.item()``) or ``aten.equal``, seen by a dispatch mode. The
CUDA side, under ``torch.cuda.set_sync_debug_mode("error")``, is in tests/test_reload_cuda.py.
"""

import types

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

import layerwise
import layerwise.api as api
import layerwise.quant.parameters as parameters
from layerwise.api import model_digest
from layerwise.checkpoint import Checkpoint
from layerwise.kernels import cpu_native
from layerwise.quant.parameters import ModelWeightParameter, async_host_copies, default_weight_loader
from layerwise.reload.session import finalize_layerwise_reload, initialize_layerwise_reload
from layerwise.routing import stream_weights

TORCHAO = "torchao:Float8WeightOnlyConfig"
SCHEMES = [None, "fp8-per-tensor", "fp8-per-channel", "fp8-per-block", TORCHAO]
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
    """Counts reads of a tensor's value on the host (``bool``, ``item``: ``aten._local_scalar_dense``; ``equal``)
    and records the ``non_blocking`` argument of every ``copy_``."""

    def __init__(self):
        super().__init__()
        self.reads = 0
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default):
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


def _skip_without_torchao(scheme):
    if scheme == TORCHAO:
        pytest.importorskip("torchao")


def _modules_with_parameters(model):
    return {prefix for prefix, m in model.named_modules() if m._parameters}


def _bytes(t):
    """Every byte of ``t``: a torchao tensor's inner tensors one after the other."""
    if is_traceable_wrapper_subclass(t):
        return torch.cat([_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0]])
    return t.detach().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s or "bf16")
def test_deferred_reload_equals_a_fresh_load_and_reads_the_host_once(pair, scheme, deferred, monkeypatch):
    _skip_without_torchao(scheme)
    a, b = pair
    model = layerwise.load_model(a, quantization=scheme)  # torchao: checks each weight shape against its bytes
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    stream = _stream(b)
    load_shard, copies_may_wait = ModelWeightParameter.load_shard, []

    def recording(self, *args, **kwargs):  # whether the session let the replay's copies return early
        if self.device.type != "meta":  # not the meta run that records what a loader writes
            copies_may_wait.append(parameters._ASYNC_HOST_COPIES.get())
        return load_shard(self, *args, **kwargs)

    monkeypatch.setattr(ModelWeightParameter, "load_shard", recording)
    with HostReads() as reads:
        report = layerwise.reload_weights(model, stream)
    # one host read for the whole reload would be the flags at finalize; on the CPU that read (tolist) is not
    # even dispatched, so: none at all, where each module's check otherwise reads once (next test)
    assert reads.reads == 0
    assert copies_may_wait and all(copies_may_wait)
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
    assert isinstance(e.value, layerwise.NonFiniteWeightError)
    assert e.value.key == NAN_KEY and NAN_MODULE in str(e.value) and e.value.non_finite_modules == [NAN_MODULE]
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


def test_a_nan_written_before_another_error_is_still_reported(pair, deferred):
    """The stream fails on an unknown key after a NaN module was written (its check not yet read)."""
    a, b = pair
    model = layerwise.load_model(a, quantization="fp8-per-tensor")
    stream = _stream(b, NAN_KEY)
    stream.insert(len(stream) - 2, ("model.layers.9.mlp.up_proj.weight", stream[0][1]))
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, stream)
    assert isinstance(e.value.cause, layerwise.UnexpectedWeightError)
    assert e.value.non_finite_modules == [NAN_MODULE] and NAN_MODULE in e.value.updated_modules
    assert "written with NaN or Inf" in str(e.value)


def test_a_failed_finalize_closes_the_session(pair, deferred):
    """Finalize aborts before raising: calling it again cannot commit the staged NaN."""
    a, b = pair
    model = layerwise.load_model(a, quantization="fp8-per-channel")
    before = model_digest(model)
    initialize_layerwise_reload(model, atomic=True, defer_checks=True)
    stream_weights(model, _stream(b, NAN_KEY))
    with pytest.raises(layerwise.NonFiniteWeightError):
        finalize_layerwise_reload(model)
    with pytest.raises(RuntimeError, match="no layerwise load/reload in progress"):
        finalize_layerwise_reload(model)
    assert model_digest(model) == before


class _Model:
    def __init__(self, device, tp_group=None):
        self.tp_group, self.device = tp_group, torch.device(device)

    def parameters(self):
        yield types.SimpleNamespace(device=self.device)


def test_only_a_sequence_on_cuda_without_tensor_parallelism_defers():
    stream = [("w", torch.zeros(1))]
    assert api._defers_checks(_Model("cuda"), stream)
    assert api._defers_checks(_Model("cuda"), tuple(stream))
    assert not api._defers_checks(_Model("cuda"), iter(stream))  # an iterator may refill what it handed out
    assert not api._defers_checks(_Model("cuda", tp_group=object()), stream)  # amax reductions across ranks
    assert not api._defers_checks(_Model("cpu"), stream)  # no synchronization to save


def test_a_copy_returns_early_only_from_pinned_memory_in_its_own_dtype(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *args: True)  # no pinned memory without CUDA
    meta = torch.empty(2, device="meta")  # stands in for device memory
    assert parameters._may_return_early(torch.zeros(2), meta)
    assert not parameters._may_return_early(torch.zeros(2, dtype=torch.float64), meta)  # converted on the device
    assert not parameters._may_return_early(torch.zeros(2), torch.empty(2))  # into host memory
    monkeypatch.undo()
    assert not parameters._may_return_early(torch.zeros(2), meta)  # pageable: staged by CUDA anyway


def test_load_shard_copies_without_waiting_only_inside_async_host_copies(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *args: True)
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


@pytest.mark.parametrize("scheme", [None, "fp8-per-tensor"], ids=lambda s: s or "bf16")
def test_a_deferred_moe_reload_reads_the_host_once_and_reports_a_nan_expert(
    tmp_path_factory, scheme, deferred, monkeypatch
):
    """The experts' checks defer too, unquantized experts included (their copy checked each expert on the host)."""
    import layerwise.layers.fused_moe as fused_moe
    from tests.moe_helpers import checkpoint_pair

    _, a, b = checkpoint_pair(tmp_path_factory, "Qwen3MoeForCausalLM", "deferred-moe")
    model = layerwise.load_model(a, quantization=scheme)
    stream = _stream(b)
    copy_loaded, copies_may_wait = fused_moe.copy_loaded, []

    def recording(source, target):  # whether an expert's replay may copy without waiting (as load_shard's)
        if target.device.type != "meta":
            copies_may_wait.append(parameters._ASYNC_HOST_COPIES.get())
        return copy_loaded(source, target)

    monkeypatch.setattr(fused_moe, "copy_loaded", recording)
    with HostReads() as reads:
        layerwise.reload_weights(model, stream)
    assert reads.reads == 0
    if scheme is None:  # bf16 experts are replayed into a staging weight (fp8 ones quantized from the loads)
        assert copies_may_wait and all(copies_may_wait)
    fresh = layerwise.load_model(b, quantization=scheme).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_bytes(t), _bytes(fresh[name])), name
    key = "model.layers.1.mlp.experts.3.down_proj.weight"
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _stream(a, key))
    assert isinstance(e.value, layerwise.NonFiniteWeightError) and e.value.key == key
    assert e.value.non_finite_modules == ["model.layers.1.mlp.experts"]
    # NaNs in two experts, then an unknown key ends the stream: the module is still named once
    stream = _stream(a, key)
    for t in (t for k, t in stream if k == "model.layers.1.mlp.experts.5.up_proj.weight"):
        t.view(-1)[0] = float("nan")
    stream.append(("model.layers.9.mlp.up_proj.weight", stream[0][1]))
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, stream)
    assert isinstance(e.value.cause, layerwise.UnexpectedWeightError)
    assert e.value.non_finite_modules == ["model.layers.1.mlp.experts"]
