"""A trainer written for vLLM's ``vllm/distributed/weight_transfer/`` runs against layerwise with only its imports
changed (tests/transfer/vllm_trainer.py is that trainer). One test per vLLM behaviour matched; each checks what
the engine holds afterwards against a fresh ``load_model`` of the weights sent (and its logits), or the tensors
received against those sent, bit for bit. CPU: gloo for nccl, /dev/shm for ipc.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import layerwise
from layerwise.api import model_digest
from layerwise.transfer import WeightTransferEngineFactory, tensor_metadata, update_weights
from layerwise.transfer.nccl import NCCLWeightTransferEngine
from layerwise.transfer.packed_tensor import packed_broadcast_consumer
from tests.transfer.harness import assert_same_tensors, checkpoint_tensors, free_port, fresh, nccl_init_info, share
from tests.transfer.vllm_trainer import VLLMTrainer

BUCKET_BYTES = 6000  # several tensors per bucket, and tensors larger than one
TOKENS = torch.tensor([[1, 2, 3, 4, 5]])


@pytest.fixture(scope="module")
def vllm_trainer():
    trainer = VLLMTrainer()
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def engine(vllm_trainer):
    """The engine joined to a trainer that called trainer_init with vLLM's dict (no rank_offset, no timeout)."""
    port = free_port()
    vllm_trainer.send("init", ("127.0.0.1", port, 2))
    nccl = WeightTransferEngineFactory.create_engine("nccl", device="cpu")
    nccl.init_transfer_engine(nccl_init_info(port, 20))
    vllm_trainer.expect_ok()
    yield nccl
    nccl.shutdown()


def assert_equals_fresh_load(model, ckpt):
    expected = layerwise.load_model(ckpt, quantization="fp8")
    assert_same_tensors(model, expected)
    assert torch.equal(model(TOKENS), expected(TOKENS))


def test_trainer_init_takes_vllms_three_key_dict(ckpts, vllm_trainer, engine):
    """Unpacked send over the group that trainer_init formed from master_address, master_port, world_size."""
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    tensors = checkpoint_tensors(ckpts["b"])
    vllm_trainer.send("send", (tensors, False, BUCKET_BYTES, False))
    update_weights(model, engine, {"update_info": tensor_metadata(tensors)})
    vllm_trainer.expect_ok()
    assert_equals_fresh_load(model, ckpts["b"])


def test_trainer_init_names_a_missing_key():
    with pytest.raises(ValueError, match=r"missing field\(s\) \['world_size'\]"):
        NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": 1})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['master_host'\]"):
        NCCLWeightTransferEngine.trainer_init({"master_host": "x", "master_port": 1, "world_size": 2})


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_post_iter_func_is_called_once_per_tensor_and_its_tensor_is_sent(ckpts, vllm_trainer, engine, packed):
    """The trainer holds float32 master weights; post_iter_func casts each to the BF16 the update info declares."""
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    tensors = checkpoint_tensors(ckpts["b"])
    master = [(name, t.float()) for name, t in tensors]
    info = dict(tensor_metadata(tensors), packed=packed, packed_buffer_size_bytes=BUCKET_BYTES)
    vllm_trainer.send("send", (master, packed, BUCKET_BYTES, True))
    update_weights(model, engine, {"update_info": info})
    seen = vllm_trainer.expect_ok()
    assert seen == [name for name, _ in tensors]  # once per tensor, in order, with the (name, tensor) pair
    assert_equals_fresh_load(model, ckpts["b"])


def test_packed_broadcast_producer_feeds_the_engine(ckpts, vllm_trainer, engine):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    tensors = checkpoint_tensors(ckpts["b"])
    info = dict(tensor_metadata(tensors), packed=True, packed_buffer_size_bytes=BUCKET_BYTES, packed_num_buffers=3)
    vllm_trainer.send("produce", (tensors, BUCKET_BYTES, 3))
    update_weights(model, engine, {"update_info": info})
    vllm_trainer.expect_ok()
    assert_equals_fresh_load(model, ckpts["b"])


