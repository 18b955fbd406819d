"""layerwise/engine.py: what Engine.generate accepts, against a full recompute without the KV cache, and
weight updates between forward steps."""

import pytest
import torch

from layerwise.demo import greedy_tokens, write_checkpoint
from layerwise.engine import Engine
from layerwise.sampling_params import SamplingParams
from tests.engine_helpers import greedy
from tests.test_errors import TINY


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("engine") / "ckpt", TINY)
    return Engine.from_pretrained(path, max_batch_size=3, max_seq_len=24)


def test_prompt_forms_give_the_same_tokens(engine):
    """Token lists, vLLM's TokensPrompt dicts, a 2-D tensor and a single prompt: the same greedy tokens, equal to
    a full recompute without the cache."""
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6]]
    as_lists = greedy(engine, prompts, 5)
    assert as_lists == [greedy_tokens(engine.model, p, 5) for p in prompts]
    assert greedy(engine, torch.tensor(prompts, dtype=torch.int32), 5) == as_lists
    assert greedy(engine, [{"prompt_token_ids": p} for p in prompts], 5) == as_lists
    assert greedy(engine, prompts[1], 5) == as_lists[1:]
    assert engine.generate([]) == []


@pytest.mark.parametrize(
    "prompts,error,match",
    [
        ([[1.5, 2]], TypeError, "prompt 0"),
        ("abc", ValueError, "tokenizer"),  # no tokenizer in this checkpoint
        (torch.ones(2, 3), ValueError, "2-D integer"),
        ([[1, 64]], ValueError, "token id 64"),
        ([[1], []], ValueError, "prompt 1 is empty"),
        ([[1] * 24], ValueError, "max_seq_len"),
        ([{"tokens": [1]}], ValueError, "prompt_token_ids"),
    ],
)
def test_bad_prompts_are_clear_errors(engine, prompts, error, match):
    with pytest.raises(error, match=match):
        engine.generate(prompts, SamplingParams(max_tokens=5))
    assert greedy(engine, [[1, 2]], 2) == [greedy_tokens(engine.model, [1, 2], 2)]  # still usable


def test_an_update_while_generating_waits_for_the_current_step(tmp_path, monkeypatch):
    """A generating thread and reloads in the main thread: no forward step ever runs while weights are
    being written, and after the last reload the engine generates what a fresh engine on B does."""
    import threading
    import time

    import layerwise.engine

    a = write_checkpoint(tmp_path / "a", TINY, seed=0)
    b = write_checkpoint(tmp_path / "b", TINY, seed=1)
    engine = Engine.from_pretrained(a, max_batch_size=2, max_seq_len=24)
    writing, overlaps, steps = threading.Event(), [], []
    real_reload = layerwise.engine.reload_weights

    def reload_and_flag(*args, **kwargs):
        writing.set()
        try:
            return real_reload(*args, **kwargs)
        finally:
            writing.clear()

    monkeypatch.setattr(layerwise.engine, "reload_weights", reload_and_flag)

    total_steps = [0]

    def check(module, inputs):
        steps.append(1)
        total_steps[0] += 1
        if writing.is_set():
            overlaps.append(len(steps))

    hook = engine.model.model.register_forward_pre_hook(check)  # the decoder stack every prefill and decode runs
    stop = threading.Event()
    errors = []

    def generate_forever():
        try:
            while not stop.is_set():
                greedy(engine, [[1, 2, 3], [4, 5]], 12)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    thread = threading.Thread(target=generate_forever, daemon=True)
    thread.start()
    try:
        for path in (b, a, b, a, b):
            deadline = time.monotonic() + 30
            while len(steps) < 5 and time.monotonic() < deadline:  # let the generator run between updates
                time.sleep(0.001)
            steps.clear()
            engine.reload_weights(path)
    finally:
        stop.set()
        thread.join(timeout=60)
        hook.remove()
    assert not thread.is_alive() and not errors
    assert overlaps == [] and total_steps[0] >= 25  # the generator ran between every pair of updates
    fresh = Engine.from_pretrained(b, max_batch_size=2, max_seq_len=24)
    assert greedy(engine, [[1, 2, 3]], 6) == greedy(fresh, [[1, 2, 3]], 6)


def test_start_weight_update_holds_generation_until_finish(tmp_path):
    import threading

    a = write_checkpoint(tmp_path / "a", TINY, seed=0)
    b = write_checkpoint(tmp_path / "b", TINY, seed=1)
    engine = Engine.from_pretrained(a, max_batch_size=1, max_seq_len=24)
    update = engine.start_weight_update(is_checkpoint_format=True)
    result = []
    thread = threading.Thread(target=lambda: result.append(greedy(engine, [[1, 2, 3]], 4)), daemon=True)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive() and not result  # waiting for the update
    from layerwise.checkpoint import Checkpoint

    update.load_weights(list(Checkpoint(b)))
    report = engine.finish_weight_update()
    thread.join(timeout=60)
    assert result and "model.layers.1.mlp.gate_up_proj" in report.updated_modules
    fresh = Engine.from_pretrained(b, max_batch_size=1, max_seq_len=24)
    assert result[0] == greedy(fresh, [[1, 2, 3]], 4)


def test_the_thread_that_opened_an_update_gets_an_error_not_a_deadlock(tmp_path):
    a = write_checkpoint(tmp_path / "a", TINY, seed=0)
    engine = Engine.from_pretrained(a, max_batch_size=1, max_seq_len=24)
    engine.start_weight_update(is_checkpoint_format=True)
    for call in (
        lambda: greedy(engine, [[1, 2]], 2),
        lambda: engine.reload_weights(a),
        lambda: engine.start_weight_update(),
    ):
        with pytest.raises(RuntimeError, match="finish_weight_update"):
            call()
    engine.abort_weight_update()
    assert len(greedy(engine, [[1, 2]], 2)[0]) == 2  # usable again
