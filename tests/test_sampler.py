"""layerwise/sampler.py: draws follow the distribution SamplingParams describe (chi-square against probabilities
computed here independently, from the definitions), and seeded rows do not depend on the rest of the batch."""

import math

import pytest
import torch

from layerwise.sampler import SamplingBatch, sample
from layerwise.sampling_params import SamplingParams

LOGITS = [2.0, 1.2, 0.9, 0.3, 0.0, -0.4, -1.5, -3.0]  # a fixed small vocabulary
DRAWS = 40_000


def softmax(values):
    top = max(values)
    e = [math.exp(v - top) for v in values]
    return [x / sum(e) for x in e]


def expected(params: SamplingParams) -> list[float]:
    """The target distribution, from the definitions: temperature, then min_p, then top_k, then top_p."""
    kept = list(range(len(LOGITS)))
    scaled = [v / params.temperature for v in LOGITS]
    if params.min_p > 0:
        p = softmax(scaled)
        kept = [i for i in kept if p[i] >= params.min_p * max(p)]
    if params.top_k > 0:
        kept = sorted(kept, key=lambda i: -scaled[i])[: params.top_k]
    if params.top_p < 1:
        p = softmax([scaled[i] for i in kept])
        order = sorted(range(len(kept)), key=lambda j: -p[j])
        chosen, mass = [], 0.0
        for j in order:  # the smallest set of most likely tokens reaching top_p
            chosen.append(kept[j])
            mass += p[j]
            if mass >= params.top_p:
                break
        kept = chosen
    p = softmax([scaled[i] for i in kept])
    out = [0.0] * len(LOGITS)
    for i, q in zip(kept, p, strict=True):
        out[i] = q
    return out


def chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    cells = [(c, p * sum(counts)) for c, p in zip(counts, probs, strict=True) if p > 0]
    stat = sum((c - e) ** 2 / e for c, e in cells)
    dof = len(cells) - 1
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)).item()


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=1.7),
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.0, top_p=0.7),
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: f"t{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_draws_pass_a_chi_square_test(params):
    torch.manual_seed(0)
    logits = torch.tensor([LOGITS]).expand(DRAWS, -1).contiguous()
    batch = SamplingBatch.of([params] * DRAWS, [None] * DRAWS, torch.device("cpu"))
    counts = torch.bincount(sample(logits, batch), minlength=len(LOGITS)).tolist()
    probs = expected(params)
    assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0), (counts, probs)  # masked: never drawn
    assert chi_square_p_value(counts, probs) > 1e-3, (counts, [round(p * DRAWS) for p in probs])


def test_a_seeded_row_is_independent_of_the_batch_and_follows_its_distribution():
    params = SamplingParams(temperature=1.0, top_k=4, seed=5)
    logits = torch.tensor([LOGITS])

    def draws(rows):  # 2000 steps of a seeded row, alone or among other rows
        generator = torch.Generator().manual_seed(5)
        others = SamplingParams(temperature=2.0)
        batch = SamplingBatch.of(
            [params] + [others] * (rows - 1), [generator] + [None] * (rows - 1), torch.device("cpu")
        )
        return [sample(logits.expand(rows, -1), batch)[0].item() for _ in range(2000)]

    alone = draws(1)
    assert draws(5) == alone
    counts = [alone.count(i) for i in range(len(LOGITS))]
    assert chi_square_p_value(counts, expected(params)) > 1e-3


def test_greedy_rows_take_the_argmax_whatever_the_other_rows_do():
    logits = torch.tensor([LOGITS, LOGITS[::-1]])
    batch = SamplingBatch.of(
        [SamplingParams(temperature=0), SamplingParams(temperature=5.0)], [None, None], torch.device("cpu")
    )
    for _ in range(20):
        assert sample(logits, batch)[0].item() == 0
    batch = SamplingBatch.of([SamplingParams(temperature=0)] * 2, [None, None], torch.device("cpu"))
    assert sample(logits, batch).tolist() == [0, len(LOGITS) - 1]


def test_a_nan_row_draws_an_id_inside_the_vocabulary():
    logits = torch.tensor([LOGITS, [float("nan")] * len(LOGITS)])
    batch = SamplingBatch.of([SamplingParams(temperature=1.0)] * 2, [None, None], torch.device("cpu"))
    for _ in range(20):
        assert 0 <= sample(logits, batch)[1].item() < len(LOGITS)
