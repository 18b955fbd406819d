"""Real text (layerwise.texts), the GGUF reader of benchmarks/real_checkpoint.py, and the real trained checkpoint
(SmolLM2-135M-Instruct converted to BF16) where it has been fetched; nothing is downloaded here."""

import json
import struct

import numpy as np
import pytest
import torch

import layerwise
from layerwise import texts
from layerwise.benchmarks import real_checkpoint as rc
from tests.hf_checkpoints import hf_logits, sqnr_db

# --- layerwise.texts ---------------------------------------------------------------------------------------------


def test_real_text_is_the_body_without_the_header():
    text = texts.real_text()
    assert text.startswith("Chapter 1\n")
    assert "It is a truth universally acknowledged" in text
    assert 30_000 < len(text.encode()) < 60_000


def test_prompts_are_deterministic_and_start_sentences():
    first = texts.prompts(16)
    assert first == texts.prompts(16)
    assert len(first) == 16 and len(set(first)) == 16
    assert texts.prompts(16, seed=1) != first
    for prompt in first:
        assert len(prompt.split(" ")) == 24 and prompt.strip() == prompt and "_" not in prompt
        assert prompt.lstrip("\"'(")[0].isupper(), prompt
    assert [len(p.split()) for p in texts.prompts(3, words=5)] == [5, 5, 5]
    with pytest.raises(ValueError, match="sentence starts"):
        texts.prompts(10_000)
    with pytest.raises(ValueError):
        texts.prompts(0)


def test_prompts_do_not_split_at_a_title():
    # "Mr. Bennet" is one sentence; no prompt starts with the name after a title's full stop
    assert not any(p.startswith("Bennet") for p in texts.prompts(400, words=3))


# --- the GGUF reader ----------------------------------------------------------------------------------------------


def _gguf_string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _write_gguf(path, metadata: dict, tensors: list[tuple[str, int, tuple, bytes]]) -> None:
    """A GGUF v3 file: metadata of str / int (uint32) / float (float32) / list of str, tensors already encoded."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), len(metadata))]
    for key, value in metadata.items():
        out.append(_gguf_string(key))
        if isinstance(value, str):
            out.append(struct.pack("<I", 8) + _gguf_string(value))
        elif isinstance(value, int):
            out.append(struct.pack("<II", 4, value))
        elif isinstance(value, float):
            out.append(struct.pack("<If", 6, value))
        else:
            out.append(struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_gguf_string(v) for v in value))
    offset, data = 0, b""
    for name, kind, dims, raw in tensors:
        out.append(_gguf_string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims))
        out.append(struct.pack("<IQ", kind, offset))
        data += raw + b"\0" * (-len(raw) % 32)
        offset = len(data)
    header = b"".join(out)
    path.write_bytes(header + b"\0" * (-len(header) % 32) + data)


def test_gguf_reader_dequantizes_q4_1_q8_0_and_f32(tmp_path):
    rng = np.random.default_rng(0)
    # Q4_1, 2 rows of 32: d, m (f16), then 16 bytes; low nibbles are elements 0-15, high nibbles 16-31
    q4 = rng.integers(0, 16, size=(2, 32))
    d4, m4 = np.float16([0.5, 0.25]), np.float16([-1.0, 2.0])
    q4_raw = b"".join(
        d4[r : r + 1].tobytes() + m4[r : r + 1].tobytes() + (q4[r, :16] | (q4[r, 16:] << 4)).astype(np.uint8).tobytes()
        for r in range(2)
    )
    q8 = rng.integers(-128, 128, size=(1, 32))
    q8_raw = np.float16([0.125]).tobytes() + q8.astype(np.int8).tobytes()
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    path = tmp_path / "tiny.gguf"
    meta = {"general.architecture": "llama", "llama.block_count": 1, "eps": 1e-5, "tokenizer.ggml.tokens": ["a", "b"]}
    _write_gguf(
        path,
        meta,
        [("q4", rc.Q4_1, (32, 2), q4_raw), ("q8", rc.Q8_0, (32, 1), q8_raw), ("f", rc.F32, (5, 3), f32.tobytes())],
    )
    gguf = rc.GGUFFile(path)
    assert gguf.metadata["llama.block_count"] == 1 and gguf.metadata["tokenizer.ggml.tokens"] == ["a", "b"]
    assert gguf.metadata["eps"] == pytest.approx(1e-5)
    expected_q4 = q4 * d4.astype(np.float32)[:, None] + m4.astype(np.float32)[:, None]
    np.testing.assert_array_equal(gguf.dequantize("q4"), expected_q4)
    np.testing.assert_array_equal(gguf.dequantize("q8"), q8 * np.float32(0.125))
    np.testing.assert_array_equal(gguf.dequantize("f"), f32)


def test_unpermute_inverts_llama_cpp_rotary_permute():
    heads, head_dim, cols = 3, 8, 5
    w = np.arange(heads * head_dim * cols, dtype=np.float32).reshape(heads * head_dim, cols)
    # llama.cpp convert_hf_to_gguf's permute of q_proj / k_proj rows
    permuted = w.reshape(heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(w.shape)
    np.testing.assert_array_equal(rc._unpermute_rotary(permuted, heads), w)


def test_path_if_present_without_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(rc.ENV_VAR, str(tmp_path / "none"))
    assert rc.default_path() == tmp_path / "none"
    assert rc.path_if_present() is None
    assert rc.default_path(tmp_path) == tmp_path / rc.NAME
    (tmp_path / rc.NAME).mkdir()
    (tmp_path / rc.NAME / rc.SOURCE_FILE).write_text(json.dumps({"gguf_sha256": "other"}))
    assert rc.path_if_present(tmp_path) is None  # another conversion, or an unfinished one


# --- the real checkpoint, where it was fetched --------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_path():
    path = rc.path_if_present()
    if path is None:
        pytest.skip("real checkpoint not fetched: run python -m layerwise.benchmarks.real_checkpoint")
    return path


@pytest.fixture(scope="module")
def real_tokenizer(real_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_path)


@pytest.fixture(scope="module")
def real_ids(real_tokenizer):
    """32 tokens of the real text (its tokenizer), [1, 32]."""
    ids = real_tokenizer(" ".join(texts.prompts(2, words=20)), return_tensors="pt").input_ids[:, :32]
    assert ids.shape == (1, 32)
    return ids


@pytest.fixture(scope="module")
def real_reference(real_path, real_ids):
    """transformers' float32 logits of ``real_ids``."""
    return hf_logits(real_path, real_ids)


