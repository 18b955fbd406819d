"""The locally written byte-level BPE tokenizer (layerwise/demo_tokenizer.py) against transformers' AutoTokenizer,
and the demo checkpoint's text files (layerwise/demo.py)."""

import json

import pytest

from layerwise import demo_tokenizer
from layerwise.demo import DEMO_CONFIG, demo_checkpoint, write_checkpoint
from layerwise.demo_tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    bytes_to_unicode,
    learn_merges,
    special_token_ids,
    write_generation_config,
    write_tokenizer,
)

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The model is loaded one layer at a time.",
    "",
    " leading and trailing spaces  ",
    "tabs\tand\nnew lines\n\n\r\n",
    "naïve café, Straße, ½ ∑ ≠ ∞",
    "日本語のテキスト, 中文, 한국어, русский, עברית, العربية",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "code: def f(x):\n    return x ** 2  # 'quoted' \"double\"",
    "numbers 3.14159 and 1,000,000 and 0x1F",
    "\x00\x01 control bytes \x7f",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(path, vocab_size=4096)
    return path


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


def test_the_vocabulary_is_bytes_then_merges_then_special_tokens():
    byte_symbols = list(bytes_to_unicode().values())
    assert len(set(byte_symbols)) == 256 and byte_symbols[0] == "!" and byte_symbols[220] == "Ġ"  # GPT-2's order
    document = demo_tokenizer.tokenizer_json(4096)
    vocab, merges = document["model"]["vocab"], document["model"]["merges"]
    assert list(vocab)[:256] == byte_symbols and list(vocab.values()) == list(range(len(vocab)))
    assert 200 <= len(merges) == len(vocab) - 256 <= 400  # a few hundred, every one the corpus gives
    assert merges[:2] == ["Ġ t", "h e"]  # the most frequent pairs of English first
    for merge in merges:  # each merge joins two symbols already in the vocabulary into one that is too
        left, right = merge.split(" ")
        assert left in vocab and right in vocab and left + right in vocab
    assert special_token_ids(4096) == {token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)}


def test_merges_are_deterministic():
    assert learn_merges(demo_tokenizer.CORPUS) == learn_merges(demo_tokenizer.CORPUS)
    # after a+a: (aa, a) and (a, b) both occur twice; the tie goes to the pair that sorts first
    assert learn_merges("aaab aaab", 2) == [("a", "a"), ("a", "b")]


@pytest.mark.parametrize("vocab_size", [259, 300, 604, 4096])
def test_every_id_fits_the_vocabulary(tmp_path, vocab_size):
    write_tokenizer(tmp_path, vocab_size)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) <= vocab_size and max(special_token_ids(vocab_size).values()) == len(tok) - 1
    text = "round trip: é 🎉"
    assert tok.decode(tok.encode(text)) == text


def test_too_small_a_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 128: a byte-level tokenizer needs at least 259 ids"):
        write_tokenizer(tmp_path, 128)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert all(0 <= i < len(tokenizer) for i in ids)
    assert tokenizer.decode(ids) == text


def test_english_takes_fewer_tokens_than_bytes(tokenizer):
    text = "The engine reads the new weights of the model after every step of training."
    assert len(tokenizer.encode(text)) < len(text.encode()) / 2


def test_special_tokens_are_single_ids(tokenizer):
    ids = special_token_ids(4096)
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token) == [ids[token]]
        assert tokenizer.convert_tokens_to_ids(token) == ids[token]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == ids["<|im_end|>"]
    assert tokenizer.pad_token == "<|endoftext|>" and tokenizer.bos_token is None
    text = "<|im_start|>user\nhi<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == "user\nhi"


def test_chat_template_is_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, wörld 🎉"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHello, wörld 🎉<|im_end|>\n<|im_start|>assistant\n"
    )
    without = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert without == text.removesuffix("<|im_start|>assistant\n")
    ids = tokenizer.encode(text)
    assert ids[0] == special_token_ids(4096)["<|im_start|>"] and tokenizer.decode(ids) == text


