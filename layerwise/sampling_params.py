"""How to sample one request's completions: vLLM's ``SamplingParams`` fields, names and defaults.

Code written against vLLM's offline API (``LLM.generate(prompts, SamplingParams(...))``) builds the same
object here. vLLM fields this engine does not implement (stop strings, penalties, min_tokens, best_of) are
accepted at their do-nothing values, which trainer code often passes explicitly, and refused with a
``ValueError`` naming the field at any other value; a keyword vLLM does not have either is a ``TypeError``.
Nothing is silently ignored.
"""

from __future__ import annotations

import copy
import operator
from dataclasses import dataclass, field, replace

GREEDY_EPS = 1e-5  # a temperature below this decodes greedily (vLLM's _SAMPLING_EPS)
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed takes
# vLLM fields not implemented here -> the value that does nothing (any other value is refused)
NOT_IMPLEMENTED = {
    "min_tokens": 0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "stop": None,
    "include_stop_str_in_output": False,
    "best_of": None,
}


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
            ``torch.Generator`` seeded with it, so its random draws do not depend on what else is in the batch
            (its tokens then depend on the batch only as far as the model's logits do).
        max_tokens: most tokens to generate (>= 1), or None: until the engine's context (``max_seq_len``)
            is full. A completion that reaches either ends with finish_reason "length".
        stop_token_ids: ids that end a completion (finish_reason "stop", stop_reason the id); the id is
            kept in ``token_ids``.
        ignore_eos: keep generating past the checkpoint's EOS ids (benchmarks, fixed-length rollouts).
        logprobs: None, or k >= 0: per generated token, the sampled token's log-probability and the k most
            likely tokens' (``CompletionOutput.logprobs``); -1: every token of the vocabulary.
        prompt_logprobs: None, or k >= 0 (or -1): the same for every prompt token after the first
            (``RequestOutput.prompt_logprobs``).
        skip_special_tokens: leave special tokens out of ``text``.
        detokenize: fill ``text`` (and logprobs' ``decoded_token``); False: token ids only.
        min_tokens, presence_penalty, frequency_penalty, repetition_penalty, stop, include_stop_str_in_output,
            best_of: vLLM's, accepted at their do-nothing values only (0, 0.0, 0.0, 1.0, None or [], False,
            None or n).
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
    skip_special_tokens: bool = True
    detokenize: bool = True
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    best_of: int | None = None

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
            low, high = SEED_RANGE
            if not low <= self.seed <= high - self.n:  # completion i uses seed + i
                raise ValueError(f"seed must be in [{low}, {high} - n], got {self.seed}")
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, low=1)
        if self.stop_token_ids is not None:
            if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
                raise ValueError(f"stop_token_ids must be a list of token ids, got {self.stop_token_ids!r}")
            self.stop_token_ids = [_int("stop_token_ids", t, low=0) for t in self.stop_token_ids]
        self.ignore_eos = bool(self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, low=-1)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _int("prompt_logprobs", self.prompt_logprobs, low=-1)
        self.skip_special_tokens, self.detokenize = bool(self.skip_special_tokens), bool(self.detokenize)
        for name, off in NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if name == "stop" and value in ([], ""):
                value = None
            if name == "best_of" and value == self.n:
                value = None
            if value != off or isinstance(value, bool) != isinstance(off, bool):
                raise ValueError(f"{name}={value!r} is not supported by this engine (only {off!r}, which does nothing)")

    @property
    def greedy(self) -> bool:
        """Whether this request decodes greedily (temperature below 1e-5)."""
        return self.temperature < GREEDY_EPS

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's ``SamplingParams.clone``)."""
        return copy.deepcopy(self)

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
