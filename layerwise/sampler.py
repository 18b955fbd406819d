"""Next-token sampling and log-probabilities for a batch of requests, each with its own SamplingParams.

All of it runs on the logits' device in float32 (the cumulative distribution in float64), outside any CUDA
graph. A draw is an inverse-CDF lookup: one uniform u per row, and the token is the first whose cumulative
probability exceeds u (exact for every token, however small its probability: float64 sums over a
vocabulary of 10^5-10^6 tokens keep every step). A seeded request draws its u from its own
``torch.Generator``, so its draws depend on its seed alone, not on the other rows of the batch (vLLM's
per-request generators); one uniform per row and step is all a generator gives, so a seed's sequence does
not depend on the vocabulary's size either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerwise.outputs import Logprob, PositionLogprobs
from layerwise.sampling_params import SamplingParams


@dataclass
class SamplingBatch:
    """The per-row sampling parameters of one step, as tensors on the logits' device.

    Attributes:
        temperature: float32 [B] (1.0 in greedy rows, which never use it).
        greedy: bool [B].
        top_k: int64 [B], 0 = off; top_p: float32 [B], 1.0 = off; min_p: float32 [B], 0.0 = off.
        generators: per row, the request's ``torch.Generator`` or None (the process's RNG).
    """

    temperature: torch.Tensor
    greedy: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    any_min_p: bool

    @classmethod
    def of(
        cls, params: list[SamplingParams], generators: list[torch.Generator | None], device: torch.device
    ) -> SamplingBatch:
        """The batch of ``params`` (one per row) and their generators."""
        greedy = [p.greedy for p in params]
        active = [p for p in params if not p.greedy]

        def column(name: str, off, dtype: torch.dtype) -> torch.Tensor:  # greedy rows get the "off" value
            values = [off if p.greedy else getattr(p, name) for p in params]
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=column("temperature", 1.0, torch.float32),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=column("top_k", 0, torch.int64),
            top_p=column("top_p", 1.0, torch.float32),
            min_p=column("min_p", 0.0, torch.float32),
            generators=generators,
            all_greedy=all(greedy),
            any_top_k=any(p.top_k > 0 for p in active),
            any_top_p=any(p.top_p < 1.0 for p in active),
            any_min_p=any(p.min_p > 0.0 for p in active),
        )


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The logits the draw uses: float32 [B, V] divided by each row's temperature, then min_p, top_k and top_p
    applied as -inf (vLLM's order). Ties at the top-k boundary are all kept; top_p keeps the smallest set of
    most likely tokens whose probability reaches top_p (a token stays when the tokens strictly more likely
    than it hold less than top_p), at least one token."""
    x = logits / batch.temperature[:, None]
    if batch.any_min_p:
        probs = x.softmax(-1)
        floor = probs.amax(-1, keepdim=True) * batch.min_p[:, None]
        x = x.masked_fill(probs < floor, float("-inf"))
    if batch.any_top_k or batch.any_top_p:
        ascending, order = x.sort(-1)
        vocab = x.shape[-1]
        if batch.any_top_k:
            k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)
            kth = ascending.gather(-1, (vocab - k)[:, None])  # the k-th largest value of each row
            ascending = ascending.masked_fill(ascending < kth, float("-inf"))
        if batch.any_top_p:
            below = ascending.softmax(-1).cumsum(-1)  # probability of this token and every less likely one
            drop = below <= (1 - batch.top_p)[:, None]
            drop[:, -1] = False  # the most likely token always stays
            ascending = ascending.masked_fill(drop, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, ascending)
    return x


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Draw one token per row.

    Args:
        logits: float32 [B, V], the raw model logits.
        batch: the rows' parameters (:class:`SamplingBatch`).
    Returns:
        int64 [B] token ids on the logits' device: argmax in greedy rows, else a draw from
        softmax(:func:`processed_logits`).
    """
    greedy_tokens = logits.argmax(-1)
    if batch.all_greedy:
        return greedy_tokens
    cdf = processed_logits(logits, batch).softmax(-1).double().cumsum(-1)  # [B, V], last column ~1
    rows = logits.shape[0]
    if any(g is None for g in batch.generators):
        uniform = torch.rand(rows, dtype=torch.float64, device=logits.device)
    else:
        uniform = torch.empty(rows, dtype=torch.float64, device=logits.device)
    for row, generator in enumerate(batch.generators):
        if generator is not None:
            uniform[row : row + 1] = torch.rand(1, dtype=torch.float64, device=logits.device, generator=generator)
    total = cdf[:, -1]
    # strictly below the total, so some token's cumulative probability exceeds it; the first such token has a
    # positive probability (the CDF rises there), so a masked token is never drawn
    target = torch.minimum(uniform * total, total.nextafter(torch.zeros_like(total)))
    # a row of NaN logits (broken weights) would find no token: keep the id inside the vocabulary, so the next
    # step's embedding lookup stays in range (on CUDA an out-of-range id is a device-side assert)
    drawn = torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=logits.shape[-1] - 1)
    return torch.where(batch.greedy, greedy_tokens, drawn)


def token_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, top: int
) -> tuple[list[float], list[int], list[list[int]], list[list[float]]]:
    """Log-probabilities of ``tokens`` under each row, their ranks and each row's ``top`` most likely tokens.

    Args:
        logprobs: float32 [R, V], log_softmax of the raw logits.
        tokens: int64 [R], one token per row.
        top: how many most likely tokens to return per row (>= 0; at most the vocabulary).
    Returns:
        (logprob [R], rank [R] (1-based: 1 + the number of other tokens at least as likely, vLLM's rank),
        top ids [R][top], top logprobs [R][top]) as Python lists, read back to the host in one transfer each.
    """
    top = min(top, logprobs.shape[-1])
    chosen = logprobs.gather(-1, tokens[:, None])
    rank = (logprobs >= chosen).sum(-1)
    values, ids = logprobs.topk(top, dim=-1) if top > 0 else (logprobs[:, :0], tokens[:, None][:, :0])
    return chosen[:, 0].tolist(), rank.tolist(), ids.tolist(), values.tolist()


def position_logprobs(
    token: int, logprob: float, rank: int, top_ids: list[int], top_values: list[float], decode=None
) -> PositionLogprobs:
    """One position's entry: the chosen token and the top tokens (ranks 1..k), ``decode`` (id -> text) naming
    them when given."""
    name = decode or (lambda _: None)
    entry = {token: Logprob(logprob, rank, name(token))}  # the chosen token first, as vLLM orders them
    for i, (tid, value) in enumerate(zip(top_ids, top_values, strict=True)):
        if tid not in entry:
            entry[tid] = Logprob(value, i + 1, name(tid))
    return entry
