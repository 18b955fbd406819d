"""Real English text for prompts: the first seven chapters of Jane Austen's Pride and Prejudice (1813).

Public domain. The file ``layerwise/data/real_text.txt`` (54 KB, shipped as package data) holds Project
Gutenberg's text as the janeaustenr R package 1.0.0 ships it (Debian's r-cran-janeaustenr 1.0.0-1), line for
line; its first line names that source, and :func:`real_text` returns what follows it. Benchmarks and tests
that want prompts a trained model can continue (rather than random token ids) take them from :func:`prompts`.
"""

from __future__ import annotations

import functools
import random
import re
from importlib import resources

# "Mr. Bennet": a full stop after these does not end a sentence
_ABBREVIATIONS = {"Mr", "Mrs", "Dr", "St"}
# a sentence's end: . ! or ? (then a closing quote or bracket, maybe), whitespace, then an opening quote or a
# capital letter
_SENTENCE_END = re.compile(r"[.!?][\"')]*\s+(?=[\"'(]*[A-Z])")


@functools.lru_cache(maxsize=1)
def real_text() -> str:
    """The text (the chapters' lines as Project Gutenberg wraps them; Gutenberg's ``_italics_`` marks kept),
    without the file's header line."""
    text = resources.files("layerwise").joinpath("data", "real_text.txt").read_text(encoding="utf-8")
    return text.split("\n", 1)[1]


@functools.lru_cache(maxsize=1)
def _sentences() -> tuple[list[str], list[int]]:
    """(the text's words, chapter headings and italics marks dropped; the index of each sentence's first word)."""
    paragraphs = [p for p in re.split(r"\n\s*\n", real_text()) if not re.fullmatch(r"\s*Chapter \d+\s*", p)]
    flat = " ".join(" ".join(p.split()) for p in paragraphs).replace("_", "")
    starts = [0]
    for match in _SENTENCE_END.finditer(flat):
        word = flat[: match.start()].rsplit(" ", 1)[-1].lstrip("\"'(")
        if word not in _ABBREVIATIONS:
            starts.append(match.end())
    words = flat.split(" ")
    # character offset -> word index: each start is the first character of a word
    offsets, position = {}, 0
    for i, w in enumerate(words):
        offsets[position] = i
        position += len(w) + 1
    return words, [offsets[s] for s in starts]


def prompts(n: int, words: int = 24, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of ``words`` words each from :func:`real_text`, each starting at a sentence's start
    (it may run on into the next sentences), in the text's order; whitespace normalized to single spaces.

    Deterministic: the same (n, words, seed) always gives the same list (a ``random.Random(seed)`` sample of the
    sentence starts). 495 sentence starts have 24 words after them.

    Raises:
        ValueError: ``n`` or ``words`` is below 1, or ``n`` exceeds the sentences that have ``words`` words after
            their start.
    """
    if n < 1 or words < 1:
        raise ValueError(f"prompts(n={n}, words={words}): both must be at least 1")
    text_words, starts = _sentences()
    candidates = [s for s in starts if s + words <= len(text_words)]
    if n > len(candidates):
        raise ValueError(f"prompts(n={n}, words={words}): the text has {len(candidates)} such sentence starts")
    chosen = sorted(random.Random(seed).sample(candidates, n))
    return [" ".join(text_words[s : s + words]) for s in chosen]
