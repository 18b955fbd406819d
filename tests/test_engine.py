"""layerwise/engine.py: what Engine.generate accepts, against a full recompute without the KV cache."""

import pytest
import torch

from layerwise.demo import greedy_tokens, write_checkpoint
from layerwise.engine import Engine
from tests.test_errors import TINY


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("engine") / "ckpt", TINY)
    return Engine.from_pretrained(path, max_batch_size=3, max_seq_len=24)


def test_lists_and_a_long_tensor_give_the_same_tokens(engine):
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6]]
    as_lists = engine.generate(prompts, 5)
    as_tensor = engine.generate(torch.tensor(prompts), 5)
    assert as_lists == [greedy_tokens(engine.model, p, 5) for p in prompts]
    assert isinstance(as_tensor, torch.Tensor) and as_tensor.dtype == torch.long and as_tensor.shape == (2, 5)
    assert as_tensor.tolist() == as_lists
    assert engine.generate(torch.tensor([[1, 2], [3, 4]], dtype=torch.int32), 0).shape == (2, 0)


@pytest.mark.parametrize(
    "prompts,error",
    [
        ([[1.5, 2]], TypeError),
        ("abc", TypeError),
        (torch.ones(2, 3), ValueError),
        (torch.ones(3, dtype=torch.long), ValueError),
        ([[1, 64]], ValueError),
        ([[]], ValueError),
        ([[1]] * 4, ValueError),
        ([[1] * 20], ValueError),
    ],
)
def test_bad_prompts_are_clear_errors(engine, prompts, error):
    with pytest.raises(error):
        engine.generate(prompts, 5)