def test_real_checkpoint_files(real_path):
    config = json.loads((real_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert (config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (576, 9, 3)
    assert json.loads((real_path / rc.SOURCE_FILE).read_text())["wheel_sha256"] == rc.WHEEL_SHA256


def test_real_tokenizer_round_trips_and_splits_digits(real_tokenizer):
    tokenizer = real_tokenizer
    text = texts.real_text()[:2000]
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert tokenizer.convert_ids_to_tokens(tokenizer(" 1813").input_ids) == ["Ġ", "1", "8", "1", "3"]
    assert tokenizer("<|im_end|>").input_ids == [2]


def test_real_float32_logits_match_transformers(real_path, real_ids, real_reference):
    """Agree to float32 rounding: measured max |diff| 7e-5 on logits of max |39| (256 tokens), 2e-6 relative."""
    model = layerwise.load_model(real_path, quantization=None, device="cpu", dtype=torch.float32)
    with torch.no_grad():
        out = model(real_ids)
    err = (out - real_reference).abs().max().item()
    assert err <= 1e-5 * real_reference.abs().max().item(), f"max |diff| {err}"


def test_real_bf16_logits_close_to_transformers(real_path, real_ids, real_reference):
    """BF16 layerwise against transformers' float32: measured 33.7 dB (256 tokens), as transformers' own BF16
    forward (33.7 dB); the top token agrees at 98% of positions."""
    model = layerwise.load_model(real_path, quantization=None, device="cpu")
    assert model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(real_ids).float()
    assert sqnr_db(real_reference, out) > 30
    assert (out.argmax(-1) == real_reference.argmax(-1)).float().mean() > 0.9


def test_real_greedy_continuation_is_not_degenerate(real_path):
    # float32: this CPU has no BF16 instructions, and a BF16 decode step costs several float32 ones
    engine = layerwise.Engine.from_pretrained(
        real_path, quantization=None, dtype=torch.float32, max_batch_size=2, max_seq_len=64
    )
    params = layerwise.SamplingParams(temperature=0.0, max_tokens=20)
    outputs = engine.generate(texts.prompts(2, words=16, seed=3), params)
    for output in outputs:
        completion = output.outputs[0]
        tokens = completion.token_ids
        assert len(tokens) >= 10, completion.text  # no immediate EOS
        assert len(set(tokens)) >= len(tokens) // 3, completion.text  # not one token or a short loop
        words = [w for w in completion.text.split() if w.strip(".,;:!?\"'()-").isalpha()]
        assert len(words) >= 5, completion.text  # English words, not symbols
