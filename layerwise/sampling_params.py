"""How to sample one request's completions: vLLM's ``SamplingParams`` fields, names and defaults.

Code written against vLLM's offline API (``LLM.generate(prompts, SamplingParams(...))``) builds the same
object here. Fields vLLM has and this engine does not (stop strings, penalties, beam search, guided
decoding) are not accepted: an unknown keyword is a ``TypeError``, never silently ignored.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace

GREEDY_EPS = 1e-5  # a temperature below this decodes greedily (vLLM's _SAMPLING_EPS)


@dataclass
class SamplingParams:
    """Sampling parameters of one request (vLLM's names, defaults and meaning).

    Attributes:
        n: completions per prompt (>= 1). The prompt is prefilled once and its KV cache copied to the
            other ``n - 1`` slots; with ``seed``, completion i samples with seed ``seed + i`` (as vLLM).
        temperature: >= 0; logits are divided by it before sampling; below 1e-5: greedy (argmax), and
            top_p / top_k / min_p are then ignored.
        top_p: in (0, 1]: sample from the smallest set of most likely tokens whose probability reaches it.
        top_k: 0 or -1: all tokens; k >= 1: the k most likely only.
        min_p: in [0, 1]: drop tokens whose probability is below ``min_p`` times the most likely one's.
        seed: None (the process's torch RNG), or an int: the request samples from its own
            ``torch.Generator`` seeded with it, so its tokens do not depend on what else is in the batch.
        max_tokens: most tokens to generate (>= 1), or None: until the engine's context (``max_seq_len``)
            is full. A completion that reaches either ends with finish_reason "length".
        stop_token_ids: ids that end a completion (finish_reason "stop", stop_reason the id); the id is
            kept in ``token_ids``.
        ignore_eos: keep generating past the checkpoint's EOS ids (benchmarks, fixed-length rollouts).
        logprobs: None, or k >= 0: per generated token, the sampled token's log-probability and the k most
            likely tokens' (``CompletionOutput.logprobs``).
        prompt_logprobs: None, or k >= 0: the same for every prompt token after the first
            (``RequestOutput.prompt_logprobs``).
    Order applied to the logits (vLLM's): temperature, then min_p, then top_k, then top_p. Log-probabilities
    are always of the raw model distribution (log_softmax of the float32 logits, before any of these).
    Raises:
        ValueError: a field out of range or of the wrong type; the message names the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = field(default=None)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self):
        self.n = _int("n", self.n, low=1)
        self.temperature = _float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        self.top_p = _float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k, low=-1)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _int("seed", self.seed)
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, low=1)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            self.stop_token_ids = [_int("stop_token_ids", t, low=0) for t in self.stop_token_ids]
        self.ignore_eos = bool(self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, low=0)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, low=0)

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature below 1e-5)."""
        return self.temperature < GREEDY_EPS

    def for_completion(self, index: int) -> SamplingParams:
        """The parameters of completion ``index`` of ``n``: n=1, and seed + index when seeded (vLLM's child
        requests)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


def _int(name: str, value, low: int | None = None) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return value


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if value != value:
        raise ValueError(f"{name} must be a number, got nan")
    return value
