"""Rollout throughput: generated tokens per second of ``Engine.generate`` for BF16 and every FP8 scheme, against
transformers' ``generate`` on the same prompts and the same BF16 checkpoint (issue 31).

The problem: ``--prompts`` prompts of random token ids, their lengths drawn uniformly from
``--prompt-len MIN,MAX`` (one fixed ``--seed`` draws both), each completed with exactly ``--max-tokens`` new
tokens (temperature 1.0, ``ignore_eos=True``; request i samples with its own generator, seed + i). Per
configuration, each in a fresh process:

  none, fp8-per-tensor,     ``layerwise.load_model(quantization=scheme)`` (fp8_mode auto), ``Engine(model,
  fp8-per-channel,          max_batch_size=batch)``, one warm-up generate, then one timed
  fp8-per-block             ``generate(prompts, [SamplingParams(...) per prompt])``: continuous batching over
                            ``batch`` KV cache slots, all prompts in one call
  <scheme>+kv-fp8           the same with ``Engine(..., kv_cache_dtype="fp8")`` (none+kv-fp8: BF16 weights, FP8
                            KV cache); the row adds the cache's bytes and ``kv_clamped_fraction``
  transformers              ``AutoModelForCausalLM`` in BF16, ``generate`` over left-padded batches of ``batch``
                            prompts in order (do_sample, temperature 1.0, top_k 0, top_p 1.0,
                            min_new_tokens = max_new_tokens = --max-tokens), one warm-up batch first

at every ``--batches`` size. The warm-up generate takes the first ``batch`` prompts (cut to
``--warmup-prompt-len`` tokens when given) and lets their completions end one capture size apart, so the timed
call finds every decode batch size it may step through already captured (CUDA graphs) and compiled.
Seconds: the wall time of the timed call (transformers: of its calls over every batch), CUDA synchronized, the
fastest of ``--repeats`` (each with the same seeds, so the same tokens); tokens/s = generated tokens / seconds. The
engine's rows also split the call into its prefill and decode forwards (the runner's calls timed, sampling
excluded) and give the time to the first prefill's logits (the first prompts' first tokens). Each row records
the 1-minute load average before each timed call: on a shared machine other processes slow CPU figures. A
configuration that fails or runs out of its share of ``--budget`` is recorded with its reason; the others still
run.

    python -m layerwise.benchmarks.rollout [--device cpu|cuda] [--size SIZE] [--prompts N] [--prompt-len MIN,MAX]
        [--max-tokens N] [--batches 8,64] [--configs none,fp8-per-tensor,...] [--repeats N] [--budget S]
        [--out-dir DIR]

Defaults: on CUDA the issue's problem (8b checkpoint, 64 prompts of 64..192 tokens, 128 new tokens), one timed
call, no time limit; on CPU a smaller one that runs in minutes on two cores (:data:`PROBLEMS`), the fastest of
three calls, within 900 s.
Writes DIR/rollout_<device>_<size>.json (every row, the problem as run, the ratios FP8 / BF16 and engine /
transformers, the targets and whether each is met) and prints the table. Targets: on a GPU, FP8 >= 1.3x the BF16
engine's tokens/s at batch 64; on CPU, FP8 >= 0.8x BF16 for each scheme at each batch.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from layerwise.benchmarks.checkpoints import make_checkpoint
from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import (
    add_output_arguments,
    benchmark_parser,
    default_cache_dir,
    positive_int,
    require,
    write_json,
)
from layerwise.benchmarks.workers import run_worker

FP8_SCHEMES = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]
TRANSFORMERS = "transformers"  # the configuration name of transformers' generate
KV_FP8 = "+kv-fp8"  # a configuration's suffix for Engine(kv_cache_dtype="fp8")
# the BF16 engine first: every ratio needs it
CONFIGS = ["none", *FP8_SCHEMES, *(f"{s}{KV_FP8}" for s in ("none", *FP8_SCHEMES)), TRANSFORMERS]
BATCHES = [8, 64]
# issue 31's targets: FP8 tokens/s over BF16 tokens/s (a target, not a measurement), and the batches they apply at
FP8_OVER_BF16 = {"cuda": 1.3, "cpu": 0.8}
TARGET_BATCHES = {"cuda": [64], "cpu": None}  # None: every batch run
DEFAULT_BUDGET = {"cuda": None, "cpu": 900.0}  # seconds for the whole run (None: no limit)
DEFAULT_REPEATS = {"cuda": 1, "cpu": 3}  # timed calls per configuration, the fastest counts (CPU: shared machines)
# a configuration's weight in the budget's shares: transformers' generate loads slower and steps slower
WEIGHTS = {TRANSFORMERS: 2.0}


@dataclass(frozen=True)
class Problem:
    """What every configuration generates: the prompts (drawn from ``seed``) and the tokens per prompt.

    Attributes:
        size: the benchmark checkpoint (benchmarks/checkpoints.py).
        prompts: how many prompts.
        min_prompt_len / max_prompt_len: each prompt's length is drawn uniformly from this range (inclusive).
        max_tokens: tokens generated per prompt, exactly (ignore_eos; min_new_tokens for transformers).
        seed: draws the lengths and token ids; request i samples with seed + i.
        warmup_prompt_len: the warm-up's prompts are cut to this many tokens (None: whole).
    """

    size: str
    prompts: int
    min_prompt_len: int
    max_prompt_len: int
    max_tokens: int
    seed: int = 0
    warmup_prompt_len: int | None = None


#: the default problem per device type: the issue's on a GPU; on CPU, the small checkpoint and fewer, shorter
#: prompts (a BF16 GEMM runs at a few GFLOP/s on a 2-core AVX2 CPU: the issue's problem on the default
#: checkpoint would take hours)
PROBLEMS = {
    "cuda": Problem(size="8b", prompts=64, min_prompt_len=64, max_prompt_len=192, max_tokens=128),
    "cpu": Problem(size="small", prompts=64, min_prompt_len=32, max_prompt_len=96, max_tokens=64, warmup_prompt_len=16),
}


def make_prompts(problem: Problem, vocab_size: int) -> list[list[int]]:
    """The problem's prompts: lengths uniform in [min_prompt_len, max_prompt_len], ids uniform in
    [0, vocab_size), both from one ``torch.Generator`` seeded with ``problem.seed`` (the same on every machine)."""
    g = torch.Generator().manual_seed(problem.seed)
    lengths = torch.randint(problem.min_prompt_len, problem.max_prompt_len + 1, (problem.prompts,), generator=g)
    return [torch.randint(0, vocab_size, (int(n),), generator=g).tolist() for n in lengths]


def prompts_digest(prompts: list[list[int]]) -> str:
    """sha1 of the prompts' ids (as JSON): equal digests, equal prompts."""
    return hashlib.sha1(json.dumps(prompts).encode()).hexdigest()


