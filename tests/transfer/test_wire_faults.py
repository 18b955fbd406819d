"""A trainer that sends other bytes than the update info declares (issue 32): a named error on both sides, the
process alive, nothing lost, and the same group carries the next update.

Before the header check, these faults aborted the engine's process inside gloo ("Received data size doesn't
match expected size", exit 134) or were loaded silently. So every case runs in one spawned child process
(the trainer as rank 0 in a thread, the engine as rank 1 in the child's main thread, over one gloo group):
a child that dies fails the tests with its exit code instead of killing pytest.
"""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from tests.transfer.harness import free_port

BUCKET_BYTES = 6000  # several tensors per bucket, and tensors larger than a bucket
KEY = "model.layers.1.mlp.up_proj.weight"  # the tensor the faults touch
CHILD_SECONDS = 240.0


def _cases(good: list[tuple[str, torch.Tensor]]) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Case name -> the tensors the trainer sends (the engines' update info always declares ``good``)."""
    i = [n for n, _ in good].index(KEY)
    t = good[i][1]
    return {
        "float32 declared as bfloat16": good[:i] + [(KEY, t.float())] + good[i + 1 :],
        "middle tensor missing": good[:i] + good[i + 1 :],
        "last tensor missing": good[:-1],
        "one row short": good[:i] + [(KEY, t[:-1].clone())] + good[i + 1 :],
        "extra tensor in the middle": good[: i + 1] + [("model.layers.1.mlp.extra.weight", t.clone())] + good[i + 1 :],
        "extra tensor at the end": good + [("model.layers.1.mlp.extra.weight", t.clone())],
    }


def _child(ckpt_a: str, ckpt_b: str, port: int, results) -> None:
    """Runs every case; puts (case, packed, atomic, outcome dict) per case, then ("done", ...)."""
    import layerwise
    from layerwise.api import model_digest
    from layerwise.errors import ReloadError
    from layerwise.transfer import tensor_metadata, update_weights
    from layerwise.transfer.nccl import NCCLWeightTransferEngine
    from tests.transfer.harness import assert_same_tensors, checkpoint_tensors, group_in_threads

    info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}
    info["timeout_seconds"] = 30.0
    group, engine = group_in_threads(info)
    good = checkpoint_tensors(ckpt_b)
    expected = layerwise.load_model(ckpt_b, quantization="fp8")

    def run(sent, packed, atomic, verify=False, corrupt=None, info_changes=None):
        args = {"packed": packed, "packed_buffer_size_bytes": BUCKET_BYTES, "verify": verify, "group": group}
        update_info = dict(tensor_metadata(good), is_checkpoint_format=True, **args)
        del update_info["group"]
        update_info.update(info_changes or {})
        trainer_error = []

        def trainer():
            try:
                if corrupt is not None:
                    group.broadcast = corrupt
                NCCLWeightTransferEngine.trainer_send_weights(iter(sent), args)
            except Exception as e:  # noqa: BLE001 -- reported
                trainer_error.append(e)
            finally:
                group.__dict__.pop("broadcast", None)

        model = layerwise.load_model(ckpt_a, quantization="fp8")
        before = model_digest(model)
        thread = threading.Thread(target=trainer)
        thread.start()
        error = None
        try:
            update_weights(model, engine, {"update_info": update_info}, atomic=atomic)
        except ReloadError as e:
            error = e
        thread.join(30)
        outcome = {
            "error": None if error is None else type(error).__name__,
            "cause": type(error.__cause__).__name__ if error is not None and error.__cause__ else None,
            "message": str(error),
            "key": getattr(error, "key", None),
            "trainer_error": type(trainer_error[0]).__name__ if trainer_error else None,
            "trainer_message": str(trainer_error[0]) if trainer_error else "",
            "trainer_alive": thread.is_alive(),
            "unchanged": model_digest(model) == before,
            "updated_modules": None if error is None else list(error.updated_modules),
            "finite": bool(torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()),
        }
        # the next update, on the same group, with the right tensors: equals a fresh load
        args["verify"] = update_info["verify"] = False
        update_info = dict(tensor_metadata(good), is_checkpoint_format=True, packed=packed)
        update_info["packed_buffer_size_bytes"] = BUCKET_BYTES
        thread = threading.Thread(target=lambda: NCCLWeightTransferEngine.trainer_send_weights(iter(good), args))
        thread.start()
        update_weights(model, engine, {"update_info": update_info})
        thread.join(30)
        assert_same_tensors(model, expected)
        outcome["next_update_equal"] = True
        return outcome

    for case, sent in _cases(good).items():
        for packed in (False, True):
            results.put((case, packed, True, run(sent, packed, atomic=True)))
    results.put(("middle tensor missing", True, False, run(_cases(good)["middle tensor missing"], True, atomic=False)))
    real_broadcast = group.broadcast

    def corrupting(tensor, src, key):  # the bytes change in transit: the receiver gets one byte flipped
        if key == KEY or tensor.numel() > 4096:
            tensor = tensor.clone()
            tensor[tensor.numel() // 2] ^= 1
        return real_broadcast(tensor, src, key)

    results.put(("clean, verify", True, True, run(good, True, atomic=True, verify=True)))
    for packed in (False, True):
        outcome = run(_cases(good)["extra tensor at the end"], packed, atomic=True, verify=True)
        results.put(("extra tensor at the end, verify", packed, True, outcome))
    slots = {"packed_num_buffers": 3}
    results.put(("other buffers in flight, verify", True, True, run(good, True, True, True, info_changes=slots)))

    def failing():  # a trainer whose iterator raises after a few tensors (a gather that fails, say)
        yield from good[:5]
        raise RuntimeError("gather of model.layers.0.mlp failed")

    for packed in (False, True):
        results.put(("the trainer's iterator raises", packed, True, run(failing(), packed, atomic=True)))
    results.put(
        ("corrupted in transit, verify", True, True, run(good, True, atomic=True, verify=True, corrupt=corrupting))
    )
    results.put(
        ("corrupted in transit, verify", False, True, run(good, False, atomic=True, verify=True, corrupt=corrupting))
    )
    results.put(("done", None, None, None))
    engine.shutdown()
    group.shutdown()


@pytest.fixture(scope="module")
def outcomes(ckpts):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    child = ctx.Process(target=_child, args=(str(ckpts["a"]), str(ckpts["b"]), free_port(), results))
    child.start()
    out, deadline = {}, time.monotonic() + CHILD_SECONDS
    while time.monotonic() < deadline:
        try:
            case, packed, atomic, outcome = results.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():
                break  # died: the tests report its exit code
            continue
        if case == "done":
            break
        out[(case, packed, atomic)] = outcome
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        child.join(5)
    out["exitcode"] = child.exitcode
    return out


def _get(outcomes, case, packed, atomic=True):
    assert outcomes["exitcode"] == 0, f"the engine's process died (exit code {outcomes['exitcode']})"
    assert (case, packed, atomic) in outcomes, f"the child never finished {case!r}"
    return outcomes[(case, packed, atomic)]


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize(
    "case",
    [
        "float32 declared as bfloat16",
        "middle tensor missing",
        "last tensor missing",
        "one row short",
        "extra tensor in the middle",
        "extra tensor at the end",
    ],
)
def test_other_bytes_than_declared_is_a_named_error_and_nothing_changes(outcomes, case, packed):
    got = _get(outcomes, case, packed)
    assert got["error"] == "WeightTransferError", got
    assert got["key"] and got["key"] in got["message"], got
    assert "trainer" in got["message"] and "group stays in step" in got["message"], got["message"]
    assert got["trainer_error"] == "WeightTransferError" and not got["trainer_alive"], got
    assert got["unchanged"] and got["updated_modules"] == [], got  # atomic: nothing changed
    assert got["next_update_equal"]
    if case in ("float32 declared as bfloat16", "one row short"):
        assert got["key"] == KEY and "bytes" in got["message"]  # both sizes named
    if case.startswith("middle") or case.startswith("last"):
        assert "never sends" in got["message"] or "declares" in got["message"], got["message"]


def test_a_non_atomic_update_stopped_by_a_missing_tensor_lists_what_it_changed(outcomes):
    got = _get(outcomes, "middle tensor missing", True, atomic=False)
    assert got["error"] == "WeightTransferError" and got["key"] == KEY, got
    assert got["finite"] and not got["unchanged"] and got["updated_modules"], got
    assert all(not m.startswith("model.layers.1.mlp") for m in got["updated_modules"]), got["updated_modules"]


def test_verify_passes_clean_bytes(outcomes):
    got = _get(outcomes, "clean, verify", True)
    assert got["error"] is None and got["trainer_error"] is None, got


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_verify_catches_bytes_changed_in_transit(outcomes, packed):
    got = _get(outcomes, "corrupted in transit, verify", packed)
    assert got["error"] == "WeightTransferError" and "checksum" in got["message"], got
    assert got["trainer_error"] == "WeightTransferError" and "checksum" in got["trainer_message"], got
    assert got["unchanged"] and got["next_update_equal"], got


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_an_extra_tensor_at_the_end_with_verify_is_named_in_step(outcomes, packed):
    got = _get(outcomes, "extra tensor at the end, verify", packed)
    assert got["error"] == "WeightTransferError" and got["key"] == "model.layers.1.mlp.extra.weight", got
    assert got["trainer_error"] == "WeightTransferError" and got["unchanged"] and got["next_update_equal"], got


def test_other_buffers_in_flight_with_verify_is_a_named_error(outcomes):
    got = _get(outcomes, "other buffers in flight, verify", True)  # gloo aborted the process before
    assert got["error"] == "WeightTransferError" and "packed_num_buffers" in got["message"], got
    assert "packed_num_buffers" in got["trainer_message"] and got["unchanged"] and got["next_update_equal"], got


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_a_trainer_whose_iterator_raises_tells_the_engine(outcomes, packed):
    got = _get(outcomes, "the trainer's iterator raises", packed)
    assert got["error"] == "WeightTransferError" and "gave up" in got["message"], got
    assert "RuntimeError: gather of model.layers.0.mlp failed" in got["message"], got
    assert got["trainer_error"] == "RuntimeError" and not got["trainer_alive"], got
    assert got["unchanged"] and got["next_update_equal"], got
