"""The engine side of an update (layerwise/transfer/update.py), in one process, through a loopback backend.

The loopback backend packs the tensors into one uint8 buffer that it poisons (0xFF = NaN in bf16 and
float8_e4m3fn) after every ``load_weights`` call, so any view the update kept would corrupt the result.
"""

import contextlib
import gc
import weakref

import pytest
import torch

import layerwise
from layerwise.api import model_digest
from layerwise.engine import Engine
from layerwise.errors import ReloadError
from layerwise.transfer import (
    TensorListUpdateInfo,
    WeightTransferEngine,
    WeightTransferUpdateRequest,
    abort_weight_update,
    current_weight_update,
    finish_weight_update,
    start_weight_update,
    tensor_metadata,
    update_weights,
)
from layerwise.transfer.packed_tensor import flat_bytes, plan_buckets, unpack_bucket
from tests.engine_helpers import greedy
from tests.transfer.harness import assert_same_tensors, checkpoint_tensors, kernel_tensors, pointers


class LoopbackEngine(WeightTransferEngine):
    """Delivers ``self.source`` from one reused, poisoned bucket of ``capacity`` bytes."""

    init_info_cls = TensorListUpdateInfo  # unused
    update_info_cls = TensorListUpdateInfo

    def __init__(self, source, capacity=4096):
        super().__init__("cpu")
        self.source, self.capacity = source, capacity

    def init_transfer_engine(self, init_info):
        pass

    def receive_weights(self, update_info, load_weights):
        buffer = torch.empty(
            max(self.capacity, max(t.numel() * t.element_size() for _, t in self.source)), dtype=torch.uint8
        )
        tensors = [t for _, t in self.source]
        for bucket in plan_buckets([t.numel() * t.element_size() for t in tensors], self.capacity):
            for i, off, n in bucket.entries:
                buffer[off : off + n].copy_(flat_bytes(tensors[i]))
            load_weights(unpack_bucket(buffer, bucket, update_info.names, update_info.dtypes, update_info.shapes))
            buffer.fill_(0xFF)

    def shutdown(self):
        pass

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        pass


def request(tensors, is_checkpoint_format=True):
    return WeightTransferUpdateRequest(dict(tensor_metadata(tensors), is_checkpoint_format=is_checkpoint_format))


def test_reversed_stream_through_a_reused_buffer_equals_fresh_load(ckpts):
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-block")
    expected = layerwise.load_model(ckpts["b"], quantization="fp8-per-block")
    ptrs = pointers(model)
    tensors = checkpoint_tensors(ckpts["b"])[::-1]
    report = update_weights(model, LoopbackEngine(tensors), request(tensors))
    assert_same_tensors(model, expected)
    assert pointers(model) == ptrs
    assert report.peak_buffered_bytes > 0 and current_weight_update(model) is None


class LockedEngine(Engine):
    """An Engine with the ``weight_update_lock()`` the owner adds; records when it is held."""

    def __init__(self, model):
        super().__init__(model, max_batch_size=1, max_seq_len=16)
        self.events = []

    @contextlib.contextmanager
    def weight_update_lock(self):
        self.events.append("locked")
        yield
        self.events.append("unlocked")


def test_update_weights_takes_an_engine_and_holds_its_lock(ckpts):
    engine = LockedEngine(layerwise.load_model(ckpts["a"], quantization="fp8"))
    fresh_engine = Engine(layerwise.load_model(ckpts["b"], quantization="fp8"), max_batch_size=1, max_seq_len=16)
    tensors = checkpoint_tensors(ckpts["b"])
    update_weights(engine, LoopbackEngine(tensors), {"update_info": request(tensors).update_info})
    assert engine.events == ["locked", "unlocked"]
    assert greedy(engine, [[1, 2, 3]], 5) == greedy(fresh_engine, [[1, 2, 3]], 5)


def test_format_mismatch_is_refused_and_changes_nothing(ckpts):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    digest = model_digest(model)
    tensors = checkpoint_tensors(ckpts["b"])
    update = start_weight_update(model, is_checkpoint_format=False)
    with pytest.raises(ReloadError, match="is_checkpoint_format=True"):
        update.receive(LoopbackEngine(tensors), request(tensors).update_info)
    assert update.closed and current_weight_update(model) is None
    assert model_digest(model) == digest


