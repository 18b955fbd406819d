"""layerwise/engine.py: which weights made a rollout (Engine.weight_version, RequestOutput.weight_versions,
CompletionOutput.token_weight_versions) and updates that wait for the generation in flight (wait_for_generate).

Every wait on another thread is bounded (joins and polls with a timeout), so a broken lock fails a test instead of
hanging it."""

import threading
import time

import pytest
import torch

import layerwise.transfer
from layerwise.demo import greedy_tokens
from layerwise.engine import Engine
from layerwise.errors import ReloadError
from layerwise.sampling_params import SamplingParams
from tests.transfer.harness import checkpoint_tensors
from tests.transfer.test_update import LoopbackEngine, request

WAIT = 30.0  # seconds: bound on every wait for another thread
PROMPT, N = [7, 3, 9, 2], 10  # greedy tokens of the 3-layer Qwen3 pair: A and B disagree after the third token
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def engine_on(path) -> Engine:
    return Engine.from_pretrained(path, max_batch_size=2, max_seq_len=32)


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not predicate():
        assert time.monotonic() < deadline, f"waited {WAIT} s for {what}"
        time.sleep(0.001)


def run_in_thread(fn) -> tuple[threading.Thread, list, list]:
    """Start ``fn`` in a daemon thread; returns it with the lists its result or error lands in."""
    results, errors = [], []

    def target():
        try:
            results.append(fn())
        except BaseException as e:  # surfaced by the test
            errors.append(e)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, results, errors


def joined(thread: threading.Thread) -> bool:
    thread.join(timeout=WAIT)
    return not thread.is_alive()


def switched_reference(a, b, prompt: list[int], n: int, switch: int) -> list[int]:
    """Greedy tokens built one ``Engine.decode`` step at a time, without generate: the prompt's keys and values cached
    by A, tokens 0..switch-1 drawn from A's steps, then ``reload_weights(B)`` and the later tokens drawn from B's
    steps over that same cache."""
    engine = engine_on(a)
    for position, token in enumerate(prompt):
        logits = engine.decode(torch.tensor([[token]]), torch.tensor([[position]]))
    out = [int(logits[0].argmax())]
    for i in range(1, n):
        if i == switch:
            engine.reload_weights(b)
        logits = engine.decode(torch.tensor([[out[-1]]]), torch.tensor([[len(prompt) + i - 1]]))
        out.append(int(logits[0].argmax()))
    return out


def nan_last(path) -> list:
    """The checkpoint's tensors, the last one NaN: a stream that fails after writing the modules before it."""
    tensors = checkpoint_tensors(path)
    name, last = tensors[-1]
    return tensors[:-1] + [(name, torch.full_like(last, float("nan")))]


def test_versions_count_completed_updates_only(qwen3_pair):
    """0 after load; +1 per completed reload, update_weights (the engine's and layerwise.transfer's) and
    finish_weight_update; a failed atomic reload and an abort that wrote nothing leave it; a non-atomic failure that
    overwrote modules counts (the weights did change). Outputs carry the version they ran with."""
    a, b = qwen3_pair
    engine = engine_on(a)
    assert engine.weight_version == 0
    out = engine.generate([PROMPT], GREEDY)[0]
    assert out.weight_versions == [0] and out.outputs[0].token_weight_versions == [0] * N

    engine.reload_weights(b)
    assert engine.weight_version == 1
    with pytest.raises(ReloadError) as failed:
        engine.reload_weights(nan_last(a), atomic=True)
    assert failed.value.updated_modules == [] and engine.weight_version == 1
    with pytest.raises(ReloadError) as failed:
        engine.reload_weights(nan_last(a))
    assert failed.value.updated_modules and engine.weight_version == 2  # part of A is in: a new version

    tensors = checkpoint_tensors(b)
    engine.transfer_engine = LoopbackEngine(tensors)
    engine.update_weights(request(tensors), wait_for_generate=True)  # nothing generating: no wait
    assert engine.weight_version == 3
    layerwise.transfer.update_weights(engine, LoopbackEngine(tensors), request(tensors))  # takes the engine's lock
    assert engine.weight_version == 4

    engine.start_weight_update(atomic=True).load_weights(tensors)
    assert engine.abort_weight_update() == [] and engine.weight_version == 4  # staged, never written
    engine.start_weight_update().load_weights(tensors)
    engine.finish_weight_update()
    assert engine.weight_version == 5
    update = engine.start_weight_update()
    with pytest.raises(ReloadError) as failed:
        update.load_weights(nan_last(a))  # closes the update; the engine holds its lock until abort or finish
    engine.abort_weight_update()
    assert failed.value.updated_modules and engine.weight_version == 6
    engine.reload_weights(b)
    assert engine.weight_version == 7

    out = engine.generate([PROMPT, PROMPT[:2]], [GREEDY, SamplingParams(n=2, max_tokens=N, seed=0)])
    assert [o.weight_versions for o in out] == [[7], [7]]
    assert [c.token_weight_versions for o in out for c in o.outputs] == [[7] * N] * 3  # one per token, each completion
    assert out[0].outputs[0].token_ids == greedy_tokens(engine_on(b).model, PROMPT, N)


