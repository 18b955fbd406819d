"""Engine.generate as a rollout engine, against independent references: transformers' greedy ``generate`` and a
teacher-forced transformers forward for log-probabilities (float32 models), a fresh engine for weight updates."""

import pytest
import torch

import layerwise
from layerwise.engine import Engine
from layerwise.sampling_params import SamplingParams
from tests.engine_helpers import greedy
from tests.hf_checkpoints import write_hf_checkpoint

# mixed lengths, more prompts than the small engine's 3 slots
PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 1, 4, 4, 6, 9, 10, 2, 3, 11, 7], [12, 13, 14], [6, 2], [9, 9, 9, 9, 9, 9, 9, 9]]
MAX_TOKENS = [6, 3, 9, 1, 7, 4]  # different lengths: sequences finish at different steps and free slots mid-run


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("generate") / "qwen3", "Qwen3ForCausalLM")


@pytest.fixture(scope="module")
def hf(ckpt):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine.from_pretrained(ckpt, max_batch_size=3, max_seq_len=40, quantization=None, dtype=torch.float32)


def hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def hf_logprobs(hf, tokens):
    """float32 log_softmax of transformers' logits over ``tokens`` [T] -> [T, vocab] (row t predicts token t + 1)."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)


@pytest.mark.parametrize("slots", [3, 8])
def test_greedy_equals_transformers_generate(ckpt, hf, slots):
    """Temperature 0 on a float32 model: every prompt's tokens equal transformers' greedy generate, whether the
    prompts fit the slots at once (8) or wait for finished sequences to free theirs (3)."""
    engine = Engine.from_pretrained(ckpt, max_batch_size=slots, max_seq_len=40, quantization=None, dtype=torch.float32)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS]
    outputs = engine.generate(PROMPTS, params)
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        assert out.prompt_token_ids == prompt and out.finished
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n), prompt
        assert out.outputs[0].finish_reason == "length"


def test_logprobs_equal_a_teacher_forced_transformers_forward(engine, hf):
    """Sampled tokens' log-probabilities, their ranks and the top-k, and the prompt's, equal log_softmax of
    transformers' float32 logits over prompt + generated tokens within 1e-4."""
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=11, logprobs=3, prompt_logprobs=2, n=2)
    outputs = engine.generate(PROMPTS[:4], params)
    for prompt, out in zip(PROMPTS[:4], outputs, strict=True):
        for completion in out.outputs:
            tokens = completion.token_ids
            reference = hf_logprobs(hf, prompt + tokens)
            assert len(completion.logprobs) == len(tokens) == 5
            total = 0.0
            for j, (token, entry) in enumerate(zip(tokens, completion.logprobs, strict=True)):
                row = reference[len(prompt) - 1 + j]
                assert abs(entry[token].logprob - row[token].item()) < 1e-4
                # rank: 1 + the tokens at least as likely; a token within 1e-4 of it may fall either side
                assert (
                    int((row > row[token] + 1e-4).sum()) + 1
                    <= entry[token].rank
                    <= int((row >= row[token] - 1e-4).sum())
                )
                top = row.topk(3)
                assert set(entry) == {token, *top.indices.tolist()}
                for rank, (tid, value) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True)):
                    assert abs(entry[tid].logprob - value) < 1e-4
                    if tid != token:
                        assert entry[tid].rank == rank + 1
                total += row[token].item()
            assert abs(completion.cumulative_logprob - total) < 1e-3
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        reference = hf_logprobs(hf, prompt)
        for t in range(1, len(prompt)):
            entry, row = out.prompt_logprobs[t], reference[t - 1]
            assert abs(entry[prompt[t]].logprob - row[prompt[t]].item()) < 1e-4
            assert set(entry) == {prompt[t], *row.topk(2).indices.tolist()}


def test_no_logprobs_unless_asked(engine):
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=2, seed=0))[0]
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert len(engine.generate(PROMPTS[0], SamplingParams(max_tokens=3, logprobs=0))[0].outputs[0].logprobs[0]) == 1


def test_a_seed_gives_the_same_tokens_alone_and_in_any_batch(engine):
    seeded = SamplingParams(temperature=1.0, max_tokens=8, seed=1234)
    alone = engine.generate([PROMPTS[2]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, top_k=5, max_tokens=n) for n in (3, 8, 5, 2)]
    batched = engine.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[3], PROMPTS[4]], [*others[:2], seeded, *others[2:]]
    )
    assert batched[2].outputs[0].token_ids == alone
    assert (
        engine.generate([PROMPTS[2]], SamplingParams(temperature=1.0, max_tokens=8, seed=4321))[0].outputs[0].token_ids
        != alone
    )
    # n completions: completion i samples with seed + i (vLLM's child requests), from one prefill
    group = engine.generate([PROMPTS[2]], SamplingParams(temperature=1.0, max_tokens=8, seed=1233, n=3))[0]
    assert [c.index for c in group.outputs] == [0, 1, 2]
    assert group.outputs[1].token_ids == alone