def warmup_max_tokens(count: int, capture_sizes: list[int]) -> list[int]:
    """max_tokens of the warm-up's ``count`` sequences: sequence i gets 1 + the number of capture sizes above i,
    so after the prefill the running batch steps down through every capture size up to ``count`` (one decode
    step each: 64, 56, 48, ..., 2, 1 for batch 64)."""
    return [1 + sum(s > i for s in capture_sizes) for i in range(count)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _TimedRunner:
    """An engine's ModelRunner whose prefill and decode calls are timed (CUDA synchronized after each: the step's
    sampling reads its tokens back right after anyway); everything else is the runner's own."""

    def __init__(self, runner, device: torch.device):
        self._runner, self._device = runner, device
        self.start: float | None = None  # set by the caller just before the timed generate
        self.prefill_seconds = self.decode_seconds = 0.0
        self.prefills = self.decodes = 0
        self.first_prefill_end: float | None = None

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def prefill(self, *args, **kwargs):
        """The runner's prefill, timed."""
        began = time.perf_counter()
        out = self._runner.prefill(*args, **kwargs)
        _sync(self._device)
        end = time.perf_counter()
        self.prefill_seconds += end - began
        self.prefills += 1
        if self.first_prefill_end is None:
            self.first_prefill_end = end
        return out

    def decode(self, *args, **kwargs):
        """The runner's decode step, timed."""
        began = time.perf_counter()
        out = self._runner.decode(*args, **kwargs)
        _sync(self._device)
        self.decode_seconds += time.perf_counter() - began
        self.decodes += 1
        return out


def _fastest(runs: list[dict]) -> dict:
    """The fastest of the timed calls (its fields, and tokens/s from them), with every call's seconds and load
    average beside it."""
    best = min(runs, key=lambda r: r["seconds"])
    return dict(
        best,
        tokens_per_second=best["tokens"] / best["seconds"],
        seconds_each=[r["seconds"] for r in runs],
        load_average_each=[r["load_average"] for r in runs],
    )


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def engine_rollout(path: str, device: str, scheme: str, batch: int, problem: dict, repeats: int = 1):
    """Worker: load ``path`` with ``scheme`` (fp8_mode auto; a name ending in :data:`KV_FP8` adds an FP8 KV cache),
    warm up, time ``repeats`` calls of ``Engine.generate`` of the problem's prompts with ``max_batch_size=batch``;
    yields one row, the fastest call's figures (or the error that stopped it)."""
    import layerwise
    from layerwise.engine import Engine
    from layerwise.sampling_params import SamplingParams

    device = torch.device(device)
    problem = Problem(**problem)
    config, kv_cache_dtype = scheme, "fp8" if scheme.endswith(KV_FP8) else "auto"
    scheme = scheme.removesuffix(KV_FP8)
    row = {"config": config, "engine": "layerwise", "scheme": scheme, "fp8_mode": "auto", "batch": batch}
    row["kv_cache_dtype"] = kv_cache_dtype
    try:
        start = time.perf_counter()
        model = layerwise.load_model(path, quantization=scheme, device=device)
        row["load_seconds"] = time.perf_counter() - start
        prompts = make_prompts(problem, model.config.vocab_size)
        row["prompts_sha1"] = prompts_digest(prompts)
        max_seq_len = problem.max_prompt_len + problem.max_tokens
        engine = Engine(model, max_batch_size=batch, max_seq_len=max_seq_len, kv_cache_dtype=kv_cache_dtype)
        row["kv_cache_bytes"] = sum(t.untyped_storage().nbytes() for c in engine.kv_caches for t in c)

        # the warm-up: every capture size the timed call may step through, once
        count = min(batch, len(prompts))
        cut = problem.warmup_prompt_len or problem.max_prompt_len
        lengths = warmup_max_tokens(count, engine.runner.capture_sizes)
        warm = [SamplingParams(max_tokens=n, ignore_eos=True, seed=problem.seed + i) for i, n in enumerate(lengths)]
        start = time.perf_counter()
        engine.generate([p[:cut] for p in prompts[:count]], warm)
        _sync(device)
        row["warmup_seconds"] = time.perf_counter() - start

        params = [
            SamplingParams(temperature=1.0, max_tokens=problem.max_tokens, ignore_eos=True, seed=problem.seed + i)
            for i in range(len(prompts))
        ]
        runner = engine.runner

        def timed_generate() -> dict:  # one timed call, its forwards timed by a wrapper of the runner
            timed = engine.runner = _TimedRunner(runner, device)
            try:
                gc.collect()
                _sync(device)
                load = os.getloadavg()[0]
                start = time.perf_counter()
                outputs = engine.generate(prompts, params)  # same seeds every time: the same tokens
                _sync(device)
                seconds = time.perf_counter() - start
            finally:
                engine.runner = runner
            tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
            return dict(
                tokens=tokens,
                all_max_tokens=all(len(c.token_ids) == problem.max_tokens for o in outputs for c in o.outputs),
                seconds=seconds,
                load_average=load,
                prefill_seconds=timed.prefill_seconds,
                decode_seconds=timed.decode_seconds,
                ttft_seconds=timed.first_prefill_end - start,
                prefill_steps=timed.prefills,
                decode_steps=timed.decodes,
                mean_decode_batch=(tokens - len(prompts)) / max(timed.decodes, 1),
            )

        row.update(prompts=len(prompts), prompt_tokens=sum(len(p) for p in prompts))
        row.update(_fastest([timed_generate() for _ in range(repeats)]))
        row.update(cuda_graph=engine.use_cuda_graph, captures=engine.captures)
        if kv_cache_dtype == "fp8":
            row["kv_clamped_fraction"] = engine.kv_clamped_fraction
    except Exception as e:  # recorded; the next configuration still runs
        row["error"] = _error(e)
    yield row


def transformers_rollout(path: str, device: str, batch: int, problem: dict, repeats: int = 1):
    """Worker: transformers' ``generate`` on the BF16 checkpoint at ``path`` over left-padded batches of ``batch``
    prompts, sampling at temperature 1.0 with exactly ``max_tokens`` new tokens each, ``repeats`` times; yields one
    row, the fastest pass's figures."""
    import transformers

    from layerwise.benchmarks.peak_memory import _hf_dtype, _hf_placement

    device = torch.device(device)
    problem = Problem(**problem)
    row = {"config": TRANSFORMERS, "engine": "transformers", "scheme": "none", "batch": batch}
    try:
        start = time.perf_counter()
        placement, move = _hf_placement(device)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **placement, **_hf_dtype()).to(move).eval()
        row["load_seconds"] = time.perf_counter() - start
        prompts = make_prompts(problem, model.config.vocab_size)
        row["prompts_sha1"] = prompts_digest(prompts)
        pad = 0  # the padded positions are masked out; any id does

        def left_padded(group: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            width = max(len(p) for p in group)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in group], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
            return ids, mask

        def generate(group: list[list[int]], new_tokens: int) -> torch.Tensor:
            ids, mask = left_padded(group)
            with torch.inference_mode():
                out = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    do_sample=True,
                    temperature=1.0,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    pad_token_id=pad,
                )
            return out[:, ids.shape[1] :]

        cut = problem.warmup_prompt_len or problem.max_prompt_len
        start = time.perf_counter()
        generate([p[:cut] for p in prompts[:batch]], 2)
        _sync(device)
        row["warmup_seconds"] = time.perf_counter() - start

        groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]

        def timed_generate() -> dict:  # one timed pass over every group
            torch.manual_seed(problem.seed)
            gc.collect()
            _sync(device)
            load = os.getloadavg()[0]
            start = time.perf_counter()
            generated = [generate(group, problem.max_tokens) for group in groups]
            _sync(device)
            seconds = time.perf_counter() - start
            return dict(
                tokens=sum(g.numel() for g in generated),
                all_max_tokens=all(g.shape[1] == problem.max_tokens for g in generated),
                seconds=seconds,
                load_average=load,
            )

        row.update(
            prompts=len(prompts),
            prompt_tokens=sum(len(p) for p in prompts),
            padded_prompt_tokens=sum(len(group) * max(len(p) for p in group) for group in groups),
            generate_calls=len(groups),
        )
        row.update(_fastest([timed_generate() for _ in range(repeats)]))
    except Exception as e:  # recorded; the engine's rows still stand
        row["error"] = _error(e)
    yield row