def test_the_files_are_plain_json(tokenizer_dir):
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["chat_template"] == CHAT_TEMPLATE
    document = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert document["model"]["type"] == "BPE" and document["pre_tokenizer"]["type"] == "ByteLevel"
    assert document["decoder"]["type"] == "ByteLevel"
    assert json.loads((tokenizer_dir / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"


def test_writing_imports_no_tokenizers_package():
    import subprocess
    import sys

    script = (
        "import sys, tempfile\n"
        "from layerwise.demo_tokenizer import write_tokenizer\n"
        "write_tokenizer(tempfile.mkdtemp(), 4096)\n"
        "print(sorted(m for m in ('tokenizers', 'transformers', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_generation_config_holds_the_eos_ids(tmp_path):
    write_generation_config(tmp_path, [603, 601], pad_token_id=601)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {
        "eos_token_id": [603, 601],
        "pad_token_id": 601,
    }
    generation = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert generation.eos_token_id == [603, 601]


# ---- the demo checkpoint


def test_the_demo_checkpoint_has_a_tokenizer_and_generation_config(tmp_path):
    path = demo_checkpoint(tmp_path)
    ids = special_token_ids(DEMO_CONFIG["vocab_size"])
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]  # as Qwen2.5's
    config = json.loads((path / "config.json").read_text())
    assert config == {**DEMO_CONFIG, "eos_token_id": ids["<|im_end|>"]}
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) <= DEMO_CONFIG["vocab_size"] and tok.eos_token_id == ids["<|im_end|>"]


def test_a_cached_demo_checkpoint_without_tokenizer_gets_one_and_keeps_its_weights(tmp_path):
    path = demo_checkpoint(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        (path / name).unlink()
    (path / "config.json").write_text(json.dumps(DEMO_CONFIG))  # as an earlier version wrote it
    shards = {p.name: p.stat().st_mtime_ns for p in path.glob("*.safetensors")}
    assert demo_checkpoint(tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.glob("*.safetensors")} == shards  # not rewritten
    assert (path / "tokenizer.json").is_file() and (path / "generation_config.json").is_file()
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == special_token_ids(4096)["<|im_end|>"]


def test_write_checkpoint_adds_a_tokenizer_only_where_it_fits(tmp_path):
    tiny = dict(DEMO_CONFIG, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, head_dim=8)
    plain = write_checkpoint(tmp_path / "tiny", tiny)
    assert not (plain / "tokenizer.json").exists() and not (plain / "generation_config.json").exists()
    assert json.loads((plain / "config.json").read_text()) == tiny  # unchanged: no eos_token_id
    with pytest.raises(ValueError, match="at least 259 ids"):
        write_checkpoint(tmp_path / "refused", tiny, tokenizer=True)
    assert not (tmp_path / "refused").exists()  # refused before anything is written
    small = write_checkpoint(tmp_path / "small", dict(tiny, vocab_size=300))
    assert (small / "tokenizer.json").is_file() and (small / "generation_config.json").is_file()
    without = write_checkpoint(tmp_path / "without", dict(tiny, vocab_size=300), tokenizer=False)
    assert not (without / "tokenizer.json").exists()


# ---- tests/hf_checkpoints.py's helper


def test_add_text_files_to_a_transformers_checkpoint(tmp_path):
    from tests.hf_checkpoints import add_text_files, write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path / "llama", "LlamaForCausalLM", vocab=512)
    config = (path / "config.json").read_bytes()
    ids = add_text_files(path, eos_token_ids=[7, 9])
    assert (path / "config.json").read_bytes() == config  # transformers builds the same model
    assert ids == special_token_ids(512)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert len(tok) <= 512 and tok.encode("<|im_end|>") == [ids["<|im_end|>"]]
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [7, 9] and generation["bos_token_id"] == 1  # save_pretrained's fields kept
    assert transformers.GenerationConfig.from_pretrained(path).eos_token_id == [7, 9]


def test_add_text_files_without_tokenizer_and_too_small_a_vocabulary(tmp_path):
    from tests.hf_checkpoints import add_text_files, write_hf_checkpoint

    path = write_hf_checkpoint(tmp_path / "qwen3", "Qwen3ForCausalLM")  # vocab 128
    assert add_text_files(path, tokenizer=False, eos_token_ids=5) == {}
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 5
    assert not (path / "tokenizer.json").exists()
    with pytest.raises(ValueError, match="vocab_size 128"):
        add_text_files(path)
