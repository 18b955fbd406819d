"""Checkpoint-format weight updates that defer their NaN/Inf checks (Limitations 12): no host read per module
while the trainer's buckets arrive, one at finish.

On CUDA without tensor parallelism every update does; the session logic is the same on every device, so it is
forced here on the CPU (``update.model_defers_checks``) with the native extension off, as in
tests/test_reload_deferred.py. The loopback backend poisons its one reused bucket after every ``load_weights``
call, so a buffered view the update kept instead of copying would corrupt the result.
"""

import pytest
import torch

import layerwise
import layerwise.transfer.update as update_module
from layerwise.api import model_digest
from layerwise.errors import ReloadError
from layerwise.kernels import cpu_native
from layerwise.transfer import finish_weight_update, receive_weight_update, start_weight_update
from tests.test_reload_deferred import HostReads
from tests.transfer.harness import assert_same_tensors, checkpoint_tensors, pointers
from tests.transfer.test_update import LoopbackEngine, request

NAN_KEY = "model.layers.0.mlp.up_proj.weight"
NAN_MODULE = "model.layers.0.mlp.gate_up_proj"


@pytest.fixture
def deferred(monkeypatch):
    """Every checkpoint-format update defers its checks, here on the CPU; torch code instead of the native one."""
    monkeypatch.setattr(update_module, "model_defers_checks", lambda model: True)
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)


def _with_nan(tensors, key):
    out = [(k, t.clone()) for k, t in tensors]
    dict(out)[key].view(-1)[3] = float("nan")
    return out


def _modules_with_parameters(model):
    return {prefix for prefix, m in model.named_modules() if m._parameters}


@pytest.mark.parametrize("scheme", [None, "fp8-per-tensor", "fp8-per-block"], ids=lambda s: s or "bf16")
def test_deferred_update_equals_a_fresh_load_and_reads_the_host_once(ckpts, deferred, scheme):
    model = layerwise.load_model(ckpts["a"], quantization=scheme)
    expected = layerwise.load_model(ckpts["b"], quantization=scheme)
    ptrs = pointers(model)
    tensors = checkpoint_tensors(ckpts["b"])[::-1]  # reversed: modules buffered across buckets
    update = start_weight_update(model, is_checkpoint_format=True)
    assert update.session.defer_checks
    with HostReads() as reads:
        receive_weight_update(model, LoopbackEngine(tensors, capacity=2048), request(tensors).update_info)
    assert reads.reads == 0  # without deferral every module's check reads the host once
    assert update.session.peak_buffered_bytes > 0  # buffered views of the poisoned bucket were copied
    report = finish_weight_update(model)
    assert_same_tensors(model, expected)
    assert pointers(model) == ptrs
    assert set(report.updated_modules) == _modules_with_parameters(model)


def test_an_update_that_checks_as_it_goes_reads_the_host_per_module(ckpts, monkeypatch):
    """The probe above sees host reads where the update does not defer (the CPU's default)."""
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-tensor")
    tensors = checkpoint_tensors(ckpts["b"])
    update = start_weight_update(model, is_checkpoint_format=True)
    assert not update.session.defer_checks
    with HostReads() as reads:
        receive_weight_update(model, LoopbackEngine(tensors), request(tensors).update_info)
    assert reads.reads >= len(_modules_with_parameters(model))  # one check per module, norms and embeddings too
    finish_weight_update(model)


@pytest.mark.parametrize("atomic", [False, True])
def test_a_nan_is_found_at_finish(ckpts, deferred, atomic):
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-channel")
    before = model_digest(model)
    tensors = _with_nan(checkpoint_tensors(ckpts["b"]), NAN_KEY)
    start_weight_update(model, is_checkpoint_format=True, atomic=atomic)
    receive_weight_update(model, LoopbackEngine(tensors), request(tensors).update_info)  # no error yet
    with pytest.raises(ReloadError) as e:
        finish_weight_update(model)
    assert isinstance(e.value, layerwise.NonFiniteWeightError) and e.value.key == NAN_KEY
    assert NAN_MODULE in str(e.value)
    if atomic:  # the flags are read before the commit: nothing changed
        assert e.value.updated_modules == [] and model_digest(model) == before
    else:  # every module was written, the NaN one and those after it too
        assert set(e.value.updated_modules) == _modules_with_parameters(model)
    assert update_module.current_weight_update(model) is None


def test_a_nan_written_before_another_error_is_reported(ckpts, deferred):
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-tensor")
    tensors = _with_nan(checkpoint_tensors(ckpts["b"]), NAN_KEY)
    tensors.append(("model.layers.0.mlp.no_such_proj.weight", torch.zeros(4, dtype=torch.bfloat16)))
    start_weight_update(model, is_checkpoint_format=True)
    with pytest.raises(ReloadError) as e:
        receive_weight_update(model, LoopbackEngine(tensors), request(tensors).update_info)
    assert e.value.key == "model.layers.0.mlp.no_such_proj.weight"
    assert e.value.non_finite_modules == [NAN_MODULE] and NAN_MODULE in e.value.updated_modules


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cuda_update_defers_and_equals_a_fresh_load(ckpts):
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-block", device="cuda")
    expected = layerwise.load_model(ckpts["b"], quantization="fp8-per-block", device="cuda")
    tensors = checkpoint_tensors(ckpts["b"])[::-1]
    update = start_weight_update(model, is_checkpoint_format=True)
    assert update.session.defer_checks  # on CUDA without tensor parallelism, not forced
    receive_weight_update(model, LoopbackEngine(tensors, capacity=2048), request(tensors).update_info)
    finish_weight_update(model)
    assert_same_tensors(model, expected)
    nan = _with_nan(checkpoint_tensors(ckpts["b"]), NAN_KEY)
    start_weight_update(model, is_checkpoint_format=True, atomic=True)
    receive_weight_update(model, LoopbackEngine(nan), request(nan).update_info)
    with pytest.raises(layerwise.NonFiniteWeightError):
        finish_weight_update(model)
    assert_same_tensors(model, expected)  # atomic: the NaN update changed nothing