def ratios(rows: list[dict], device: str) -> dict:
    """The issue's figures from the rows: FP8 / BF16 tokens/s per scheme and batch, engine / transformers per
    configuration and batch, the targets and ``met`` ({"rollout <scheme> batch <b>": bool}) where one applies."""
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    tps = {(r["config"], r["batch"]): r["tokens_per_second"] for r in rows if "tokens_per_second" in r}
    target = FP8_OVER_BF16[kind]
    batches = sorted({b for _, b in tps})
    judged = TARGET_BATCHES[kind] or batches
    out = {
        "fp8_over_bf16": {},  # "<scheme> batch <b>" -> FP8 tokens/s / BF16 tokens/s (higher is better)
        "over_transformers": {},  # "<config> batch <b>" -> engine tokens/s / transformers tokens/s
        "targets": {"fp8_over_bf16": target, "batches": TARGET_BATCHES[kind] or "every batch"},
        "met": {},
    }
    for (config, batch), value in sorted(tps.items(), key=lambda kv: (kv[0][1], CONFIGS.index(kv[0][0]))):
        key = f"{config} batch {batch}"
        if config not in ("none", TRANSFORMERS) and ("none", batch) in tps:
            out["fp8_over_bf16"][key] = value / tps[("none", batch)]
            if batch in judged and not config.startswith("none"):  # the target is for FP8 weights
                out["met"][f"rollout {key}"] = out["fp8_over_bf16"][key] >= target
        if config != TRANSFORMERS and (TRANSFORMERS, batch) in tps:
            out["over_transformers"][key] = value / tps[(TRANSFORMERS, batch)]
    return out


