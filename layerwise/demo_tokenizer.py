"""A small byte-level BPE tokenizer written locally, in Hugging Face's fast-tokenizer format (no download).

:func:`write_tokenizer` writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into a
checkpoint directory, so that ``transformers.AutoTokenizer.from_pretrained(path)`` loads a tokenizer for the demo and
test checkpoints. The JSON is written here with the json module: nothing imports the ``tokenizers`` package.

Layout of the vocabulary (ids):

1. ``0 .. 255``: the 256 byte symbols of GPT-2's byte-to-unicode map, in GPT-2's order (``"!"`` is 0, the space
   ``"Ġ"`` is 220), so any UTF-8 text (non-ASCII, emoji) encodes and decodes back exactly.
2. ``256 ..``: merged symbols, one per merge, learnt by byte-pair encoding over the embedded English text
   :data:`CORPUS` (the most frequent adjacent pair first; ties broken by the pair's symbols), so the same vocabulary
   comes out on every machine.
3. then the special tokens :data:`SPECIAL_TOKENS`: ``<|endoftext|>`` (padding), ``<|im_start|>``, ``<|im_end|>``
   (end of a turn: the EOS token), Qwen's ChatML tokens.

The pre-tokenizer and the decoder are Hugging Face's ``ByteLevel`` (GPT-2's split of words, numbers and punctuation
with their leading space); the chat template is Qwen's ChatML.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import Counter
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # the bytes and the special tokens, no merge
EOS_TOKEN = "<|im_end|>"  # ends an assistant turn, as in Qwen2.5's instruct models
PAD_TOKEN = "<|endoftext|>"

#: Qwen's ChatML: ``<|im_start|>{role}\n{content}<|im_end|>\n`` per message, then ``<|im_start|>assistant\n`` when
#: a generation prompt is asked for.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

#: The text the merges are learnt from (plain English, ASCII).
CORPUS = """\
The model is loaded one layer at a time. Each weight is read from the checkpoint, quantized to eight bits, and
written into the layer before the next one is read, so the memory in use stays close to the size of the model.
When the trainer has new weights, the engine reloads them in place: the same tensors are written again, and the
next step of generation reads the new values. This is what a rollout needs in reinforcement learning, where the
policy changes after every step of training and the engine must follow it without starting over.
A prompt is a list of tokens. The engine runs the prompt through the model, then samples one token after another
from the distribution of the next token, with a temperature, a top-p and a top-k, until it writes the end of the
turn or reaches the maximum number of tokens. Every request has its own random seed, so that the same request
with the same seed gives the same text again. The user asks a question, and the assistant gives an answer.
There are many ways to make a model faster, but the simplest is to move fewer bytes: the weights of a large
model are read once for every token, and a weight of one byte is read twice as fast as a weight of two bytes.
"""

# GPT-2's pre-tokenizer regex restricted to ASCII (\p{L} -> letters, \p{N} -> digits): the corpus is ASCII
_WORDS = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte (0-255) to a printable unicode character: printable Latin-1 bytes map to
    themselves, the others (space, control bytes) to characters from U+0100 up. Insertion order is GPT-2's
    vocabulary order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def learn_merges(text: str, max_merges: int | None = None) -> list[tuple[str, str]]:
    """Byte-pair merges learnt from ``text``, most frequent adjacent pair first.

    Args:
        text: the training text; split into words as GPT-2's pre-tokenizer does for ASCII text.
        max_merges: the most merges returned (default: until every word of ``text`` is one symbol).
    Returns:
        (left, right) symbol pairs in byte-level characters, in merge order; deterministic: ties go to the pair
        that sorts first.
    """
    byte_char = bytes_to_unicode()
    words = Counter(tuple(byte_char[b] for b in w.encode("utf-8")) for w in _WORDS.findall(text))
    merges: list[tuple[str, str]] = []
    while max_merges is None or len(merges) < max_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        words = Counter({_merge(word, best): count for word, count in words.items()})
    return merges


@functools.cache
def _corpus_merges() -> tuple[tuple[str, str], ...]:
    return tuple(learn_merges(CORPUS))


def _merge(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tokenizer_fits(vocab_size: int) -> bool:
    """Whether a model vocabulary of ``vocab_size`` ids has room for the tokenizer (259 ids: bytes and specials)."""
    return vocab_size >= MIN_VOCAB_SIZE


def check_vocab_size(vocab_size: int) -> None:
    """Raise ValueError (naming ``vocab_size`` and the minimum) unless :func:`tokenizer_fits`."""
    if not tokenizer_fits(vocab_size):
        raise ValueError(
            f"vocab_size {vocab_size}: a byte-level tokenizer needs at least {MIN_VOCAB_SIZE} ids "
            f"(256 bytes and {len(SPECIAL_TOKENS)} special tokens)"
        )


def tokenizer_json(vocab_size: int) -> dict:
    """The ``tokenizer.json`` document (Hugging Face tokenizers' serialization) of the demo tokenizer.

    Args:
        vocab_size: the model's vocabulary size; the tokenizer's ids (bytes, merges, special tokens) stay below it:
            every merge :data:`CORPUS` gives (345) when there is room, fewer otherwise.
    Raises:
        ValueError: ``vocab_size`` below 259 (the 256 bytes and the 3 special tokens).
    """
    check_vocab_size(vocab_size)
    vocab = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    merges = _corpus_merges()[: vocab_size - MIN_VOCAB_SIZE]
    for left, right in merges:
        vocab[left + right] = len(vocab)
    added = [
        {
            "id": len(vocab) + i,
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, token in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [f"{left} {right}" for left, right in merges],
        },
    }


def special_token_ids(vocab_size: int) -> dict[str, int]:
    """The id of each special token in the tokenizer :func:`write_tokenizer` writes for ``vocab_size``
    (``{"<|endoftext|>": 601, "<|im_start|>": 602, "<|im_end|>": 603}`` when there is room for every merge).

    Raises:
        ValueError: ``vocab_size`` below 259.
    """
    return {t["content"]: t["id"] for t in tokenizer_json(vocab_size)["added_tokens"]}


def write_tokenizer(path: str | os.PathLike, vocab_size: int) -> None:
    """Write the demo tokenizer into the checkpoint directory ``path`` (created if missing).

    Writes ``tokenizer.json`` (byte-level BPE, see the module docstring), ``tokenizer_config.json``
    (``PreTrainedTokenizerFast``, EOS ``<|im_end|>``, pad ``<|endoftext|>``, no BOS, the ChatML chat template) and
    ``special_tokens_map.json``. Every id is below ``vocab_size``; the largest is that of ``<|im_end|>``
    (:func:`special_token_ids`). ``config.json`` is not touched.

    Args:
        path: the checkpoint directory.
        vocab_size: the model's vocabulary size (``config.json``'s ``vocab_size``); from 604 up the tokenizer is the
            same (every merge of :data:`CORPUS`), below it has fewer merges.
    Raises:
        ValueError: ``vocab_size`` below 259.
        OSError: the directory cannot be written.
    """
    document = tokenizer_json(vocab_size)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    added = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in document["added_tokens"]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": config["additional_special_tokens"],
    }
    for name, content in (
        ("tokenizer.json", document),
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", special_map),
    ):
        with open(path / name, "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2, ensure_ascii=False)


def write_generation_config(
    path: str | os.PathLike,
    eos_token_ids: int | list[int],
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
) -> None:
    """Write ``generation_config.json`` into the checkpoint directory ``path``, as transformers lays it out.

    Args:
        eos_token_ids: the id (or ids, Qwen2.5 lists ``[<|im_end|>, <|endoftext|>]``) that end a completion.
        pad_token_id, bos_token_id: written when given.
    Raises:
        OSError: the directory cannot be written.
    """
    from layerwise.tokenizer import GENERATION_CONFIG_NAME  # the file the engine reads (imports torch)

    config = {"eos_token_id": eos_token_ids}
    if pad_token_id is not None:
        config["pad_token_id"] = pad_token_id
    if bos_token_id is not None:
        config["bos_token_id"] = bos_token_id
    with open(Path(path) / GENERATION_CONFIG_NAME, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
