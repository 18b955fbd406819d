"""Rollout / reference mismatch: how far an FP8 engine's rollouts are from the BF16 policy that a trainer scores them
with (issue 28), the figures RL users correct for with truncated / masked importance sampling (TIS, MIS).

Per configuration (a quantization scheme and a KV cache dtype):

  1. the rollout engine (``Engine.from_pretrained(PATH, quantization=scheme, kv_cache_dtype=kv)``) generates
     ``--max-tokens`` tokens after each of ``--prompts`` prompts (temperature 1.0, ``ignore_eos``, request i seeded
     with seed + i, ``logprobs=0``: the sampled token's log-probability under the raw distribution, as vLLM reports
     it); prompts: passages of the built-in real text (:func:`layerwise.texts.prompts`), or random token ids for a
     checkpoint without a tokenizer;
  2. the same engine scores the prompt + completion teacher-forced (:meth:`Engine.teacher_forced_logits`: its
     weights, its KV cache dtype and scales, prefill forwards) for the full next-token distribution at each
     generated position;
  3. the reference scores the same tokens teacher-forced: an unquantized engine of the same checkpoint
     (``--reference ours``, default; KV cache in the model dtype) or transformers' ``AutoModelForCausalLM``
     forward (``--reference transformers``), in the checkpoint's dtype unless ``--reference-dtype``.

Over all generated tokens t (log-probabilities from float32 ``log_softmax``):

  mean_kl                      KL(rollout || reference) of the full next-token distributions (step 2 vs 3)
  mean_abs_logprob_diff,       |logp_ref(t) - logp_rollout(t)| of the sampled token, logp_rollout from generate
  max_abs_logprob_diff         (the rollout as a trainer receives it)
  ratio_p1, ratio_p50,         quantiles of the token-level importance ratio r_t = exp(logp_ref(t) - logp_rollout(t))
  ratio_p99
  frac_ratio_above_2           the fraction of tokens with r_t > 2 (the usual TIS cap)
  top1_agreement               the fraction of positions where the rollout's and the reference's argmax agree
  sequence_log_ratio_*         per sequence sum_t (logp_ref - logp_rollout): mean, mean of |.|, max of |.|
  rollout_logprob_consistency  max |generate's logp_rollout(t) - the rollout engine's teacher-forced logp(t)| (the
                               decode path against the prefill path of the same engine: the part of the mismatch
                               that is numerics, not quantization)
  kv_clamped_fraction          FP8 KV cache: the fraction of keys and values the rollouts' generate clamped to +-448
                               (beyond the range calibrated on the built-in text); None with "auto"
  perplexity,                  of the rollout model and of the reference on the real text (``--perplexity-tokens``
  reference_perplexity         tokens in windows of ``--window`` tokens, teacher-forced, each window's first token
                               unpredicted): exp(mean negative log-likelihood)

Default configurations: every FP8 scheme with the KV cache in the model dtype ("auto") and in FP8, and the
unquantized model with both KV dtypes: scheme "none" with "auto" is the floor (the same weights as the reference: its
KL is 0 by construction with ``--reference ours``, and its ratios show the decode / prefill numerics alone), "none"
with "fp8" isolates the FP8 KV cache.

    python -m layerwise.benchmarks.mismatch [PATH] [--quantization S1,S2] [--kv-cache-dtype auto,fp8] [--prompts N]
        [--max-tokens T] [--seed S] [--reference ours|transformers] [--device cpu|cuda] [--out-dir DIR]

PATH defaults to the real checkpoint (layerwise.benchmarks.real_checkpoint) when it has been fetched, else the demo
checkpoint (random weights). Writes DIR/mismatch_<device>_<model>.json (every row, the problem, the machine, the
commit) and DIR/mismatch_<device>_<model>.png (the distribution of log r_t per scheme), and prints the table
(:func:`table`). ``layerwise mismatch`` runs the same measurement from the command line.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

SCHEMES = ["none", "fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]
KV_CACHE_DTYPES = ["auto", "fp8"]
REFERENCES = ["ours", "transformers"]
TIS_CAP = 2.0  # frac_ratio_above_2: the usual truncation of the importance ratio
QUANTILES = (0.01, 0.5, 0.99)
#: the default problem per device type: (prompts, tokens generated per prompt, perplexity tokens). On CPU a BF16
#: forward runs at a few GFLOP/s on two cores: the reference's and the unquantized rollouts' forwards dominate
PROBLEMS = {"cuda": (64, 128, 16384), "cpu": (8, 48, 1024)}
PROMPT_WORDS = 24  # words per real-text prompt
DEFAULT_WINDOW = 256  # tokens per perplexity window
HISTOGRAM_BINS = 60


# ----------------------------------------------------------------------------- the metrics (pure functions)


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax over the last dimension."""
    return torch.log_softmax(logits.float(), dim=-1)