def test_n_greedy_completions_share_the_prompt_cache(engine, hf):
    out = engine.generate([PROMPTS[0], PROMPTS[3]], SamplingParams(temperature=0, max_tokens=4, n=2))
    for prompt, request in zip([PROMPTS[0], PROMPTS[3]], out, strict=True):
        assert [c.token_ids for c in request.outputs] == [hf_greedy(hf, prompt, 4)] * 2


class _EosTokenizer:
    """Stands in for a tokenizer whose eos_token_id is ``eos`` (token-id prompts: nothing else is used)."""

    def __init__(self, eos):
        self.eos_token_id = eos

    def decode(self, ids, skip_special_tokens=True):
        return ""


def test_eos_and_stop_ids_stop_a_sequence(ckpt):
    """vLLM's stop rules: the tokenizer's EOS stops with stop_reason None, the checkpoint's other EOS ids and the
    request's stop ids with their id, ignore_eos turns EOS off, max_tokens and the context end give "length"."""
    plain = Engine.from_pretrained(ckpt, max_batch_size=2, max_seq_len=40, quantization=None, dtype=torch.float32)
    prompt = PROMPTS[0]
    free = greedy(plain, [prompt], 10)[0]
    eos, stop = free[3], free[5]
    first_eos, first_stop = free.index(eos), free.index(stop)
    greedy10 = SamplingParams(temperature=0, max_tokens=10)
    for tokenizer, reason in ((_EosTokenizer(eos), None), (None, eos)):  # tokenizer's EOS, or a checkpoint EOS id
        engine = Engine(plain.model, max_batch_size=2, max_seq_len=40, tokenizer=tokenizer, eos_token_ids=[eos, 127])
        out = engine.generate(
            [prompt, prompt], [greedy10, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
        )
        stopped, ignored = out[0].outputs[0], out[1].outputs[0]
        assert stopped.token_ids == free[: first_eos + 1] and stopped.finish_reason == "stop"
        assert stopped.stop_reason == reason
        assert ignored.token_ids == free and ignored.finish_reason == "length"
    by_id = engine.generate(
        prompt, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop], ignore_eos=True)
    )
    completion = by_id[0].outputs[0]
    assert completion.token_ids == free[: first_stop + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    # max_tokens=None: until the context is full
    until_full = plain.generate(prompt, SamplingParams(temperature=0, max_tokens=None))[0].outputs[0]
    assert len(until_full.token_ids) == 40 - len(prompt) and until_full.finish_reason == "length"


def test_eos_ids_come_from_the_checkpoint(tmp_path):
    from tests.hf_checkpoints import add_text_files

    path = write_hf_checkpoint(tmp_path / "c", "Qwen3ForCausalLM")
    add_text_files(path, tokenizer=False, eos_token_ids=[7, 9])
    assert Engine.from_pretrained(path, max_batch_size=1, max_seq_len=16).eos_token_ids == {7, 9}


def test_generate_update_generate_equals_a_fresh_engine(tmp_path):
    """The RL loop: generate with logprobs, push new BF16 weights through update_weights, generate again: the
    same tokens and log-probabilities as a fresh FP8 engine loaded from the new weights; engine buffers and
    weights keep their addresses (what a captured CUDA graph reads)."""
    from tests.transfer.harness import checkpoint_tensors
    from tests.transfer.test_update import LoopbackEngine, request

    a = write_hf_checkpoint(tmp_path / "a", "Qwen3ForCausalLM", seed=0)
    b = write_hf_checkpoint(tmp_path / "b", "Qwen3ForCausalLM", seed=1)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=3, logprobs=2, n=2)
    engine = Engine.from_pretrained(a, max_batch_size=3, max_seq_len=32, quantization="fp8")
    before = engine.generate(PROMPTS, params)
    buffers = [t.data_ptr() for kv in engine.kv_caches for t in kv] + [engine.runner._ids.data_ptr()]
    weights = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    tensors = checkpoint_tensors(b)
    engine.transfer_engine = LoopbackEngine(tensors)
    engine.update_weights({"update_info": request(tensors).update_info})
    after = engine.generate(PROMPTS, params)
    fresh = Engine.from_pretrained(b, max_batch_size=3, max_seq_len=32, quantization="fp8").generate(PROMPTS, params)

    def flat(outputs):
        return [
            (c.token_ids, [{t: lp.logprob for t, lp in e.items()} for e in c.logprobs])
            for o in outputs
            for c in o.outputs
        ]

    assert flat(after) == flat(fresh) and flat(after) != flat(before)
    assert [t.data_ptr() for kv in engine.kv_caches for t in kv] + [engine.runner._ids.data_ptr()] == buffers
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == weights


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -2}, "logprobs"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_bad_requests_leave_the_engine_usable(engine, hf):
    for prompts, params, match in [
        ([[1, 2], []], SamplingParams(), "prompt 1 is empty"),
        ([[1, 128]], SamplingParams(), "token id 128"),
        ([[1] * 40], SamplingParams(), "max_seq_len"),
        ([[1]], SamplingParams(n=4), "n=4"),
        ([[1], [2]], [SamplingParams()], "sampling_params"),
    ]:
        with pytest.raises(ValueError, match=match):
            engine.generate(prompts, params)
    assert greedy(engine, [PROMPTS[0]], 3) == [hf_greedy(hf, PROMPTS[0], 3)]


