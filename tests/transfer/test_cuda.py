"""Weight sync on CUDA: NCCL broadcast (two GPUs), CUDA IPC handles, a captured CUDA graph kept valid.

Skipped without a GPU (the NCCL test also without a second one: NCCL refuses two ranks on one device).
"""

import pytest
import torch

import layerwise
from layerwise.engine import Engine
from layerwise.transfer import WeightTransferEngineFactory, tensor_metadata, update_weights
from tests.engine_helpers import greedy
from tests.transfer.harness import (
    SCHEMES,
    Trainer,
    assert_same_tensors,
    checkpoint_tensors,
    connect_nccl,
    kernel_tensors,
    pointers,
    receive_ipc,
)
from tests.transfer.test_update import LoopbackEngine, request

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the engine on two GPUs")
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("is_checkpoint_format", [True, False], ids=["checkpoint", "kernel"])
def test_nccl_update_equals_fresh_load(ckpts, is_checkpoint_format, packed):
    trainer = Trainer()
    try:
        engine = connect_nccl(trainer, 60.0, trainer_device="cuda:1", device="cuda:0")
        for scheme in SCHEMES:
            model = layerwise.load_model(ckpts["a"], quantization=scheme, device="cuda:0")
            expected = layerwise.load_model(ckpts["b"], quantization=scheme, device="cuda:0")
            ptrs = pointers(model)
            tensors = (
                checkpoint_tensors(ckpts["b"])
                if is_checkpoint_format
                else [(n, t.cpu()) for n, t in kernel_tensors(expected)]
            )
            args = {"packed": packed, "packed_buffer_size_bytes": 6000}
            trainer.send("nccl_send", (tensors, args, None, None))
            info = dict(tensor_metadata(tensors), is_checkpoint_format=is_checkpoint_format, **args)
            update_weights(model, engine, {"update_info": info}, atomic=packed)
            trainer.expect_ok()
            assert_same_tensors(model, expected)
            assert pointers(model) == ptrs
        engine.shutdown()
    finally:
        trainer.close()


@pytest.mark.parametrize("is_checkpoint_format", [True, False], ids=["checkpoint", "kernel"])
def test_cuda_ipc_update_equals_fresh_load(ckpts, is_checkpoint_format):
    ipc = WeightTransferEngineFactory.create_engine("ipc", device="cuda:0")
    ipc.init_transfer_engine({"allow_pickled_handles": True})
    trainer = Trainer()
    try:
        for scheme in SCHEMES:
            model = layerwise.load_model(ckpts["a"], quantization=scheme, device="cuda:0")
            expected = layerwise.load_model(ckpts["b"], quantization=scheme, device="cuda:0")
            ptrs = pointers(model)
            tensors = (
                checkpoint_tensors(ckpts["b"])
                if is_checkpoint_format
                else [(n, t.cpu()) for n, t in kernel_tensors(expected)]
            )
            trainer.send(
                "ipc_send",
                (tensors, {"buffer_size_bytes": 10_000, "is_checkpoint_format": is_checkpoint_format}, "cuda:0"),
            )
            report, error, chunks = receive_ipc(trainer, model, ipc, is_checkpoint_format=is_checkpoint_format)
            assert error is None, error
            assert_same_tensors(model, expected)
            assert pointers(model) == ptrs
    finally:
        trainer.close()


def test_captured_cuda_graph_stays_valid_across_updates(ckpts):
    engine = Engine(
        layerwise.load_model(ckpts["a"], quantization="fp8", device="cuda"),
        max_batch_size=2,
        max_seq_len=32,
        use_cuda_graph=True,
    )
    prompts = [[1, 2, 3], [4, 5]]
    greedy(engine, prompts, 8)
    for path in (ckpts["b"], ckpts["a"], ckpts["b"]):
        tensors = checkpoint_tensors(path)
        update_weights(engine, LoopbackEngine(tensors), request(tensors))
        fresh = Engine(
            layerwise.load_model(path, quantization="fp8", device="cuda"),
            max_batch_size=2,
            max_seq_len=32,
            use_cuda_graph=False,
        )
        assert greedy(engine, prompts, 8) == greedy(fresh, prompts, 8)
    assert engine.captures == 1
