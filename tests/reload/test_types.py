"""layerwise/reload/types.py: element intervals of strided views and exact coverage counting,
checked against an independent element-by-element marking of a plain tensor."""

import itertools

import numpy as np
import pytest
import torch

from layerwise.reload.types import coverage, intervals_of_view


def _marked(view_of, numel):
    """Which flat elements a view writes, found by writing through the view into a real tensor."""
    flat = torch.zeros(numel)
    view_of(flat).fill_(1)
    return set(np.flatnonzero(flat.numpy()).tolist())


def _elements(starts, length):
    return {int(s) + i for s in starts for i in range(length)}


VIEWS = {
    "whole": lambda t: t,
    "rows 2-5 of [8, 6]": lambda t: t.view(8, 6)[2:5],
    "cols 1-4 of [8, 6]": lambda t: t.view(8, 6)[:, 1:4],
    "transpose block": lambda t: t.view(6, 8).t()[1:3, 2:5],
    "every other row": lambda t: t.view(8, 6)[::2],
    "one element": lambda t: t.view(8, 6)[3, 4],
    "3-D slab": lambda t: t.view(2, 4, 6)[1, 1:3, 2:],
    "empty": lambda t: t.view(8, 6)[3:3],
}


@pytest.mark.parametrize("name", list(VIEWS))
def test_intervals_of_view_cover_exactly_the_viewed_elements(name):
    base = torch.empty(48, device="meta")
    view = VIEWS[name](base)
    starts, length = intervals_of_view(view.storage_offset(), tuple(view.shape), tuple(view.stride()))
    assert _elements(starts, length) == _marked(VIEWS[name], 48)
    assert len(starts) * length == view.numel()


def test_contiguous_runs_are_merged():
    view = torch.empty(8, 6, device="meta")[2:5]  # rows 2..4: one run of 18 elements
    starts, length = intervals_of_view(view.storage_offset(), tuple(view.shape), tuple(view.stride()))
    assert starts.tolist() == [12] and length == 18


def test_coverage_counts_missing_and_doubled_elements():
    numel = 48
    writes = [
        intervals_of_view(0, (2, 6), (6, 1)),  # elements 0..11
        intervals_of_view(6, (2, 6), (6, 1)),  # 6..17: 6 doubled
        intervals_of_view(30, (3, 2), (6, 1)),
    ]  # 30,31,36,37,42,43
    written = [_elements(s, n) for s, n in writes]
    union = set().union(*written)
    doubled = sum(len(a) for a in written) - len(union)
    assert coverage(writes, numel) == (numel - len(union), doubled)
    assert coverage([], numel) == (numel, 0)
    assert coverage([intervals_of_view(0, (48,), (1,))], numel) == (0, 0)


def test_coverage_of_every_pair_of_row_slices_matches_a_set_count():
    numel = 8 * 4
    slices = [(a, b) for a, b in itertools.combinations(range(9), 2)]
    for (a0, a1), (b0, b1) in itertools.product(slices[::5], slices[::7]):
        writes = [intervals_of_view(a0 * 4, (a1 - a0, 4), (4, 1)), intervals_of_view(b0 * 4, (b1 - b0, 4), (4, 1))]
        rows_a, rows_b = set(range(a0, a1)), set(range(b0, b1))
        assert coverage(writes, numel) == (4 * (8 - len(rows_a | rows_b)), 4 * len(rows_a & rows_b))
