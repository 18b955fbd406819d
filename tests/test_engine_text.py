"""Text in and out of the engine: the checkpoint's tokenizer (transformers' AutoTokenizer as the reference) for
string prompts, ``text`` outputs, decoded logprob tokens and ``Engine.chat``; clear errors without one."""

import importlib.util

import pytest

from layerwise.engine import Engine
from layerwise.sampling_params import SamplingParams
from tests.hf_checkpoints import add_text_files, write_hf_checkpoint

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = write_hf_checkpoint(tmp_path_factory.mktemp("text") / "qwen3", "Qwen3ForCausalLM", vocab=640)
    add_text_files(path)
    return path


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def engine(ckpt):
    return Engine.from_pretrained(ckpt, max_batch_size=2, max_seq_len=64)


def test_string_prompts_and_text_outputs(engine, tokenizer):
    text = "The quick brown fox, naïve café 🦊"
    ids = tokenizer(text).input_ids
    by_text, by_ids = engine.generate([text, ids], GREEDY)
    assert by_text.prompt == text and by_text.prompt_token_ids == ids and by_ids.prompt is None
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids
    out = by_text.outputs[0]
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert engine.generate({"prompt": text}, GREEDY)[0].outputs[0].token_ids == out.token_ids


def test_logprob_entries_carry_the_token_text(engine, tokenizer):
    out = engine.generate("hello", SamplingParams(max_tokens=3, seed=0, logprobs=2))[0].outputs[0]
    for entry in out.logprobs:
        assert all(lp.decoded_token == tokenizer.decode([tid]) for tid, lp in entry.items())


def test_chat_renders_the_checkpoint_template(engine, tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (one,) = engine.chat(messages, GREEDY)
    assert one.prompt == rendered and rendered.endswith("<|im_start|>assistant\n")
    assert one.prompt_token_ids == tokenizer(rendered, add_special_tokens=False).input_ids
    assert one.outputs[0].token_ids == engine.generate([one.prompt_token_ids], GREEDY)[0].outputs[0].token_ids
    two = engine.chat([messages, messages[1:]], GREEDY)
    assert len(two) == 2 and two[0].outputs[0].token_ids == one.outputs[0].token_ids


def test_the_checkpoint_eos_stops_a_completion(ckpt, tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    plain = Engine.from_pretrained(ckpt, max_batch_size=1, max_seq_len=64, tokenizer=False)
    free = plain.generate([tokenizer("hello").input_ids], GREEDY)
    first = free[0].outputs[0].token_ids[2]
    add_text_files(ckpt, tokenizer=False, eos_token_ids=[first, eos])
    try:
        engine = Engine.from_pretrained(ckpt, max_batch_size=1, max_seq_len=64)
        out = engine.generate("hello", SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == first
    finally:
        add_text_files(ckpt, tokenizer=False, eos_token_ids=[])


def test_no_tokenizer_means_token_ids_only(ckpt, tmp_path, monkeypatch):
    engine = Engine.from_pretrained(ckpt, max_batch_size=1, max_seq_len=64, tokenizer=False)
    with pytest.raises(ValueError, match=r"\[text\]"):
        engine.generate("hello", GREEDY)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.chat([{"role": "user", "content": "hi"}], GREEDY)
    assert engine.generate([[1, 2, 3]], GREEDY)[0].outputs[0].text == ""
    # a checkpoint with a tokenizer, but transformers not installed: an engine of token ids, and the error says so
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a)
    )
    engine = Engine.from_pretrained(ckpt, max_batch_size=1, max_seq_len=64)
    assert engine.tokenizer is None
    with pytest.raises(ValueError, match="has a tokenizer, but transformers is not installed"):
        engine.generate("hello", GREEDY)
    assert len(engine.generate([[1, 2]], GREEDY)[0].outputs[0].token_ids) == 6
