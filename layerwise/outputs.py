"""What ``Engine.generate`` returns: vLLM's ``RequestOutput``, ``CompletionOutput`` and ``Logprob``, same fields,
plus which weights made each token.

Code that reads vLLM's offline outputs (``out.outputs[0].token_ids``, ``.logprobs[t][token_id].logprob``,
``.finish_reason``) reads these unchanged. The fields vLLM does not have come last, with defaults:
``RequestOutput.weight_versions`` and ``CompletionOutput.token_weight_versions`` (see ``Engine.weight_version``).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability under the raw model distribution (float32 log_softmax of the logits).

    Attributes:
        logprob: natural log of the probability, <= 0.
        rank: 1-based rank of the token among the vocabulary (1: the most likely).
        decoded_token: the token's text when the engine has a tokenizer, else None.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one position's entry: the sampled (or prompt) token and the requested top-k, token id -> Logprob
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One completion of a prompt.

    Attributes:
        index: which of the request's ``n`` completions (0-based).
        text: the generated tokens' text, special tokens skipped ("" without a tokenizer).
        token_ids: the generated ids, the stop or EOS id included when one ended it.
        cumulative_logprob: sum of the sampled tokens' log-probabilities; None unless logprobs were requested.
        logprobs: None unless ``SamplingParams.logprobs`` was set; else one dict per generated token holding
            the sampled token and the ``logprobs`` most likely ones.
        finish_reason: "stop" (EOS or a stop id), "length" (max_tokens or the context), None while running.
        stop_reason: the stop id that ended it, None for EOS, length or while running (vLLM's meaning).
        token_weight_versions: (not in vLLM) one per token id: the ``Engine.weight_version`` of the forward step
            whose logits that token was drawn from. Where it changes, an update landed between two steps: the
            later tokens were drawn from the new weights, attending to keys and values that earlier steps cached
            with the older ones (the cache is not recomputed, as in vLLM). None when no engine filled it.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | None = None
    token_weight_versions: list[int] | None = None

    def finished(self) -> bool:
        """Whether the completion has ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A prompt and its completions.

    Attributes:
        request_id: the engine's count of requests before this one, as a string: ids count up across calls, as
            vLLM's ``LLM`` counts them.
        prompt: the prompt text, None for a token-id prompt.
        prompt_token_ids: the prompt's ids.
        prompt_logprobs: None unless requested; else one entry per prompt token, the first None (nothing
            predicts it), each later one holding that prompt token and the ``prompt_logprobs`` most likely.
        outputs: the ``n`` completions, by index.
        finished: whether every completion has ended.
        weight_versions: (not in vLLM) the distinct ``Engine.weight_version`` values, ascending, of the forward
            steps that made this request's tokens (its prefill, which drew the first token of each completion,
            and every decode step): one value unless a weight update landed while it was generating. Empty when
            no engine filled it.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    weight_versions: list[int] = field(default_factory=list)
