"""A checkpoint's text side: its tokenizer (transformers' AutoTokenizer, the ``text`` extra) and its EOS ids.

The core never imports transformers: a checkpoint without tokenizer files, or an engine given token ids,
runs without it.
"""

from __future__ import annotations

import json
import os

from layerwise.checkpoint import CONFIG_NAME
from layerwise.errors import CheckpointError, ConfigError

GENERATION_CONFIG_NAME = "generation_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
TEXT_EXTRA_PURPOSE = "text prompts and outputs (the checkpoint's tokenizer)"


def has_tokenizer(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory holds a tokenizer (any of ``TOKENIZER_FILES``)."""
    return any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES)


def load_tokenizer(path: str | os.PathLike):
    """The checkpoint's tokenizer: ``transformers.AutoTokenizer.from_pretrained(path)``, local files only.

    Raises:
        MissingDependencyError: transformers is not installed (names the ``text`` extra).
        CheckpointError: the tokenizer files do not load (names the directory and the cause).
    """
    from layerwise.optional import import_optional

    transformers = import_optional("transformers", "text", TEXT_EXTRA_PURPOSE)
    try:
        return transformers.AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for a broken tokenizer
        raise CheckpointError(f"{path}: the tokenizer does not load ({type(e).__name__}: {e})") from e


def eos_token_ids(path: str | os.PathLike) -> list[int]:
    """The ids that end a completion: ``eos_token_id`` of generation_config.json when it has one, else of
    config.json (an int or a list: every id of the list; Qwen2.5's generation config lists two).

    Returns:
        the ids (empty when neither file names one).
    Raises:
        ConfigError: a file is not valid JSON or its eos_token_id is neither an int nor a list of ints.
    """
    for name in (GENERATION_CONFIG_NAME, CONFIG_NAME):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as f:
                value = json.load(f).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ConfigError(f"{file}: not a JSON object ({e})") from e
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ConfigError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
        return list(dict.fromkeys(ids))
    return []