def test_an_update_landing_mid_generate_is_recorded_per_token(qwen3_pair):
    """A reload requested during the third forward step lands before the fourth: the output reports versions [0, 1],
    its first three tokens are A's (a full recompute on A agrees) and the rest equal a step-by-step reference that
    switches to B at the fourth token (and not one that switches a step earlier or later)."""
    a, b = qwen3_pair
    engine = engine_on(a)
    steps, updater = [0], []

    def land_an_update_after_step_3(module, inputs):
        steps[0] += 1
        if steps[0] == 3:  # this step holds the weights lock: the reload waits, and goes ahead of step 4
            updater.append(run_in_thread(lambda: engine.reload_weights(b)))
            wait_until(lambda: engine._updates_waiting == 1, "the reload to wait for the weights lock")

    hook = engine.model.model.register_forward_pre_hook(land_an_update_after_step_3)
    try:
        out = engine.generate([PROMPT], GREEDY)[0]
    finally:
        hook.remove()
    thread, _, errors = updater[0]
    assert joined(thread) and not errors

    tokens, versions = out.outputs[0].token_ids, out.outputs[0].token_weight_versions
    assert out.weight_versions == [0, 1] and engine.weight_version == 1
    assert versions == [0] * 3 + [1] * (N - 3)
    assert tokens[:3] == greedy_tokens(engine_on(a).model, PROMPT, 3)
    assert tokens == switched_reference(a, b, PROMPT, N, switch=3)
    assert tokens not in (switched_reference(a, b, PROMPT, N, switch=2), switched_reference(a, b, PROMPT, N, switch=4))


def test_a_stream_records_an_update_between_its_yields(qwen3_pair):
    """Without wait_for_generate an update lands between a stream's steps, also from the stream's own thread, and
    each yielded output says so."""
    a, b = qwen3_pair
    engine = engine_on(a)
    stream = engine.stream(PROMPT, GREEDY)
    first = [next(stream) for _ in range(3)]
    assert [o.weight_versions for o in first] == [[0]] * 3
    assert first[-1].outputs[0].token_weight_versions == [0, 0, 0]
    engine.reload_weights(b)
    outputs = list(stream)
    assert outputs[0].weight_versions == [0, 1] and outputs[-1].finished
    assert outputs[-1].outputs[0].token_weight_versions == [0] * 3 + [1] * (N - 3)
    assert outputs[-1].outputs[0].token_ids == switched_reference(a, b, PROMPT, N, switch=3)


def test_wait_for_generate_waits_for_the_stream_and_goes_before_later_generations(qwen3_pair):
    """An update with wait_for_generate=True from another thread waits for a stream in flight (every token of it
    from A, one version); the generate the streaming thread starts as soon as the stream ends (a loop of rollouts)
    does not run ahead of it: it waits, and runs on B."""
    a, b = qwen3_pair
    on_a, on_b = greedy_tokens(engine_on(a).model, PROMPT, N), greedy_tokens(engine_on(b).model, PROMPT, N)
    engine = engine_on(a)
    stream = engine.stream(PROMPT, GREEDY)
    head = [next(stream) for _ in range(3)]  # the stream owns the engine between its yields
    updating, _, errors = run_in_thread(lambda: engine.reload_weights(b, wait_for_generate=True))
    wait_until(lambda: engine._updates_waiting_for_generations == 1, "the update to wait for the stream")
    updating.join(timeout=0.1)
    assert updating.is_alive() and engine.weight_version == 0

    last = list(stream)[-1]  # runs to its end on A
    again = engine.generate([PROMPT], GREEDY)[0]  # at once, while the update has yet to wake up
    assert joined(updating) and not errors and engine.weight_version == 1
    assert head[-1].weight_versions == [0] and last.weight_versions == [0]
    assert last.outputs[0].token_weight_versions == [0] * N and last.outputs[0].token_ids == on_a
    assert again.weight_versions == [1] and again.outputs[0].token_ids == on_b


def test_wait_for_generate_from_the_streaming_thread_raises(qwen3_pair):
    """The thread whose stream holds the engine would wait for itself: each way to ask is a RuntimeError, nothing
    changes, and the stream goes on; once it is closed the same call waits for nothing."""
    a, b = qwen3_pair
    engine = engine_on(a)
    stream = engine.stream(PROMPT, GREEDY)
    next(stream)
    tensors = checkpoint_tensors(b)
    engine.transfer_engine = LoopbackEngine(tensors)
    bounded = dict(wait_for_generate=True, wait_timeout=1.0)  # a TimeoutError, not a hang, if it waited for itself
    for call in (
        lambda: engine.reload_weights(b, **bounded),
        lambda: engine.update_weights(request(tensors), **bounded),
        lambda: engine.start_weight_update(**bounded),
    ):
        with pytest.raises(RuntimeError, match="stream"):
            call()
    with pytest.raises(RuntimeError, match="stream"), engine.weight_update_lock(**bounded):
        pass
    assert engine.weight_version == 0
    assert next(stream).outputs[0].token_weight_versions == [0, 0]
    stream.close()
    engine.reload_weights(b, wait_for_generate=True)
    assert engine.weight_version == 1


def test_wait_timeout_gives_up_and_lets_generations_start(qwen3_pair):
    """An update that waits longer than wait_timeout raises TimeoutError, changes nothing, and no longer holds off
    generations."""
    a, b = qwen3_pair
    engine = engine_on(a)
    stream = engine.stream(PROMPT, GREEDY)
    next(stream)
    thread, _, errors = run_in_thread(lambda: engine.reload_weights(b, wait_for_generate=True, wait_timeout=0.1))
    assert joined(thread) and len(errors) == 1 and isinstance(errors[0], TimeoutError)
    assert engine.weight_version == 0 and engine._updates_waiting_for_generations == 0
    stream.close()
    assert engine.generate([PROMPT], GREEDY)[0].weight_versions == [0]
    with pytest.raises(ValueError, match="wait_timeout"):
        engine.reload_weights(b, wait_timeout=-1)