def run(
    device: str,
    cache: Path,
    problem: Problem | None = None,
    configs: list[str] | None = None,
    batches: list[int] | None = None,
    budget: float | None = None,
    skipped: dict[str, str] | None = None,
    repeats: int | None = None,
) -> dict:
    """Run every configuration at every batch, each in a fresh process, on the problem's checkpoint (generated under
    ``cache`` if needed); returns the result that main writes as JSON.

    Args:
        problem: default :data:`PROBLEMS` for the device type.
        configs: a subset of :data:`CONFIGS` (default: all).
        batches: the engine's ``max_batch_size`` values, and transformers' batch sizes (default :data:`BATCHES`).
        budget: seconds for the whole run, checkpoint generation included; each process gets its share of
            what is left (what an earlier one did not use passes on; transformers' processes count double).
            None: no limit.
        skipped: configuration -> why it was not run (recorded as such at every batch).
        repeats: timed calls per configuration, the fastest counts (default :data:`DEFAULT_REPEATS`).
    """
    began = time.monotonic()
    kind = "cuda" if torch.device(device).type == "cuda" else "cpu"
    problem = problem or PROBLEMS[kind]
    configs = CONFIGS if configs is None else configs
    batches = BATCHES if batches is None else batches
    skipped = skipped or {}
    repeats = DEFAULT_REPEATS[kind] if repeats is None else repeats
    path = make_checkpoint(problem.size, cache, device=device, verbose=True)
    if kind == "cuda":
        torch.cuda.empty_cache()  # the generator's blocks: the GPU is the workers' now
    todo = [(c, b) for b in batches for c in configs if c not in skipped]
    rows = []
    for i, (config, batch) in enumerate(todo):
        timeout = None
        if budget is not None:
            left = budget - (time.monotonic() - began)
            if left <= 1:
                rows.append({"config": config, "batch": batch, "error": "skipped: the run's time budget was spent"})
                continue
            timeout = left * WEIGHTS.get(config, 1.0) / sum(WEIGHTS.get(c, 1.0) for c, _ in todo[i:])
        kwargs = dict(path=str(path), device=device, batch=batch, problem=asdict(problem), repeats=repeats)
        if config == TRANSFORMERS:
            out = run_worker("rollout", "transformers_rollout", kwargs, timeout)
        else:
            out = run_worker("rollout", "engine_rollout", dict(kwargs, scheme=config), timeout)
        row = out.rows[0] if out.rows else {"config": config, "batch": batch, "error": out.error or "no row"}
        row["process_seconds"] = out.seconds
        rows.append(row)
        print(f"  rollout: {_line(row)}", file=sys.stderr)
    rows += [{"config": c, "batch": b, "error": why} for b in batches for c, why in skipped.items()]
    return {
        "benchmark": "rollout",
        **provenance(device, problem.size, checkpoint_shape(problem.size)),
        "device": device,
        "checkpoint": str(path),
        "problem": asdict(problem),
        "sampling": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "ignore_eos": True, "seed": "problem seed + i"},
        "max_seq_len": problem.max_prompt_len + problem.max_tokens,
        "repeats": repeats,
        "batches": batches,
        "configs": configs,
        "budget_seconds": budget,
        "total_seconds": time.monotonic() - began,
        "machine": describe_machine(device),
        "results": rows,
        **ratios(rows, device),
    }


