"""Backend "nccl" on CPU (gloo): a trainer process broadcasts, this process is the engine.

Every update is checked against a fresh ``load_model`` of the trainer's weights, bit for bit, in the same
kernel tensors (data_ptr unchanged).
"""

import math
import time

import pytest
import torch

import layerwise
from layerwise.api import model_digest
from layerwise.errors import ReloadError
from layerwise.transfer import WeightTransferTimeoutError, tensor_metadata, update_weights
from tests.transfer.harness import (
    SCHEMES,
    Trainer,
    assert_same_tensors,
    checkpoint_tensors,
    connect_nccl,
    kernel_tensors,
    pointers,
    share,
)

BUCKET_BYTES = 6000  # tiny buckets: several tensors per bucket, and tensors (8 KiB gate_up) larger than one


def send(
    trainer,
    engine,
    model,
    tensors,
    *,
    packed=False,
    is_checkpoint_format=True,
    atomic=False,
    die_after=None,
    stall_after=None,
    info_tensors=None,
    **update_kwargs,
):
    """Trainer broadcasts ``tensors``; this process receives them into ``model``. Returns (report, error)."""
    args = {"packed": packed, "packed_buffer_size_bytes": BUCKET_BYTES}
    info = dict(tensor_metadata(info_tensors or tensors), is_checkpoint_format=is_checkpoint_format, **args)
    trainer.send("nccl_send", (tensors, args, die_after, stall_after))
    report = error = None
    try:
        report = update_weights(model, engine, {"update_info": info}, atomic=atomic, **update_kwargs)
    except ReloadError as e:
        error = e
    if die_after is None and stall_after is None:
        trainer.expect_ok()  # the trainer finished its send: the group is still in step
    return report, error


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("is_checkpoint_format", [True, False], ids=["checkpoint", "kernel"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_update_equals_fresh_load(ckpts, trainer, nccl_engine, scheme, is_checkpoint_format, packed):
    model = layerwise.load_model(ckpts["a"], quantization=scheme)
    expected = layerwise.load_model(ckpts["b"], quantization=scheme)
    ptrs = pointers(model)
    tensors = checkpoint_tensors(ckpts["b"]) if is_checkpoint_format else share(kernel_tensors(expected))
    report, error = send(
        trainer, nccl_engine, model, tensors, packed=packed, is_checkpoint_format=is_checkpoint_format, atomic=packed
    )
    assert error is None, error
    assert_same_tensors(model, expected)
    assert pointers(model) == ptrs
    assert len(report.updated_modules) == (19 if is_checkpoint_format else len(tensors))


def test_partial_update_changes_only_the_modules_sent(ckpts, trainer, nccl_engine):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    before = model_digest(model)
    expected = layerwise.load_model(ckpts["b"], quantization="fp8")
    tensors = [(n, t) for n, t in checkpoint_tensors(ckpts["b"]) if n.startswith("model.layers.1.")]
    report, error = send(trainer, nccl_engine, model, tensors, packed=True)
    assert error is None, error
    assert report.updated_decoder_layers == [1]
    after = model_digest(model)
    for name in after:
        if name.startswith("model.layers.1.") and "rotary" not in name:
            assert_same_tensors(model, expected, [name])
        else:
            assert after[name] == before[name], name


def _bad_inputs(ckpt_b):
    good = checkpoint_tensors(ckpt_b)
    key = "model.layers.1.mlp.up_proj.weight"
    i = [n for n, _ in good].index(key)
    nan = good[i][1].clone()
    nan[3, 5] = float("nan")
    return (
        key,
        {
            "unknown name": good[:i] + [("model.layers.1.mlp.extra_proj.weight", good[i][1])] + good[i + 1 :],
            "wrong shape": good[:i] + [(key, good[i][1][:-1].clone())] + good[i + 1 :],
            "wrong dtype": good[:i] + [(key, good[i][1].to(torch.int32))] + good[i + 1 :],  # float dtypes are cast
            "nan": good[:i] + [(key, nan)] + good[i + 1 :],
        },
    )


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("case", ["unknown name", "wrong shape", "wrong dtype", "nan"])
def test_bad_tensor_atomic_leaves_model_unchanged(ckpts, trainer, nccl_engine, case, packed):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    digest = model_digest(model)
    key, cases = _bad_inputs(ckpts["b"])
    report, error = send(trainer, nccl_engine, model, cases[case], packed=packed, atomic=True)
    assert isinstance(error, ReloadError) and error.updated_modules == []
    assert error.key in (key, "model.layers.1.mlp.extra_proj.weight") and error.key in str(error)
    assert model_digest(model) == digest
    # the engine drained the rest of the update, so the same group carries the next one
    expected = layerwise.load_model(ckpts["b"], quantization="fp8")
    report, error = send(trainer, nccl_engine, model, checkpoint_tensors(ckpts["b"]), packed=packed)
    assert error is None, error
    assert_same_tensors(model, expected)


def test_bad_tensor_non_atomic_lists_the_updated_modules(ckpts, trainer, nccl_engine):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    before = model_digest(model)
    key, cases = _bad_inputs(ckpts["b"])
    report, error = send(trainer, nccl_engine, model, cases["nan"], packed=True)
    assert error.key == key and "non-finite" in str(error)
    changed = {n.rsplit(".", 1)[0] for n, d in model_digest(model).items() if d != before[n]}
    assert changed and changed <= set(error.updated_modules)
    assert "model.layers.1.mlp.gate_up_proj" not in error.updated_modules  # the module that failed kept its values
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()  # usable


@pytest.mark.parametrize("case", ["wrong shape", "wrong dtype", "nan"])
def test_bad_kernel_tensor_atomic_leaves_model_unchanged(ckpts, trainer, nccl_engine, case):
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    digest = model_digest(model)
    good = share(kernel_tensors(layerwise.load_model(ckpts["b"], quantization="fp8")))
    key = "model.layers.1.mlp.down_proj.weight"
    i = [n for n, _ in good].index(key)
    bad = good[i][1].clone()
    if case == "wrong shape":
        bad = bad[:-1].clone()
    elif case == "wrong dtype":
        bad = bad.float()
    else:
        bad.view(torch.uint8)[0, 0] = 0x7F  # float8_e4m3fn NaN
    report, error = send(
        trainer,
        nccl_engine,
        model,
        good[:i] + [(key, bad)] + good[i + 1 :],
        packed=True,
        is_checkpoint_format=False,
        atomic=True,
    )
    assert error.key == key and error.updated_modules == []
    assert model_digest(model) == digest


def test_out_of_order_names_and_buffer_limit(ckpts, trainer, nccl_engine, record_property):
    """Interleaved layers and reversed shards: correct result; the receiver buffers only incomplete modules."""
    expected = layerwise.load_model(ckpts["b"], quantization="fp8")
    tensors = checkpoint_tensors(ckpts["b"])
    shuffled = tensors[::2] + tensors[1::2][::-1]
    model = layerwise.load_model(ckpts["a"], quantization="fp8")
    ptrs = pointers(model)
    report, error = send(trainer, nccl_engine, model, shuffled, packed=True)
    assert error is None, error
    assert_same_tensors(model, expected)
    assert pointers(model) == ptrs
    total = sum(t.numel() * t.element_size() for _, t in tensors)
    record_property("peak_buffered_bytes", report.peak_buffered_bytes)
    print(f"\nout-of-order update: receiver peak buffered {report.peak_buffered_bytes} bytes of {total}")
    assert 0 < report.peak_buffered_bytes < total
    # the same stream under a limit below that peak fails, naming the tensor, and changes nothing
    digest = model_digest(model)
    limit = report.peak_buffered_bytes // 2
    older = checkpoint_tensors(ckpts["a"])
    _, error = send(
        trainer, nccl_engine, model, older[::2] + older[1::2][::-1], packed=True, atomic=True, max_buffered_bytes=limit
    )
    assert "max_buffered_bytes" in str(error) and error.key
    assert model_digest(model) == digest


@pytest.mark.parametrize("is_checkpoint_format", [True, False], ids=["checkpoint", "kernel"])
@pytest.mark.parametrize(
    "names",
    [["lm_head.weight"], ["model.embed_tokens.weight"], ["lm_head.weight", "model.embed_tokens.weight"]],
    ids=["lm_head", "embed", "both"],
)
def test_tied_embedding_updated_through_either_name_stays_tied(
    ckpts, trainer, nccl_engine, names, is_checkpoint_format
):
    model = layerwise.load_model(ckpts["tied_a"], quantization="fp8")
    expected = layerwise.load_model(ckpts["tied_b"], quantization="fp8")
    tied = model.model.embed_tokens.weight
    new = dict(checkpoint_tensors(ckpts["tied_b"]))["model.embed_tokens.weight"]
    report, error = send(
        trainer, nccl_engine, model, [(n, new) for n in names], packed=True, is_checkpoint_format=is_checkpoint_format
    )
    assert error is None, error
    assert report.updated_modules == (["model.embed_tokens"] if is_checkpoint_format else names)
    assert model.lm_head.weight is model.model.embed_tokens.weight is tied  # one tensor, written in place
    assert_same_tensors(model, expected, ["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, new)


def _assert_timely(error, started, timeout):
    elapsed = time.perf_counter() - started
    assert isinstance(error, WeightTransferTimeoutError) and isinstance(error, TimeoutError), error
    assert elapsed < timeout + 3.0, f"took {elapsed:.1f} s with a {timeout} s timeout"
    assert error.key and error.key in str(error)


@pytest.mark.parametrize("how", ["dies", "stalls"])
def test_trainer_failing_mid_update_times_out(ckpts, how):
    """A trainer that dies (atomic: model unchanged) or hangs (non-atomic: usable, updated modules listed)."""
    timeout = 1.5
    trainer = Trainer()
    try:
        engine = connect_nccl(trainer, timeout)
        model = layerwise.load_model(ckpts["a"], quantization="fp8")
        before = model_digest(model)
        tensors = checkpoint_tensors(ckpts["b"])
        atomic = how == "dies"
        started = time.perf_counter()
        kill = {"die_after": 20} if how == "dies" else {"stall_after": 20}
        _, error = send(trainer, engine, model, tensors, atomic=atomic, **kill)
        _assert_timely(error, started, timeout)
        after = model_digest(model)
        if atomic:
            assert error.updated_modules == [] and after == before
        else:
            changed = {n.rsplit(".", 1)[0] for n, d in after.items() if d != before[n]}
            assert changed and changed <= set(error.updated_modules)
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()
        assert "shutdown" in str(error)
        engine.shutdown()
    finally:
        trainer.kill()


def test_parse_update_info_of_the_backend(nccl_engine):
    ok = {"names": ["a"], "dtype_names": ["bfloat16"], "shapes": [[2, 3]]}
    info = nccl_engine.parse_update_info(dict(ok, packed=True))
    assert info.packed and info.packed_num_buffers == 2 and info.packed_buffer_size_bytes == 1 << 30
    assert info.nbytes(0) == 12 and info.dtypes == [torch.bfloat16]
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bucket_size'\]"):
        nccl_engine.parse_update_info(dict(ok, bucket_size=3))
    with pytest.raises(ValueError, match=r"missing field\(s\) \['shapes'\]"):
        nccl_engine.parse_update_info({"names": ["a"], "dtype_names": ["bfloat16"]})
    with pytest.raises(ValueError, match="'a'"):
        nccl_engine.parse_update_info(dict(ok, dtype_names=["bfloat17"]))
    with pytest.raises(ValueError, match="shapes has 2 entries"):
        nccl_engine.parse_update_info(dict(ok, shapes=[[1], [2]]))
    with pytest.raises(ValueError, match="rank_offset"):
        nccl_engine.parse_init_info({"master_address": "x", "master_port": 1, "rank_offset": 0, "world_size": 2})
    assert math.isclose(
        nccl_engine.parse_init_info(
            {"master_address": "x", "master_port": 1, "rank_offset": 1, "world_size": 2}
        ).timeout_seconds,
        60.0,
    )
