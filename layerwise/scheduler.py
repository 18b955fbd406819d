"""Requests, their sequences, and which of them hold the KV cache's slots (continuous batching).

A request is one prompt with its SamplingParams; it has ``n`` sequences (completions). Requests wait longest
prompt first (a generate call still returns them in the caller's order), so the prompts prefilled together have
similar lengths and pad little. One is admitted when all ``n`` of its sequences fit in free slots and the
prefill's padded token count stays within the budget, so a step prefills as many waiting prompts as fit. Every
step then either prefills what was admitted or decodes one token for every running sequence; a sequence that
finishes frees its slot at once, and the next step may give it to a waiting prompt (nano-vllm's and vLLM's
scheduling, without preemption: a slot holds a whole sequence, so an admitted sequence always runs to its end).

Running sequences stay packed in slots 0..n-1: when some finish, the last running ones move into the holes
(:meth:`Scheduler.retire` says which slot to copy where), so forward steps work on a leading slice of the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from layerwise.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from layerwise.sampling_params import SamplingParams


@dataclass(frozen=True)
class StopIds:
    """The ids that end every completion, split as vLLM splits them.

    Attributes:
        eos_token_id: the tokenizer's EOS id (a completion ending with it has stop_reason None), or None.
        other_eos: the checkpoint's other EOS ids (generation_config.json / config.json), which vLLM adds to each
            request's stop ids: a completion ending with one has that id as stop_reason.
    """

    eos_token_id: int | None = None
    other_eos: frozenset[int] = frozenset()


@dataclass
class Sequence:
    """One completion being generated.

    Attributes:
        request: the request it belongs to; index: which of its n completions.
        params: its own parameters (n=1; seed + index when seeded).
        generator: its ``torch.Generator`` when seeded, else None.
        max_tokens: tokens it may generate: params.max_tokens, cut to the room left in the context.
        token_ids / logprobs / cumulative_logprob / finish_reason / stop_reason: as in CompletionOutput.
        weight_versions: per token, the engine's weight version of the step whose logits drew it.
    """

    request: Request
    index: int
    params: SamplingParams
    generator: torch.Generator | None
    max_tokens: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | None = None
    weight_versions: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.request.prompt_token_ids) + len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, entry: PositionLogprobs | None, stops: StopIds, weight_version: int) -> None:
        """Add a sampled token (with its logprob entry when requested, and the weight version it was drawn with)
        and apply the stop rules in vLLM's order: the tokenizer's EOS (stop_reason None), then the request's stop
        ids and the checkpoint's other EOS ids (stop_reason the id; EOS ids not with ignore_eos), then the
        length."""
        self.token_ids.append(token)
        self.weight_versions.append(weight_version)
        if entry is not None:
            self.logprobs.append(entry)
            self.cumulative_logprob += entry[token].logprob
        eos = not self.params.ignore_eos
        if eos and token == stops.eos_token_id:
            self.finish_reason = "stop"
        elif (self.params.stop_token_ids and token in self.params.stop_token_ids) or (eos and token in stops.other_eos):
            self.finish_reason, self.stop_reason = "stop", token
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"

    def output(self, decode_text) -> CompletionOutput:
        """The completion as vLLM's ``CompletionOutput``; ``decode_text(ids, params)`` gives its text."""
        wants = self.params.logprobs is not None
        return CompletionOutput(
            index=self.index,
            text=decode_text(self.token_ids, self.params),
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if wants else None,
            logprobs=list(self.logprobs) if wants else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            token_weight_versions=list(self.weight_versions),
        )


@dataclass
class Request:
    """One prompt and its sequences.

    Attributes:
        prompt: the text, None for a token-id prompt; prompt_token_ids: the ids.
        params: the request's SamplingParams.
        request_id: the engine's count of requests so far, as a string (set once the whole call is valid).
        sequences: its n completions.
        prompt_logprobs: filled at prefill when params.prompt_logprobs is set.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    def start(self, max_seq_len: int, device: torch.device) -> None:
        """Create the n sequences (each with its generator when seeded)."""
        room = max_seq_len - len(self.prompt_token_ids)
        for i in range(self.params.n):
            params = self.params.for_completion(i)
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=device)
                generator.manual_seed(params.seed)
            limit = room if params.max_tokens is None else min(params.max_tokens, room)
            logprobs = [] if params.logprobs is not None else None
            self.sequences.append(Sequence(self, i, params, generator, limit, logprobs=logprobs))

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.sequences)

    def output(self, decode_text) -> RequestOutput:
        """The request as vLLM's ``RequestOutput``."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=list(self.prompt_token_ids),
            prompt_logprobs=self.prompt_logprobs,
            outputs=[s.output(decode_text) for s in self.sequences],
            finished=self.finished,
            weight_versions=sorted({v for s in self.sequences for v in s.weight_versions}),
        )


class Scheduler:
    """Admits waiting requests into free slots and keeps the running sequences packed in slots 0..n-1.

    Args:
        max_batch_size: the KV cache's slots.
        max_num_batched_tokens: most tokens one prefill forward may hold, padding included (one request
            is always admitted when its sequences fit, whatever its length).
    """

    def __init__(self, requests: list[Request], max_batch_size: int, max_num_batched_tokens: int):
        # longest prompts first: prompts admitted together have similar lengths, so a prefill pads little (the
        # outputs keep the caller's order; each request's draws depend on its own seed, not on its neighbours)
        self.waiting: deque[Request] = deque(sorted(requests, key=lambda r: -len(r.prompt_token_ids)))
        self.running: list[Sequence] = []  # running[i] holds slot i
        self.max_batch_size, self.max_num_batched_tokens = max_batch_size, max_num_batched_tokens

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admit(self) -> list[Request]:
        """Take waiting requests, in order, while their sequences fit in the free slots and the padded prefill
        (requests x longest prompt) fits the token budget."""
        admitted: list[Request] = []
        free, width = self.max_batch_size - len(self.running), 0
        while self.waiting:
            request = self.waiting[0]
            n, wider = request.params.n, max(width, len(request.prompt_token_ids))
            if n > free or (admitted and (len(admitted) + 1) * wider > self.max_num_batched_tokens):
                break
            admitted.append(self.waiting.popleft())
            free, width = free - n, wider
        return admitted

    def place(self, admitted: list[Request]) -> list[tuple[Sequence, int]]:
        """Give the admitted requests' sequences the next slots: every request's first sequence in order (the
        rows the prefill runs), then the other completions. Returns (sequence, row of its prompt in the prefill)
        in slot order."""
        first = [(r.sequences[0], i) for i, r in enumerate(admitted)]
        others = [(s, i) for i, r in enumerate(admitted) for s in r.sequences[1:]]
        placed = first + others
        self.running.extend(s for s, _ in placed)
        return placed

    def retire(self) -> list[tuple[int, int, int]]:
        """Drop finished sequences from their slots and move the last running ones into the holes.

        Returns:
            the moves to make in the KV cache, (source slot, destination slot, cached positions to copy).
        """
        alive = [s for s in self.running if not s.finished]
        if len(alive) == len(self.running):
            return []
        keep = len(alive)
        holes = [i for i in range(keep) if self.running[i].finished]
        movers = [j for j in range(keep, len(self.running)) if not self.running[j].finished]
        moves = []
        packed = self.running[:keep]
        for hole, src in zip(holes, movers, strict=True):
            seq = self.running[src]
            packed[hole] = seq
            moves.append((src, hole, seq.length - 1))  # the last sampled token is not in the cache yet
        self.running = packed
        return moves