@pytest.mark.parametrize("atomic", [False, True])
def test_incomplete_module_fails_at_finish(ckpts, atomic):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    digest = model_digest(model)
    tensors = [(n, t) for n, t in checkpoint_tensors(ckpts["b"]) if n != "model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(ReloadError, match=r"model\.layers\.0\.mlp\.gate_up_proj\.weight") as e:
        update_weights(model, LoopbackEngine(tensors), request(tensors), atomic=atomic)
    assert "model.layers.0.mlp.gate_up_proj" not in e.value.updated_modules
    after = model_digest(model)
    assert after["model.layers.0.mlp.gate_up_proj.weight"] == digest["model.layers.0.mlp.gate_up_proj.weight"]
    assert (after == digest) == atomic


def test_kernel_format_duplicate_and_lifecycle_errors(ckpts):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    tensors = kernel_tensors(layerwise.load_model(ckpts["b"], quantization="fp8"))[:3]
    with pytest.raises(ReloadError, match="sent twice") as e:
        update_weights(model, LoopbackEngine(tensors + tensors[:1]), request(tensors + tensors[:1], False))
    assert e.value.key == tensors[0][0] and e.value.updated_modules == [n for n, _ in tensors]
    with pytest.raises(RuntimeError, match="no weight update in progress"):
        finish_weight_update(model)
    assert abort_weight_update(model) == []
    update = start_weight_update(model)
    with pytest.raises(RuntimeError, match="already in progress"):
        start_weight_update(model)
    with pytest.raises(RuntimeError, match="already in progress"):
        layerwise.reload_weights(model, ckpts["b"])  # the reload session is taken too
    assert update.abort() == [] and current_weight_update(model) is None
    with pytest.raises(TypeError, match="nn.Module"):
        start_weight_update(object())


def test_a_failed_update_leaves_no_reference_to_the_model(ckpts):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    ref = weakref.ref(model)
    tensors = checkpoint_tensors(ckpts["b"])
    tensors[4] = ("model.layers.0.nonexistent.weight", tensors[4][1])
    with pytest.raises(ReloadError):
        update_weights(model, LoopbackEngine(tensors), request(tensors))
    del model
    gc.collect()
    assert ref() is None


class FailingEngine(LoopbackEngine):
    """A backend whose transport dies after ``deliver`` buckets (a peer gone, a CUDA error): not a LayerwiseError."""

    def __init__(self, source, deliver):
        super().__init__(source)
        self.deliver = deliver

    def receive_weights(self, update_info, load_weights):
        tensors = list(zip(update_info.names, (t for _, t in self.source), strict=True))
        for i, (name, tensor) in enumerate(tensors):
            if i == self.deliver:
                raise RuntimeError("connection reset by peer")
            load_weights([(name, tensor.clone())])


def test_a_transport_error_midway_names_the_updated_modules(ckpts):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    tensors = checkpoint_tensors(ckpts["b"])
    deliver = next(i for i, (n, _) in enumerate(tensors) if n.startswith("model.layers.1."))
    with pytest.raises(ReloadError, match="RuntimeError: connection reset by peer") as e:
        update_weights(model, FailingEngine(tensors, deliver), request(tensors))
    assert isinstance(e.value.cause, RuntimeError)
    assert e.value.updated_modules and all(".layers.1." not in m for m in e.value.updated_modules)
    # what the error names holds B's values, everything else A's
    ref_a = layerwise.load_model(ckpts["a"], quantization="fp8").state_dict()
    ref_b = layerwise.load_model(ckpts["b"], quantization="fp8").state_dict()
    raw = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731
    changed = 0
    for name, t in model.state_dict().items():
        expected = ref_b if name.rsplit(".", 1)[0] in e.value.updated_modules else ref_a
        assert torch.equal(raw(t), raw(expected[name])), name
        changed += not torch.equal(raw(ref_a[name]), raw(ref_b[name]))
    assert changed  # A and B differ, so the comparison above can tell them apart


@pytest.mark.parametrize("scheme", ["fp8-per-tensor", "fp8-per-block"])
def test_moe_experts_through_a_reused_buffer_equal_fresh_load(tmp_path, scheme):
    # an expert's gate and up arrive in different buckets of one reused buffer: the buffered gate must be owned
    # (copied) before the transport overwrites it, as a dense module's buffered tensors are
    from tests.hf_checkpoints import write_hf_checkpoint

    a = write_hf_checkpoint(tmp_path / "a", "Qwen3MoeForCausalLM", seed=0, num_layers=3)
    b = write_hf_checkpoint(tmp_path / "b", "Qwen3MoeForCausalLM", seed=1, num_layers=3)
    model = layerwise.load_model(a, quantization=scheme)
    tensors = checkpoint_tensors(b)
    update_weights(model, LoopbackEngine(tensors, capacity=1), request(tensors))  # one tensor per bucket
    assert_same_tensors(model, layerwise.load_model(b, quantization=scheme))
