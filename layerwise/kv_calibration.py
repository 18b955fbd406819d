"""FP8 KV-cache calibration: each layer's K and V scales from the amax of a calibration batch.

``scale = max(amax, AMAX_FLOOR) / 448`` per layer and for K and V separately, where amax is the largest |key|
(after the rotary embedding, as the cache stores it) and |value| the model writes for the calibration prompts.
The engine calibrates when it is created and again after every weight change, because new weights move the
range of the keys and values: FP8-RL (arXiv 2601.18150) recalibrates its Q/K/V scales at every RL step, and
vLLM computes the same amax / 448 scales (its ``calculate_kv_scales``) from the first batch it runs.

The calibration forward runs each prompt alone through a BF16 scratch cache of its own length (no slot of the
engine's cache is touched, so sequences in flight keep theirs), recording amax as keys and values are written.
"""

from __future__ import annotations

import time

import torch

from layerwise.layers.kv_cache import FP8_MAX, LayerKVCache

AMAX_FLOOR = 2.0**-20  # a layer whose keys (or values) are all zero gets a finite, positive scale

DEFAULT_CALIBRATION_TEXT = (
    "The river rose slowly through the night, and by morning the lower road was under water. Farmers moved "
    "their animals to the high field behind the church, where the ground was dry and the grass still short. "
    "In the town, the baker opened an hour late because the flour had not arrived; the driver had waited at "
    "the bridge until the water fell. Children stood along the wall and counted the branches that floated "
    "past, arguing about which one was the largest.\n\n"
    "def merge(intervals):\n    intervals.sort()\n    out = [intervals[0]]\n    for start, end in intervals[1:]:\n"
    "        if start <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], end)\n        else:\n"
    "            out.append([start, end])\n    return out\n\n"
    "Question: A train travels 240 kilometres in 3 hours. What is its average speed? Answer: 240 / 3 = 80, so "
    "the train travels at 80 kilometres per hour. Question: If 7 apples cost 2.45 dollars, what do 12 cost? "
    "Answer: one apple costs 0.35 dollars, so 12 cost 4.20 dollars.\n\n"
    "Les scientifiques ont observé que la température moyenne a augmenté de 1,2 degré depuis le début du "
    "siècle. Die Ergebnisse wurden in einer Fachzeitschrift veröffentlicht. 研究结果发表在一份科学期刊上。\n\n"
    "User: Can you summarise the main idea of the article in two sentences?\nAssistant: The article argues "
    "that small, frequent updates are safer than large, rare ones. It supports this with three case studies "
    "from software teams that changed how they release code."
)
"""Built-in calibration text: prose, code, arithmetic, other languages and a chat turn, so the keys and values
of a calibration cover the kinds of text rollouts produce (written for this project)."""

CALIBRATION_TOKENS = 256  # the default calibration's length in tokens (one forward at every weight change)


def calibration_prompts(prompts, tokenizer, vocab_size: int, max_len: int) -> list[list[int]]:
    """Token-id prompts to calibrate with.

    Args:
        prompts: None (the first :data:`CALIBRATION_TOKENS` tokens of the built-in :data:`DEFAULT_CALIBRATION_TEXT`),
            or a list of strings (need a tokenizer) and token-id lists, all used.
        tokenizer: a Hugging Face tokenizer or None. Without one, the default is a fixed pseudo-random
            sequence of ids over the whole vocabulary (seed 0): a random-weight model has no text to prefer.
        vocab_size: ids must be below it; max_len: the longest prompt kept (longer ones are cut into pieces).
    Raises:
        ValueError: an empty list or prompt, a string without a tokenizer, an id outside the vocabulary.
    """
    default = prompts is None
    if default:
        if tokenizer is None:
            generator = torch.Generator().manual_seed(0)
            prompts = [torch.randint(vocab_size, (CALIBRATION_TOKENS,), generator=generator).tolist()]
        else:
            prompts = [DEFAULT_CALIBRATION_TEXT]
    if isinstance(prompts, str) or not prompts:
        raise ValueError("kv_calibration_prompts must be a non-empty list of strings or token-id lists")
    out = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError("a string in kv_calibration_prompts needs a tokenizer; pass token-id lists")
            prompt = tokenizer(prompt)["input_ids"]
        ids = [int(i) for i in prompt]
        if not ids or not all(0 <= i < vocab_size for i in ids):
            raise ValueError(f"a calibration prompt must be non-empty with ids in [0, {vocab_size}), got {ids[:8]}...")
        out.extend(ids[i : i + max_len] for i in range(0, len(ids), max_len))
    if default:  # the built-in text costs one forward of at most CALIBRATION_TOKENS at every weight change
        out = out[:1]
        out[0] = out[0][:CALIBRATION_TOKENS]
    return out


@torch.inference_mode()
def measure_kv_amax(model, prompts: list[list[int]]) -> torch.Tensor:
    """The largest |key| and |value| each decoder layer writes for ``prompts`` (each run alone).

    Args:
        model: a ``CausalLM`` from :func:`layerwise.load_model`; prompts: token-id lists.
    Returns:
        float32 [layers, 2] (K, V) on the model's device. Under tensor parallelism, over every rank's KV heads (one
        all-reduce over ``model.tp.group``, which every rank calls): each rank gets the scales of a TP=1 engine.
    """
    layers = model.model.layers
    attn = layers[0].self_attn
    embed = model.model.embed_tokens.weight
    amax = torch.zeros(len(layers), 2, dtype=torch.float32, device=embed.device)
    for ids in prompts:
        t = len(ids)
        shape = (1, t, attn.num_kv_heads, attn.head_dim)
        scratch = [
            LayerKVCache(
                torch.empty(shape, dtype=embed.dtype, device=embed.device),
                torch.empty(shape, dtype=embed.dtype, device=embed.device),
                amax=amax[i],
            )
            for i in range(len(layers))
        ]
        tokens = torch.tensor([ids], dtype=torch.long, device=embed.device)
        model.model(tokens, torch.arange(t, device=embed.device)[None], scratch)
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1:  # each rank holds some KV heads: the layer's amax is the largest of them
        import torch.distributed as dist

        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=tp.group)
    return amax


def calibrate_kv_scales(runner, prompts: list[list[int]], requantize: bool) -> float:
    """Measure amax for ``prompts`` and write ``max(amax, AMAX_FLOOR) / 448`` into the runner's FP8 scales in
    place (``ModelRunner.set_kv_scales``; ``requantize``: re-encode a cache holding sequences in flight).

    Returns:
        seconds taken (on CUDA, synchronized).
    Raises:
        FloatingPointError: a layer's keys or values are not finite (NaN or Inf weights); the scales are unchanged.
    """
    start = time.perf_counter()
    amax = measure_kv_amax(runner.model, prompts)
    finite = torch.isfinite(amax)
    if not bool(finite.all()):
        layer, which = (int(i) for i in (~finite).nonzero()[0])
        raise FloatingPointError(
            f"KV-cache calibration: layer {layer}'s {'KV'[which]} values are not finite ({float(amax[layer, which])}); "
            "the FP8 KV-cache scales were left as they were"
        )
    runner.set_kv_scales(amax.clamp_min(AMAX_FLOOR) / FP8_MAX, requantize)
    return time.perf_counter() - start