def test_packed_broadcast_consumer_receives_what_the_trainer_sent(ckpts, vllm_trainer, engine):
    tensors = checkpoint_tensors(ckpts["b"])
    received, calls = [], []

    def post_unpack_func(weights):
        calls.append(len(weights))
        received.extend((name, t.clone()) for name, t in weights)  # views of a bucket that is refilled next

    vllm_trainer.send("send", (tensors, True, BUCKET_BYTES, False))
    packed_broadcast_consumer(
        iterator=((name, (list(t.shape), t.dtype)) for name, t in tensors),
        group=engine.group,
        src=0,
        post_unpack_func=post_unpack_func,
        buffer_size_bytes=BUCKET_BYTES,
        num_buffers=2,
    )
    vllm_trainer.expect_ok()
    assert 1 < len(calls) < len(tensors)  # buckets of several tensors
    assert [n for n, _ in received] == [n for n, _ in tensors]
    for (_, got), (_, sent) in zip(received, tensors, strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(fresh(got), fresh(sent))


@pytest.fixture
def update_server():
    """An HTTP endpoint ``POST /update_weights`` as a vLLM server has, calling update_weights on ``state``'s
    model and engine; yields (url, state)."""
    state = {"chunks": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 -- http.server's name
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            state["chunks"] += 1
            try:
                update_weights(state["model"], state["engine"], request)
                self.send_response(200)
            except Exception as e:  # noqa: BLE001 -- answered to the trainer, kept for the test
                state["error"] = e
                self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", state
    server.shutdown()
    thread.join(timeout=5)


def test_ipc_init_with_no_fields_and_vllms_http_mode_with_its_opt_in(ckpts, vllm_trainer, update_server, monkeypatch):
    """init_info {} as vLLM's; send_mode="http" posts every tensor in one update; VLLM_ALLOW_INSECURE_SERIALIZATION=1
    lets the engine unpickle the handles."""
    url, state = update_server
    ipc = WeightTransferEngineFactory.create_engine("ipc")
    ipc.init_transfer_engine({})
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    state.update(model=layerwise.load_model(ckpts["a"], quantization="fp8"), engine=ipc)
    vllm_trainer.send("ipc", (checkpoint_tensors(ckpts["b"]), f"http:{url}"))
    vllm_trainer.expect_ok()
    assert "error" not in state, state.get("error")
    assert state["chunks"] == 1
    assert_equals_fresh_load(state["model"], ckpts["b"])
    ipc.shutdown()


@pytest.mark.parametrize("flag", [None, "0"], ids=["unset", "zero"])
def test_pickled_handles_need_an_opt_in(ckpts, vllm_trainer, monkeypatch, flag):
    """Without allow_pickled_handles or VLLM_ALLOW_INSECURE_SERIALIZATION, a callable send_mode's update is refused
    before anything is unpickled; the model is unchanged, and the trainer learns it."""
    if flag is None:
        monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    else:
        monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", flag)
    ipc = WeightTransferEngineFactory.create_engine("ipc")
    ipc.init_transfer_engine({})
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    digest = model_digest(model)
    vllm_trainer.send("ipc", (share([("model.norm.weight", torch.ones(64, dtype=torch.bfloat16))]), "callable"))
    kind, info = vllm_trainer.reply()
    assert kind == "update" and "ipc_handles_pickled" in info
    with pytest.raises(ValueError, match="VLLM_ALLOW_INSECURE_SERIALIZATION=1"):
        ipc.receive_weights(info, lambda weights: pytest.fail("nothing may be loaded"))
    vllm_trainer.send("error", "refused")
    assert vllm_trainer.reply() == ("error", "RuntimeError: engine: refused")
    assert model_digest(model) == digest
    ipc.shutdown()


def test_newer_vllm_names_of_the_packed_functions_are_the_same_functions():
    """Newer vLLM calls them packed_nccl_broadcast_producer / _consumer: importing either spelling works."""
    from layerwise.transfer import packed_tensor

    assert packed_tensor.packed_nccl_broadcast_producer is packed_tensor.packed_broadcast_producer
    assert packed_tensor.packed_nccl_broadcast_consumer is packed_tensor.packed_broadcast_consumer
