"""Greedy token lists from the Engine, the form most reload and sync tests compare."""

from layerwise.engine import Engine
from layerwise.sampling_params import SamplingParams


def greedy(engine: Engine, prompts, max_tokens: int) -> list[list[int]]:
    """Each prompt's ``max_tokens`` greedy tokens (EOS ignored), as lists of ids."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]