def test_vllm_defaults_and_names():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens, p.logprobs) == (1, 1.0, 1.0, 0, 0.0, 16, None)
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(temperature=0).greedy
    assert layerwise.SamplingParams is SamplingParams and layerwise.RequestOutput.__name__ == "RequestOutput"
    # vLLM fields this engine does not implement: accepted at their do-nothing values, refused otherwise
    noop = dict(min_tokens=0, presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1.0, stop=[], best_of=1)
    assert SamplingParams(**noop).clone() == SamplingParams(**noop)
    for name, value in [("min_tokens", 4), ("stop", ["\n"]), ("repetition_penalty", 1.1), ("best_of", 4)]:
        with pytest.raises(ValueError, match=rf"^{name}="):
            SamplingParams(**{name: value})
    with pytest.raises(TypeError):
        SamplingParams(use_beam_search=True)  # not a vLLM SamplingParams field either
    with pytest.raises(ValueError, match="^seed"):
        SamplingParams(seed=2**64 - 1, n=2)  # completion 1 would need seed 2**64


def test_the_padded_graph_path_gives_transformers_tokens(ckpt, hf):
    """The CUDA-graph decode path on the CPU: each step padded up to a capture size over the full-length cache, the
    replay stood in for by the same step run eagerly into the graph's output buffer (what replay computes)."""
    from types import SimpleNamespace

    engine = Engine.from_pretrained(ckpt, max_batch_size=8, max_seq_len=40, quantization=None, dtype=torch.float32)
    runner = engine.runner

    def capture(size):
        out = runner._graph_logits[size] = runner._step(size, runner.max_seq_len)
        runner.graphs[size] = SimpleNamespace(replay=lambda: out.copy_(runner._step(size, runner.max_seq_len)))
        runner.captures += 1

    runner.use_cuda_graph, runner._capture = True, capture
    outputs = engine.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n) for n in MAX_TOKENS])
    for prompt, n, out in zip(PROMPTS, MAX_TOKENS, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, prompt, n), prompt
    assert set(engine.graphs) <= {1, 2, 4, 8} and 8 in engine.graphs and len(engine.graphs) >= 2


def test_an_unfinished_stream_blocks_a_second_generation_in_its_thread(engine, hf):
    stream = engine.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    first = next(stream)
    assert len(first.outputs[0].token_ids) == 1 and not first.finished
    with pytest.raises(RuntimeError, match="already generating"):
        engine.generate(PROMPTS[1], SamplingParams(max_tokens=2))
    *_, last = stream
    assert last.finished and last.outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 4)
    assert len(engine.generate(PROMPTS[1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    abandoned = engine.stream(PROMPTS[0], SamplingParams(max_tokens=4))
    next(abandoned)
    abandoned.close()  # closing (or dropping) a stream ends its generation
    assert len(engine.generate(PROMPTS[1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2
    assert len(engine.generate(PROMPTS[1], SamplingParams(max_tokens=1, logprobs=500))[0].outputs[0].logprobs[0]) == 128
    assert len(engine.generate(PROMPTS[1], SamplingParams(max_tokens=1, logprobs=-1))[0].outputs[0].logprobs[0]) == 128


def test_a_weight_update_opened_between_stream_steps_is_an_error_not_a_deadlock(engine):
    stream = engine.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))
    next(stream)
    engine.start_weight_update(is_checkpoint_format=True)
    try:
        with pytest.raises(RuntimeError, match="finish_weight_update"):
            next(stream)
        with pytest.raises(RuntimeError, match="finish_weight_update"):
            engine.decode(torch.ones(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long))
    finally:
        engine.abort_weight_update()
    assert len(engine.generate(PROMPTS[1], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_request_ids_count_up_across_calls_and_old_calls_get_a_clear_error(engine):
    first = [out.request_id for out in engine.generate(PROMPTS[:2], SamplingParams(max_tokens=1))]
    second = [out.request_id for out in engine.generate(PROMPTS[:2], SamplingParams(max_tokens=1))]
    assert int(second[0]) == int(first[1]) + 1 and len(set(first + second)) == 4
    with pytest.raises(TypeError, match="max_tokens"):
        engine.generate(PROMPTS[:2], 16)  # the old generate(prompts, max_new_tokens)
    with pytest.raises(ValueError, match="one prompt"):
        engine.stream(PROMPTS[:2], SamplingParams(max_tokens=1))
