"""Backend "ipc" on CPU: the trainer process copies tensors into shared memory, this process maps them."""

import base64
import os
import pickle
import re

import pytest
import torch

import layerwise
from layerwise.api import model_digest
from layerwise.errors import ReloadError
from layerwise.transfer import WeightTransferEngineFactory
from layerwise.transfer.ipc import segment_names
from tests.transfer.harness import (
    SCHEMES,
    assert_same_tensors,
    checkpoint_tensors,
    kernel_tensors,
    pointers,
    receive_ipc,
    share,
)

CHUNK_BYTES = 10_000  # several chunks per update, so modules straddle chunks (one start/finish around them)


@pytest.mark.parametrize("is_checkpoint_format", [True, False], ids=["checkpoint", "kernel"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_update_equals_fresh_load(ckpts, trainer, ipc_engine, scheme, is_checkpoint_format):
    model = layerwise.load_model(ckpts["a"], quantization=scheme)
    expected = layerwise.load_model(ckpts["b"], quantization=scheme)
    ptrs = pointers(model)
    tensors = checkpoint_tensors(ckpts["b"]) if is_checkpoint_format else share(kernel_tensors(expected))
    args = {
        "buffer_size_bytes": CHUNK_BYTES,
        "is_checkpoint_format": is_checkpoint_format,
        "segment_prefix": ipc_engine.segment_prefix,
    }
    trainer.send("ipc_send", (tensors, args, "cpu"))
    report, error, chunks = receive_ipc(
        trainer, model, ipc_engine, is_checkpoint_format=is_checkpoint_format, atomic=not is_checkpoint_format
    )
    assert error is None, error
    assert chunks > 2
    assert_same_tensors(model, expected)
    assert pointers(model) == ptrs
    assert segment_names(ipc_engine.segment_prefix) == []  # the trainer unlinked its segment


def test_bad_tensor_atomic_leaves_model_unchanged_and_the_trainer_learns_it(ckpts, trainer, ipc_engine):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    digest = model_digest(model)
    tensors = checkpoint_tensors(ckpts["b"])
    key = "model.layers.1.self_attn.v_proj.weight"
    i = [n for n, _ in tensors].index(key)
    tensors[i][1][0, 0] = float("inf")
    args = {"buffer_size_bytes": CHUNK_BYTES, "segment_prefix": ipc_engine.segment_prefix}
    trainer.send("ipc_send", (tensors, args, "cpu"))
    report, error, _ = receive_ipc(trainer, model, ipc_engine, atomic=True)
    assert isinstance(error, ReloadError) and error.key == key and error.updated_modules == []
    assert model_digest(model) == digest
    assert segment_names(ipc_engine.segment_prefix) == []  # the engine removed it, then the trainer ended


def test_a_trainer_without_segment_prefix_names_and_unlinks_its_own(trainer, ipc_engine):
    """Older call sites pass no segment_prefix: the trainer draws one per call, which no engine removes."""
    trainer.send(
        "ipc_send", ([(f"t{i}", torch.full((256,), float(i))) for i in range(3)], {"buffer_size_bytes": 1024}, "cpu")
    )
    seen = set()
    while (reply := trainer.reply())[0] == "update":
        seen |= {h["shm_name"] for h in pickle.loads(base64.b64decode(reply[1]["ipc_handles_pickled"]))}
        ipc_engine.receive_weights(reply[1], lambda weights: None)
        trainer.send("ack")
    assert reply == ("ok", None)
    assert len(seen) == 1 and re.fullmatch(r"layerwise_[0-9a-f]{16}_[0-9]+", name := seen.pop()), seen
    assert not name.startswith(ipc_engine.segment_prefix + "_")
    assert not os.path.exists(os.path.join("/dev/shm", name))


def test_out_of_order_chunks_are_copied_before_the_segment_is_reused(ckpts, trainer, ipc_engine):
    """Reversed order: each module's first tensors wait while the trainer refills the one segment."""
    model = layerwise.load_model(ckpts["a"], quantization="fp8-per-channel")
    expected = layerwise.load_model(ckpts["b"], quantization="fp8-per-channel")
    trainer.send("ipc_send", (checkpoint_tensors(ckpts["b"])[::-1], {"buffer_size_bytes": 4096}, "cpu"))
    report, error, chunks = receive_ipc(trainer, model, ipc_engine)
    assert error is None, error
    assert report.peak_buffered_bytes > 0
    assert_same_tensors(model, expected)


def test_opt_in_is_required():
    engine = WeightTransferEngineFactory.create_engine("ipc")
    update = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]], "ipc_handles_pickled": "gARdlC4="}
    with pytest.raises(RuntimeError, match="init_transfer_engine"):
        engine.receive_weights(update, lambda weights: None)
    engine.init_transfer_engine({})  # accepted, as vLLM's; the opt-in now guards unpickling itself
    with pytest.raises(ValueError, match="allow_pickled_handles=True"):
        engine.receive_weights(update, lambda weights: None)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['allow_pickle'\]"):
        engine.parse_init_info({"allow_pickle": True})
    with pytest.raises(ValueError, match="exactly one of ipc_handles and ipc_handles_pickled"):
        engine.parse_update_info({"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]})


def test_handles_are_checked(ipc_engine):
    base = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[4]]}
    for handle, message in [
        ({"shm_name": "../etc/passwd", "offset": 0}, "not a shared-memory segment name"),
        ({"shm_name": f"layerwise_missing_{os.getpid()}", "offset": 0}, "no shared-memory"),
        ({"cuda": (print, ("hello",)), "gpu_uuid": "x"}, "refusing to call"),
        ({"other": 1}, "neither"),
    ]:
        with pytest.raises(ValueError, match=message) as e:
            ipc_engine.receive_weights(dict(base, ipc_handles=[handle]), lambda weights: None)
        assert "'x'" in str(e.value)


def test_a_handle_outside_its_segment_is_refused(ipc_engine):
    from multiprocessing import shared_memory

    segment = shared_memory.SharedMemory(create=True, size=64)
    try:
        torch.frombuffer(segment.buf, dtype=torch.float32, count=4).copy_(torch.arange(4.0))
        got = []
        info = {
            "names": ["x"],
            "dtype_names": ["float32"],
            "shapes": [[4]],
            "ipc_handles": [{"shm_name": segment.name, "offset": 0}],
        }
        ipc_engine.receive_weights(info, lambda weights: got.extend((n, t.clone()) for n, t in weights))
        assert got[0][0] == "x" and torch.equal(got[0][1], torch.arange(4.0))
        with pytest.raises(ValueError, match="does not fit"):
            ipc_engine.receive_weights(
                dict(info, ipc_handles=[{"shm_name": segment.name, "offset": 4096}]), lambda weights: None
            )
    finally:
        segment.close()
        segment.unlink()