def _line(row: dict) -> str:
    what = f"{row['config']} batch {row['batch']}"
    if "error" in row:
        return f"{what}: {row['error']}"
    return f"{what}: {row['tokens']} tokens in {row['seconds']:.2f} s, {row['tokens_per_second']:.1f} tokens/s"


def _pair(text: str) -> tuple[int, int]:
    """argparse type: "MIN,MAX" (or "N": MIN = MAX = N), integers with 1 <= MIN <= MAX."""
    low, _, high = text.partition(",")
    low, high = positive_int(low), positive_int(high or low)
    if low > high:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX with MIN <= MAX, got {text}")
    return low, high


def _int_list(text: str) -> list[int]:
    """argparse type: positive integers separated by commas."""
    return [positive_int(part) for part in text.split(",")]


def main(argv=None) -> int:
    """Parse ``argv``, run, write DIR/rollout_<device>_<size>.json, print the table.

    Raises:
        MissingDependencyError: transformers (the checkpoint's config.json and the comparison) is missing;
            checked first.
    """
    parser = benchmark_parser(
        "python -m layerwise.benchmarks.rollout",
        __doc__,
        size_help="checkpoint size (default: 8b on cuda, small on cpu)",
    )
    parser.set_defaults(size=None)
    parser.add_argument("--prompts", type=positive_int, default=None, help="prompts (default: 64)")
    parser.add_argument(
        "--prompt-len",
        type=_pair,
        default=None,
        metavar="MIN,MAX",
        help="prompt lengths, drawn uniformly (default: 64,192 on cuda, 32,96 on cpu)",
    )
    parser.add_argument(
        "--max-tokens", type=positive_int, default=None, help="tokens per prompt (default: 128 on cuda, 64 on cpu)"
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the prompts; request i samples with seed + i")
    parser.add_argument(
        "--warmup-prompt-len",
        type=positive_int,
        default=None,
        metavar="N",
        help="cut the warm-up's prompts to N tokens (default: whole on cuda, 16 on cpu)",
    )
    parser.add_argument(
        "--batches",
        type=_int_list,
        default=BATCHES,
        metavar="B1,B2",
        help="engine max_batch_size values, and transformers' batch sizes (default: 8,64)",
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), metavar="C1,C2,...", help=f"a subset of {','.join(CONFIGS)}"
    )
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=None,
        help="timed calls per configuration, the fastest counts (default: 3 on cpu, 1 on cuda)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="S",
        help="seconds for the whole run, each process gets its share of what is left (default: 900 on cpu, "
        "no limit on cuda)",
    )
    add_output_arguments(parser, default_name="rollout_<device>_<size>")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    if set(configs) - set(CONFIGS):
        parser.error(f"unknown configs: {', '.join(sorted(set(configs) - set(CONFIGS)))}")
    require(["transformers"], purpose="python -m layerwise.benchmarks.rollout")
    kind = "cuda" if torch.device(args.device).type == "cuda" else "cpu"
    problem = PROBLEMS[kind]
    changes = dict(size=args.size, prompts=args.prompts, max_tokens=args.max_tokens)
    if args.prompt_len:
        changes.update(min_prompt_len=args.prompt_len[0], max_prompt_len=args.prompt_len[1])
    if args.warmup_prompt_len:
        changes.update(warmup_prompt_len=args.warmup_prompt_len)
    problem = replace(problem, seed=args.seed, **{k: v for k, v in changes.items() if v is not None})
    budget = DEFAULT_BUDGET[kind] if args.budget is None else args.budget
    cache = args.cache_dir or default_cache_dir()
    result = run(args.device, cache, problem, configs, args.batches, budget, repeats=args.repeats)
    from layerwise.benchmarks.readme import rollout_table

    path = write_json(result, args.out_dir, args.name or f"rollout_{args.device.replace(':', '')}_{problem.size}")
    print(rollout_table(result))
    print(f"written to {path} (total {result['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
