"""Checkpoint-format weight updates that defer their NaN/Inf checks (Limitations 12): no host read per module,
one wait for the device and one read of the flags at the end of each batch, while the batch is still valid.

On CUDA without tensor parallelism every update does; the session logic is the same on every device, so it is
forced here on the CPU (``update.model_defers_checks``) with the native extension off, as in
tests/test_reload_deferred.py. The loopback engines deliver the trainer's tensors through one reused bucket
that they overwrite after every ``load_weights`` call, here with zeros (finite: a NaN looked for after the
refill would be missed or blamed on the wrong key; the CUDA test refills a pinned bucket with NaN bytes).
"""

import gc
import weakref

import pytest
import torch

import layerwise
import layerwise.transfer.update as update_module
from layerwise.api import model_digest
from layerwise.errors import ReloadError, WeightTransferError
from layerwise.kernels import cpu_native
from layerwise.transfer import finish_weight_update, receive_weight_update, start_weight_update
from layerwise.transfer.packed_tensor import flat_bytes, plan_buckets, unpack_bucket
from tests.test_reload_deferred import HostReads
from tests.transfer.harness import assert_same_tensors, checkpoint_tensors, pointers
from tests.transfer.test_update import LoopbackEngine, request

NAN_KEY = "model.layers.0.mlp.up_proj.weight"
NAN_MODULE = "model.layers.0.mlp.gate_up_proj"


class ZeroRefillEngine(LoopbackEngine):
    """LoopbackEngine that overwrites its bucket with ``fill`` bytes (zeros: finite) after each batch from the
    host, keeps a weak reference to the bucket, and can fail in transport before bucket ``fail_at``. ``pin``:
    the bucket in pinned memory, so the update's copies from it do not wait (on CUDA)."""

    def __init__(self, source, capacity=4096, fail_at=None, fill=0, pin=False):
        super().__init__(source, capacity)
        self.fail_at, self.fill, self.pin, self.bucket_ref, self.batches = fail_at, fill, pin, None, 0

    def receive_weights(self, update_info, load_weights):
        tensors = [t for _, t in self.source]
        nbytes = max(self.capacity, *(t.numel() * t.element_size() for t in tensors))
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
        self.bucket_ref = weakref.ref(buffer.untyped_storage())
        for k, bucket in enumerate(plan_buckets([t.numel() * t.element_size() for t in tensors], self.capacity)):
            if k == self.fail_at:
                raise WeightTransferError("the trainer stopped sending", key=update_info.names[bucket.entries[0][0]])
            for i, off, n in bucket.entries:
                buffer[off : off + n].copy_(flat_bytes(tensors[i]))
            load_weights(unpack_bucket(buffer, bucket, update_info.names, update_info.dtypes, update_info.shapes))
            self.batches += 1
            buffer.fill_(self.fill)


@pytest.fixture
def deferred(monkeypatch):
    """Every checkpoint-format update defers its checks, here on the CPU; torch code instead of the native one.
    Returns the list of sessions whose checks were read, one entry per read."""
    monkeypatch.setattr(update_module, "model_defers_checks", lambda model: True)
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    reads, check = [], update_module.check_deferred
    monkeypatch.setattr(update_module, "check_deferred", lambda session: reads.append(session) or check(session))
    return reads


def _with_nan(tensors, key):
    out = [(k, t.clone()) for k, t in tensors]
    dict(out)[key].view(-1)[3] = float("nan")
    return out


def _modules_with_parameters(model):
    return {prefix for prefix, m in model.named_modules() if m._parameters}


@pytest.mark.parametrize("scheme", [None, "fp8-per-tensor", "fp8-per-block"], ids=lambda s: s or "bf16")
def test_deferred_update_equals_a_fresh_load_reading_once_per_batch(ckpts, deferred, scheme):
    model = layerwise.load_model(ckpts["a"], quantization=scheme)
    expected = layerwise.load_model(ckpts["b"], quantization=scheme)
    ptrs = pointers(model)
    tensors = checkpoint_tensors(ckpts["b"])[::-1]  # reversed: modules buffered across buckets
    engine = ZeroRefillEngine(tensors, capacity=2048)
    update = start_weight_update(model, is_checkpoint_format=True)
    assert update.session.defer_checks and not update.session.borrow_device_tensors
    with HostReads() as reads:
        receive_weight_update(model, engine, request(tensors).update_info)
    assert reads.reads == 0  # without deferral every module's check reads the host once (next test)
    assert len(deferred) == engine.batches > 1  # one read of the flags per batch, none per module
    assert update.session.peak_buffered_bytes > 0 and update.session.deferred == []
    gc.collect()
    assert engine.bucket_ref() is None  # nothing of the transport's bucket outlives the receive
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
def test_a_nan_is_raised_at_the_end_of_its_batch_naming_its_key(ckpts, deferred, atomic):
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-channel")
    before = model_digest(model)
    tensors = _with_nan(checkpoint_tensors(ckpts["b"]), NAN_KEY)
    engine = ZeroRefillEngine(tensors, capacity=2048)  # finite refills: the key is found before the refill
    start_weight_update(model, is_checkpoint_format=True, atomic=atomic)
    with pytest.raises(ReloadError) as e:
        receive_weight_update(model, engine, request(tensors).update_info)
    assert e.value.key == NAN_KEY and NAN_MODULE in str(e.value)
    if atomic:  # staged modules are dropped: nothing changed, nothing holds the NaN
        assert e.value.updated_modules == e.value.non_finite_modules == [] and model_digest(model) == before
        assert "staged, not written" in str(e.value)
    else:  # the NaN module and the rest of its batch were written
        assert e.value.non_finite_modules == [NAN_MODULE] and NAN_MODULE in e.value.updated_modules
    assert update_module.current_weight_update(model) is None


def test_a_nan_written_before_another_error_in_its_batch_is_reported(ckpts, deferred):
    # the unknown name ends the batch before its checks are read: the abort reads them and lists the NaN module
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-tensor")
    tensors = _with_nan(checkpoint_tensors(ckpts["b"]), NAN_KEY)
    tensors.append(("model.layers.0.mlp.no_such_proj.weight", torch.zeros(4, dtype=torch.bfloat16)))
    start_weight_update(model, is_checkpoint_format=True)
    with pytest.raises(ReloadError) as e:  # one bucket: the NaN module and the unknown name in the same batch
        receive_weight_update(model, ZeroRefillEngine(tensors, capacity=1 << 20), request(tensors).update_info)
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
    # a pinned bucket the host overwrites with NaN bytes as soon as load_weights returns: a copy still queued
    # then would read them (the update's copies from pinned memory do not wait)
    engine = ZeroRefillEngine(tensors, capacity=2048, fill=0xFF, pin=True)
    receive_weight_update(model, engine, request(tensors).update_info)
    finish_weight_update(model)
    assert_same_tensors(model, expected)
    nan = _with_nan(checkpoint_tensors(ckpts["b"]), NAN_KEY)
    start_weight_update(model, is_checkpoint_format=True, atomic=True)
    with pytest.raises(ReloadError) as e:
        receive_weight_update(model, ZeroRefillEngine(nan, capacity=2048), request(nan).update_info)
    assert e.value.key == NAN_KEY and e.value.updated_modules == e.value.non_finite_modules == []
    assert "staged, not written" in str(e.value)
    assert_same_tensors(model, expected)  # atomic: the NaN update changed nothing