def kl_divergence(rollout_logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """KL(rollout || reference) per position: sum_v p_roll(v) (log p_roll(v) - log p_ref(v)).

    Args:
        rollout_logits, reference_logits: [N, vocab] (any float dtype; computed in float32).
    Returns:
        float32 [N].
    """
    rollout, reference = log_probs(rollout_logits), log_probs(reference_logits)
    return (rollout.exp() * (rollout - reference)).sum(dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float32 [N]: log p(tokens[i]) under row i of ``logits`` [N, vocab]."""
    return log_probs(logits).gather(-1, tokens.view(-1, 1).to(logits.device)).view(-1)


def top1_agreement(rollout_logits: torch.Tensor, reference_logits: torch.Tensor) -> torch.Tensor:
    """bool [N]: the two distributions' most likely tokens are the same."""
    return rollout_logits.argmax(dim=-1) == reference_logits.argmax(dim=-1)


def importance_ratios(reference_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor) -> torch.Tensor:
    """float64 r_t = exp(logp_ref(t) - logp_rollout(t)), the token-level importance ratio."""
    return torch.exp(reference_logprobs.double() - rollout_logprobs.double())


def summarize(
    kl: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    top1: torch.Tensor,
    lengths: Sequence[int],
) -> dict:
    """The mismatch figures over all generated tokens (see the module docstring for each key).

    Args:
        kl: [N] KL(rollout || reference) per token; rollout_logprobs / reference_logprobs: [N] the sampled tokens'
            log-probabilities; top1: [N] bool agreement; lengths: tokens per sequence, in order (summing to N).
    """
    diff = reference_logprobs.double().cpu() - rollout_logprobs.double().cpu()  # log r_t
    ratios = importance_ratios(reference_logprobs.cpu(), rollout_logprobs.cpu())
    quantiles = torch.quantile(ratios, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
    per_sequence = torch.stack([d.sum() for d in diff.split(list(lengths))])
    return {
        "tokens": int(diff.numel()),
        "mean_kl": float(kl.double().mean()),
        "mean_abs_logprob_diff": float(diff.abs().mean()),
        "max_abs_logprob_diff": float(diff.abs().max()),
        **{f"ratio_p{round(q * 100)}": value for q, value in zip(QUANTILES, quantiles, strict=True)},
        "frac_ratio_above_2": float((ratios > TIS_CAP).double().mean()),
        "top1_agreement": float(top1.double().mean()),
        "sequence_log_ratio_mean": float(per_sequence.mean()),
        "sequence_log_ratio_mean_abs": float(per_sequence.abs().mean()),
        "sequence_log_ratio_max_abs": float(per_sequence.abs().max()),
    }


def perplexity(logits: Sequence[torch.Tensor], sequences: Sequence[Sequence[int]]) -> float:
    """exp(mean negative log-likelihood) of every token but each sequence's first, teacher-forced.

    Args:
        logits: per sequence [len - 1, vocab], row j predicting token j + 1 (:meth:`Engine.teacher_forced_logits`).
    """
    nll = torch.cat(
        [-token_logprobs(lg, torch.tensor(seq[1:])).double().cpu() for lg, seq in zip(logits, sequences, strict=True)]
    )
    return math.exp(float(nll.mean()))


# ----------------------------------------------------------------------------- inputs


def default_checkpoint(cache_dir=None) -> Path:
    """The real checkpoint when it has been fetched (benchmarks/real_checkpoint.py), else the demo checkpoint."""
    from layerwise.benchmarks.real_checkpoint import path_if_present
    from layerwise.demo import demo_checkpoint

    return Path(path_if_present() or demo_checkpoint(cache_dir))


def model_name(path) -> str:
    """What the JSON's ``model`` says: the real checkpoint's name, "demo" for the demo checkpoint (random weights),
    else the directory's name."""
    from layerwise.benchmarks.real_checkpoint import NAME, path_if_present
    from layerwise.demo import default_cache_dir

    path = Path(path).resolve()
    real = path_if_present()
    if real is not None and Path(real).resolve() == path:
        return NAME
    if path.name == "demo-qwen3-8l" and path.parent == default_cache_dir().resolve():
        return "demo"
    return path.name


def text_prompts(n: int, seed: int) -> list[str]:
    """``n`` passages of :data:`PROMPT_WORDS` words of the built-in real text."""
    from layerwise.texts import prompts

    return prompts(n, words=PROMPT_WORDS, seed=seed)


def random_prompts(n: int, vocab_size: int, seed: int, length: int = 16) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids (a checkpoint without a tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=g).tolist() for _ in range(n)]


def perplexity_windows(ids: Sequence[int], tokens: int, window: int) -> list[list[int]]:
    """The first ``tokens`` ids cut into windows of ``window`` ids (the last one shorter, dropped below 2 ids)."""
    ids = list(ids)[:tokens]
    return [ids[i : i + window] for i in range(0, len(ids), window) if len(ids[i : i + window]) >= 2]


def perplexity_ids(tokenizer, vocab_size: int, tokens: int, seed: int) -> tuple[list[int], str]:
    """The ids perplexity is measured on and what they are: the built-in real text through the tokenizer, else
    random ids (a checkpoint without a tokenizer: a figure of the numerics only)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, vocab_size, (tokens,), generator=g).tolist(), "random token ids (no tokenizer)"
    from layerwise.texts import real_text

    ids = tokenizer(real_text(), add_special_tokens=False, verbose=False)["input_ids"]  # longer than the context
    return ids[:tokens], "layerwise.texts.real_text()"


# ----------------------------------------------------------------------------- the references

#: sequences -> one float32 [len - 1, vocab] per sequence, row j predicting token j + 1
Scorer = Callable[[list[list[int]]], list[torch.Tensor]]


def engine_scorer(engine) -> Scorer:
    """An engine's teacher-forced logits."""
    return engine.teacher_forced_logits


def transformers_scorer(path, dtype: torch.dtype, device, batch: int) -> Scorer:
    """transformers' ``AutoModelForCausalLM`` forward of the checkpoint (right-padded batches of ``batch``
    sequences with an attention mask; a causal model's logits at a real position ignore the padding after it)."""
    from layerwise import optional

    optional.require(["transformers"], extra="bench", purpose="--reference transformers")
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()

    @torch.inference_mode()
    def score(sequences: list[list[int]]) -> list[torch.Tensor]:
        out = []
        for start in range(0, len(sequences), batch):
            group = sequences[start : start + batch]
            longest = max(map(len, group))
            ids = torch.zeros(len(group), longest, dtype=torch.long)
            mask = torch.zeros(len(group), longest, dtype=torch.long)
            for i, seq in enumerate(group):
                ids[i, : len(seq)], mask[i, : len(seq)] = torch.tensor(seq), 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
            out.extend(logits[i, : len(seq) - 1] for i, seq in enumerate(group))
        return out

    return score


# ----------------------------------------------------------------------------- one configuration


def _quantization(scheme: str) -> str | None:
    return None if scheme == "none" else scheme


def rollouts(engine, prompts: list, max_tokens: int, seed: int) -> tuple[list[list[int]], list[int], list[list[float]]]:
    """Generate (temperature 1, ``ignore_eos``, request i seeded with seed + i); returns the full sequences (prompt
    + completion ids), the prompt lengths and the sampled tokens' log-probabilities from generate."""
    from layerwise.sampling_params import SamplingParams

    params = [
        SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i, logprobs=0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    sequences, prompt_lengths, logprobs = [], [], []
    for output in engine.generate(prompts, params):
        completion = output.outputs[0]
        sequences.append(list(output.prompt_token_ids) + list(completion.token_ids))
        prompt_lengths.append(len(output.prompt_token_ids))
        logprobs.append(
            [entries[t].logprob for t, entries in zip(completion.token_ids, completion.logprobs, strict=True)]
        )
    return sequences, prompt_lengths, logprobs


def compare(
    rollout: Scorer,
    reference: Scorer,
    sequences: list[list[int]],
    prompt_lengths: list[int],
    generated_logprobs: list[list[float]],
    batch: int,
) -> tuple[dict, torch.Tensor]:
    """The mismatch figures (:func:`summarize`, plus ``rollout_logprob_consistency``) of rollouts already generated,
    scoring ``batch`` sequences at a time (only the generated positions' per-token figures are kept). Returns the
    figures and log r_t of every generated token (float64, in order)."""
    kl, rollout_tf, reference_lp, top1 = [], [], [], []
    for start in range(0, len(sequences), batch):
        group = sequences[start : start + batch]
        for seq, prompt_len, roll, ref in zip(
            group, prompt_lengths[start : start + batch], rollout(group), reference(group), strict=True
        ):
            rows = slice(prompt_len - 1, len(seq) - 1)  # row j predicts token j + 1: the generated tokens' rows
            tokens = torch.tensor(seq[prompt_len:])
            kl.append(kl_divergence(roll[rows], ref[rows]).cpu())
            rollout_tf.append(token_logprobs(roll[rows], tokens).cpu())
            reference_lp.append(token_logprobs(ref[rows], tokens).cpu())
            top1.append(top1_agreement(roll[rows], ref[rows]).cpu())
    generated = torch.tensor(list(itertools.chain.from_iterable(generated_logprobs)), dtype=torch.float32)
    reference_lp = torch.cat(reference_lp)
    figures = summarize(torch.cat(kl), generated, reference_lp, torch.cat(top1), [len(lp) for lp in generated_logprobs])
    figures["rollout_logprob_consistency"] = float((generated - torch.cat(rollout_tf)).abs().max())
    return figures, reference_lp.double() - generated.double()


def perplexity_of(scorer: Scorer, windows: list[list[int]], batch: int) -> float:
    """:func:`perplexity` of ``windows``, scored ``batch`` windows at a time."""
    logits = []
    for start in range(0, len(windows), batch):
        logits.extend(lg.cpu() for lg in scorer(windows[start : start + batch]))
    return perplexity(logits, windows)


# ----------------------------------------------------------------------------- the run


def run(
    path,
    *,
    schemes: Sequence[str] = SCHEMES,
    kv_cache_dtypes: Sequence[str] = KV_CACHE_DTYPES,
    prompts: list | None = None,
    num_prompts: int | None = None,
    max_tokens: int | None = None,
    seed: int = 0,
    reference: str = "ours",
    reference_dtype=None,
    dtype=None,
    device: str = "cpu",
    perplexity_tokens: int | None = None,
    window: int = DEFAULT_WINDOW,
    max_batch_size: int | None = None,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Measure every (scheme, KV cache dtype) configuration against one reference; returns the results dict
    (``results``: one row per configuration, in order; :func:`table` formats it).

    Args:
        path: a BF16 Hugging Face checkpoint directory.
        schemes: quantization schemes of the rollout engine ("none": unquantized).
        kv_cache_dtypes: "auto" and / or "fp8"; every scheme runs with each.
        prompts: the prompts (strings or token-id lists); default ``num_prompts`` passages of the real text
            (:func:`text_prompts`), or random ids when the checkpoint has no tokenizer.
        num_prompts, max_tokens, perplexity_tokens: default :data:`PROBLEMS` of the device type.
        max_tokens: tokens generated per prompt (exactly: ``ignore_eos``).
        seed: request i samples with seed + i; also draws the prompts.
        reference: "ours" (an unquantized Engine of ``path``) or "transformers".
        reference_dtype, dtype: the reference's and the rollout engines' dtype (default: the checkpoint's).
        perplexity_tokens, window: perplexity on this many tokens of the real text, in windows of ``window``
            tokens (0: no perplexity).
        max_batch_size: the engines' KV cache slots and the scoring batch (default: the prompts, at most 32).
        log: called with a line per finished configuration (default: print to stderr).
    Raises:
        ValueError: an unknown scheme or KV cache dtype or reference (before anything loads).
        what :meth:`Engine.from_pretrained` raises.
    """
    from layerwise.benchmarks.machine import describe_machine, provenance
    from layerwise.dtypes import parse_dtype
    from layerwise.engine import Engine
    from layerwise.layers.kv_cache import check_kv_cache_dtype
    from layerwise.quant.config import parse_scheme

    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    defaults = PROBLEMS["cuda" if torch.device(device).type == "cuda" else "cpu"]
    num_prompts = defaults[0] if num_prompts is None else num_prompts
    max_tokens = defaults[1] if max_tokens is None else max_tokens
    perplexity_tokens = defaults[2] if perplexity_tokens is None else perplexity_tokens
    for scheme in schemes:
        parse_scheme(scheme)
    for kv in kv_cache_dtypes:
        check_kv_cache_dtype(kv)
    if reference not in REFERENCES:
        raise ValueError(f"reference must be one of {', '.join(REFERENCES)}, got {reference!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    began = time.monotonic()
    path = Path(path)
    dtype, reference_dtype = parse_dtype(dtype), parse_dtype(reference_dtype)

    tokenizer = _tokenizer(path)
    vocab = _config(path)["vocab_size"]
    if prompts is None:
        if tokenizer is not None:
            prompts = text_prompts(num_prompts, seed)
            source = f"layerwise.texts.prompts(n, words={PROMPT_WORDS}, seed={seed})"
        else:
            prompts = random_prompts(num_prompts, vocab, seed)
            source = "random token ids (no tokenizer)"
    else:
        source = "given"
    prompt_ids = [tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    ppl_ids, ppl_source = perplexity_ids(tokenizer, vocab, perplexity_tokens, seed) if perplexity_tokens else ([], "")
    windows = perplexity_windows(ppl_ids, perplexity_tokens, window) if perplexity_tokens else []
    # every engine's slots fit the longest prompt + completion and the perplexity windows
    max_seq_len = max(max(map(len, prompt_ids)) + max_tokens, max(map(len, windows), default=0)) + 1
    batch = max_batch_size or min(len(prompts), 32)

    if reference == "ours":
        ref_engine = Engine.from_pretrained(
            path, batch, max_seq_len, tokenizer=False, quantization=None, dtype=reference_dtype, device=device
        )
        reference_scorer, resolved_reference_dtype = engine_scorer(ref_engine), ref_engine.dtype
    else:
        resolved_reference_dtype = reference_dtype or _checkpoint_dtype(path)
        reference_scorer = transformers_scorer(path, resolved_reference_dtype, device, batch)
    reference_ppl = perplexity_of(reference_scorer, windows, batch) if windows else None
    name = model_name(path)

    rows, log_ratios = [], {}
    for scheme, kv in itertools.product(schemes, kv_cache_dtypes):
        start = time.monotonic()
        engine = Engine.from_pretrained(
            path,
            batch,
            max_seq_len,
            tokenizer=tokenizer if tokenizer is not None else False,
            quantization=_quantization(scheme),
            dtype=dtype,
            device=device,
            kv_cache_dtype=kv,
        )
        sequences, prompt_lengths, generated = rollouts(engine, prompt_ids, max_tokens, seed)
        clamped = engine.kv_clamped_fraction if kv == "fp8" else None  # of the rollouts' generate
        figures, log_r = compare(engine_scorer(engine), reference_scorer, sequences, prompt_lengths, generated, batch)
        row = {
            "scheme": scheme if scheme == "none" else _canonical(scheme),
            "kv_cache_dtype": kv,
            "model": name,
            **figures,
            "perplexity": perplexity_of(engine_scorer(engine), windows, batch) if windows else None,
            "reference_perplexity": reference_ppl,
            "kv_clamped_fraction": clamped,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "seconds": time.monotonic() - start,
        }
        rows.append(row)
        log_ratios[(row["scheme"], kv)] = log_r
        log(f"  mismatch: {_line(row)}")
        del engine

    return {
        "benchmark": "mismatch",
        **provenance(device, size=name),
        "device": device,
        "model": name,
        "checkpoint": str(path),
        "reference": {
            "kind": reference,
            "dtype": str(resolved_reference_dtype).removeprefix("torch."),
            "kv_cache_dtype": "auto" if reference == "ours" else None,
        },
        "problem": {
            "prompts": len(prompt_ids),
            "prompt_source": source,
            "prompt_tokens": [min(map(len, prompt_ids)), max(map(len, prompt_ids))],
            "max_tokens": max_tokens,
            "seed": seed,
            "sampling": {"temperature": 1.0, "ignore_eos": True, "seed": "seed + request index", "logprobs": 0},
            "perplexity_text": ppl_source or None,
            "perplexity_tokens": sum(len(w) for w in windows),
            "perplexity_window": max(map(len, windows), default=0),
            "max_batch_size": batch,
            "max_seq_len": max_seq_len,
        },
        "total_seconds": time.monotonic() - began,
        "machine": describe_machine(device),
        "results": rows,
        "log_ratio_histogram": histogram(log_ratios),
    }


def _canonical(scheme: str) -> str:
    from layerwise.quant.config import parse_scheme

    name, argument = parse_scheme(scheme)
    return f"{name}:{argument}" if argument else name


def _config(path) -> dict:
    import json

    return json.loads((Path(path) / "config.json").read_text())


def _checkpoint_dtype(path) -> torch.dtype:
    """config.json's dtype (``dtype`` or ``torch_dtype``), else bfloat16."""
    from layerwise.dtypes import parse_dtype

    config = _config(path)
    return parse_dtype(config.get("dtype") or config.get("torch_dtype") or "bfloat16")


def _tokenizer(path):
    """The checkpoint's tokenizer, or None when it has none (or transformers is missing: token ids then)."""
    from layerwise.errors import MissingDependencyError
    from layerwise.tokenizer import has_tokenizer, load_tokenizer

    if not has_tokenizer(path):
        return None
    try:
        return load_tokenizer(path)
    except MissingDependencyError:
        return None


def histogram(log_ratios: dict[tuple[str, str], torch.Tensor], bins: int = HISTOGRAM_BINS) -> dict:
    """Counts of log r_t per configuration over shared edges, symmetric around 0 and wide enough for every value
    (the plot's data, kept in the JSON so that the plot can be redrawn from it)."""
    if not log_ratios:
        return {"edges": [], "counts": {}}
    widest = max(float(v.abs().max()) for v in log_ratios.values())
    half = max(widest * 1.001, 1e-6)
    edges = torch.linspace(-half, half, bins + 1, dtype=torch.float64)
    counts = {
        f"{scheme} / kv {kv}": torch.histc(v, bins=bins, min=-half, max=half).long().tolist()
        for (scheme, kv), v in log_ratios.items()
    }
    return {"edges": edges.tolist(), "counts": counts}


# ----------------------------------------------------------------------------- output


def _g(value, fmt: str = ".3g") -> str:
    return "" if value is None else format(value, fmt)


def _line(row: dict) -> str:
    return (
        f"{row['scheme']} / kv {row['kv_cache_dtype']}: mean KL {row['mean_kl']:.3g}, |dlogp| mean "
        f"{row['mean_abs_logprob_diff']:.3g} max {row['max_abs_logprob_diff']:.3g}, r p1/p50/p99 "
        f"{row['ratio_p1']:.3f}/{row['ratio_p50']:.3f}/{row['ratio_p99']:.3f}, {row['seconds']:.1f} s"
    )


#: the table's columns: (header, key, format); COMPACT: the ones the README's front-door table shows
COLUMNS = [
    ("scheme", "scheme", "s"),
    ("KV cache", "kv_cache_dtype", "s"),
    ("tokens", "tokens", "d"),
    ("mean KL", "mean_kl", ".3g"),
    ("mean abs dlogp", "mean_abs_logprob_diff", ".3g"),
    ("max abs dlogp", "max_abs_logprob_diff", ".3g"),
    ("r p1", "ratio_p1", ".3f"),
    ("r p50", "ratio_p50", ".3f"),
    ("r p99", "ratio_p99", ".3f"),
    ("r > 2", "frac_ratio_above_2", ".2%"),
    ("top-1 agree", "top1_agreement", ".1%"),
    ("seq log-ratio mean", "sequence_log_ratio_mean", ".3g"),
    ("mean abs", "sequence_log_ratio_mean_abs", ".3g"),
    ("max abs", "sequence_log_ratio_max_abs", ".3g"),
    ("decode/prefill max abs dlogp", "rollout_logprob_consistency", ".3g"),
    ("perplexity", "perplexity", ".2f"),
    ("reference ppl", "reference_perplexity", ".2f"),
]
COMPACT = ["scheme", "kv_cache_dtype", "mean_kl", "ratio_p1", "ratio_p99", "frac_ratio_above_2", "top1_agreement"]
COMPACT += ["perplexity", "reference_perplexity"]


def table(result: dict, compact: bool = False) -> str:
    """The results as a markdown table, one row per configuration: every figure, or with ``compact`` the
    :data:`COMPACT` columns (scheme, KV cache, mean KL, r p1 / p99, r > 2, top-1 agreement, perplexities)."""
    columns = [c for c in COLUMNS if not compact or c[1] in COMPACT]
    lines = [
        "| " + " | ".join(header for header, _, _ in columns) + " |",
        "|" + "|".join("---" if fmt == "s" else "---:" for _, _, fmt in columns) + "|",
    ]
    for r in result["results"]:
        lines.append("| " + " | ".join(_g(r.get(key), fmt) for _, key, fmt in columns) + " |")
    return "\n".join(lines)


def describe(result: dict) -> str:
    """One paragraph saying what the table measured (model, reference, problem, machine, commit)."""
    p, ref = result["problem"], result["reference"]
    lo, hi = p["prompt_tokens"]
    ppl = (
        f" Perplexity: {p['perplexity_tokens']} tokens of {p['perplexity_text']} in windows of "
        f"{p['perplexity_window']}."
        if p.get("perplexity_text")
        else ""
    )
    return (
        f"Model {result['model']} ({result['checkpoint']}) on {result['device']}; reference: {ref['kind']} "
        f"({ref['dtype']}). {p['prompts']} prompts ({p['prompt_source']}, {lo}-{hi} tokens), {p['max_tokens']} "
        f"tokens each, temperature 1, seed {p['seed']}.{ppl} Commit {result.get('commit')}, {result.get('date')}, "
        f"{result['total_seconds']:.0f} s."
    )


def plot(result: dict, path: Path) -> Path:
    """The distribution of log r_t per scheme (one panel per KV cache dtype, log-scaled counts, the TIS cap
    marked), from the result's ``log_ratio_histogram``; written as a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist = result["log_ratio_histogram"]
    edges = hist["edges"]
    kvs = list(dict.fromkeys(r["kv_cache_dtype"] for r in result["results"]))
    fig, axes = plt.subplots(1, len(kvs), figsize=(6 * len(kvs), 4.2), sharey=True, squeeze=False)
    for ax, kv in zip(axes[0], kvs, strict=True):
        for r in result["results"]:
            if r["kv_cache_dtype"] != kv:
                continue
            counts = hist["counts"][f"{r['scheme']} / kv {kv}"]
            ax.stairs(counts, edges, label=r["scheme"], linewidth=1.4)
        if edges and edges[-1] > math.log(TIS_CAP):
            ax.axvline(math.log(TIS_CAP), color="grey", linestyle="--", linewidth=1, label="r = 2 (TIS cap)")
        ax.set_yscale("log")
        ax.set_xlabel("log r = logp_reference - logp_rollout (sampled token)")
        ax.set_title(f"KV cache {kv}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("tokens")
    fig.suptitle(f"Token-level importance ratios, {result['model']} ({result['device']}, {result['commit']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- command line


def schemes_list(text: str) -> list[str]:
    """argparse type: schemes separated by commas, each checked (canonical names; "none" kept)."""
    from layerwise.quant.config import parse_scheme

    out = []
    for part in text.split(","):
        try:
            name, argument = parse_scheme(part.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from e
        out.append(f"{name}:{argument}" if argument else name)
    return out


def kv_list(text: str) -> list[str]:
    """argparse type: KV cache dtypes separated by commas."""
    from layerwise.layers.kv_cache import check_kv_cache_dtype

    try:
        return [check_kv_cache_dtype(part.strip()) for part in text.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def nonnegative_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``layerwise mismatch`` and ``python -m layerwise.benchmarks.mismatch`` share."""
    from layerwise.benchmarks.options import positive_int
    from layerwise.cli import dtype_argument

    parser.add_argument(
        "path",
        nargs="?",
        default=None,
        help="BF16 checkpoint directory (default: the real checkpoint if fetched, else the demo checkpoint)",
    )
    parser.add_argument(
        "--quantization",
        type=schemes_list,
        default=SCHEMES,
        metavar="S1,S2",
        help=f"rollout schemes, comma-separated; none = unquantized (default: {','.join(SCHEMES)})",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        type=kv_list,
        default=KV_CACHE_DTYPES,
        metavar="auto,fp8",
        help="KV cache dtypes of the rollout engine, each with every scheme (default: auto,fp8)",
    )
    parser.add_argument(
        "--prompts",
        type=positive_int,
        default=None,
        help=f"prompts (default {PROBLEMS['cpu'][0]} on cpu, {PROBLEMS['cuda'][0]} on cuda)",
    )
    parser.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help=f"tokens generated per prompt (default {PROBLEMS['cpu'][1]} on cpu, {PROBLEMS['cuda'][1]} on cuda)",
    )
    parser.add_argument("--seed", type=int, default=0, help="request i samples with seed + i; draws the prompts")
    parser.add_argument(
        "--reference",
        choices=REFERENCES,
        default="ours",
        help="who scores the rollouts: ours (an unquantized engine, default) or transformers",
    )
    parser.add_argument(
        "--reference-dtype",
        type=dtype_argument,
        default=None,
        help="the reference's dtype: bfloat16 | float32 (default: the checkpoint's)",
    )
    parser.add_argument(
        "--dtype", type=dtype_argument, default=None, help="the rollout engines' dtype (default: the checkpoint's)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument(
        "--perplexity-tokens",
        type=nonnegative_int,
        default=None,
        metavar="N",
        help=f"tokens of the real text perplexity is measured on, 0: none (default {PROBLEMS['cpu'][2]} on cpu, "
        f"{PROBLEMS['cuda'][2]} on cuda)",
    )
    parser.add_argument(
        "--max-batch-size", type=positive_int, default=None, help="KV cache slots (default: the prompts, at most 32)"
    )
    parser.add_argument(
        "--cache-dir", default=None, help="where the demo checkpoint is written (default: $LAYERWISE_CACHE)"
    )


def run_from_args(args, path, log: Callable[[str], None] | None = None) -> dict:
    """:func:`run` with the shared options."""
    return run(
        path,
        schemes=args.quantization,
        kv_cache_dtypes=args.kv_cache_dtype,
        num_prompts=args.prompts,
        max_tokens=args.max_tokens,
        seed=args.seed,
        reference=args.reference,
        reference_dtype=args.reference_dtype,
        dtype=args.dtype,
        device=args.device,
        perplexity_tokens=args.perplexity_tokens,
        max_batch_size=args.max_batch_size,
        log=log,
    )


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/mismatch_<device>_<model>.json and .png, print the table."""
    from layerwise.benchmarks.options import RESULTS_NOTE, add_output_arguments, require, write_json

    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.mismatch",
        description=__doc__,
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    add_output_arguments(parser, default_name="mismatch_<device>_<model>", checkpoint=False)
    parser.add_argument("--no-plot", action="store_true", help="write no PNG (matplotlib not needed)")
    args = parser.parse_args(argv)
    require(
        (["matplotlib"] if not args.no_plot else []) + (["transformers"] if args.reference == "transformers" else []),
        purpose="python -m layerwise.benchmarks.mismatch",
    )
    path = Path(args.path) if args.path else default_checkpoint(args.cache_dir)
    if not (path / "config.json").is_file():
        parser.error(f"{path}: not a checkpoint directory (no config.json)")
    result = run_from_args(args, path)
    kind = "cuda" if torch.device(args.device).type == "cuda" else "cpu"
    out = write_json(result, args.out_dir, args.name or f"mismatch_{kind}_{result['model']}")
    print(describe(result))
    print(table(result))
    if not args.no_plot:
        print(f"written to {out} and {plot(result, out.with_suffix('.png'))}")
    else:
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
