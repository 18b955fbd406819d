"""The whole benchmark suite of issue 14 in one run, under one time budget, on one checkpoint.

    python -m layerwise.benchmarks.suite --device cuda --size 8b --out-dir DIR [--budget 500]

1. generates the ``--size`` checkpoint (or reuses it; on CUDA the values are drawn on the GPU), and warms the
   on-disk compile caches with one load of the small checkpoint per scheme in a throwaway process (unless
   ``--cold-caches``: a fresh machine's first process compiles every kernel);
2. ``peak_memory``: the floor, layerwise for every FP8 scheme and a torchao config (a fresh process each: its
   first load, then one more on CUDA, three more on CPU), transformers + torchao ``quantize_``, transformers
   ``TorchAoConfig`` (and on CPU, loading in BF16 then quantizing);
3. ``reload_latency``: every scheme, from the checkpoint directory and from a pinned in-memory stream,
   against the H2D copy floor;
4. ``decode_step`` (CUDA only): FP8 per-tensor, per-channel and per-block as W8A8 and W8A16, and torchao
   configs, against BF16, batch 8, CUDA graphs;
5. ``rollout`` (issue 31): ``Engine.generate`` tokens/s of BF16 and each FP8 scheme against transformers'
   ``generate``, at batch 8 and 64: on CUDA the issue's problem on the ``--size`` checkpoint, on CPU the rollout
   benchmark's own smaller CPU problem and checkpoint (``rollout.PROBLEMS``), whatever ``--size`` is; one timed
   call per configuration.

Each part runs in fresh processes with its share of the budget; a part (or a method) that needs a missing
optional module, does not apply to the device, fails or runs out of time is recorded with its reason, and
the suite still writes every JSON. Writes DIR/peak_memory_<device>_<size>.json (+ .png),
DIR/reload_latency_<device>_<size>.json, DIR/decode_step_<device>_<size>.json,
DIR/rollout_<device>_<its size>.json and DIR/suite_<device>_<size>.json: the issues' ratios as explicit fields,
each with its target and whether it is met.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from layerwise.benchmarks import decode_step, peak_memory, reload_latency, rollout
from layerwise.benchmarks.checkpoints import make_checkpoint
from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import (
    add_output_arguments,
    benchmark_parser,
    default_cache_dir,
    write_json,
)
from layerwise.benchmarks.workers import run_worker

# issue 14's targets (ratios; a target, not a measurement)
LOAD_OVER_FLOOR = 1.5  # FP8 load / floor: steady state on CPU, the first load in a process on GPU
FIRST_MINUS_SECOND_CPU = 1.0  # seconds, CPU
PEAK_OVER_LAYER = 1.0  # (peak - final model) / the largest layer in BF16: the model + one module at most
RELOAD_STREAM_OVER_COPY_FLOOR = {"cpu": 2.0, "cuda": 1.5}
DECODE_W8A8_OVER_BF16 = 0.7
DECODE_W8A16_OVER_BF16 = 1.0
FP8_SCHEMES = ("fp8-per-tensor", "fp8-per-channel", "fp8-per-block")
# shares of the time left when a part starts (the last part gets the rest)
SHARES = {"peak_memory": 0.5, "reload_latency": 0.55, "decode_step": 0.4}
PARTS = ["peak_memory", "reload_latency", "decode_step", "rollout"]


def _torchao_missing() -> str | None:
    return None if importlib.util.find_spec("torchao") else "skipped: torchao is not installed"


def _by(rows: list[dict], key: str) -> dict[str, dict]:
    return {r[key]: r for r in rows if key in r and "error" not in r}


def targets(device: str, pm: dict | None, rl: dict | None, ds: dict | None, ro: dict | None = None) -> dict:
    """The issues' ratios as explicit fields, from the parts' results (None: the part did not run).

    Returns {field: {scheme or config: value}} plus ``met``: {target name: bool} for each measured target.
    """
    kind = torch.device(device).type
    out: dict = {
        "load_over_floor": {},
        "first_load_over_floor": {},
        "first_load_with_import_over_floor": {},
        "first_minus_second_load_seconds": {},
        "first_with_import_minus_second_load_seconds": {},  # the one-time cost of a user's first load, CPU target
        "first_minus_best_load_seconds": {},
        "first_minus_second_less_torchao_import_seconds": {},  # torchao schemes, CPU
        "peak_minus_final_over_largest_layer": {},
        "reload_dir_over_copy_floor": {},
        "reload_stream_over_copy_floor": {},
        "decode_over_bf16": {},
        "decode_targets": {},  # config -> its target (FP8 schemes only)
        "rollout_fp8_over_bf16": {},  # "<scheme> batch <b>" -> FP8 tokens/s / BF16 tokens/s (higher is better)
        "rollout_over_transformers": {},  # "<config> batch <b>" -> engine tokens/s / transformers tokens/s
        "met": {},
        "targets": {
            "load_over_floor": LOAD_OVER_FLOOR,
            "first_minus_second_load_seconds": FIRST_MINUS_SECOND_CPU,
            "peak_minus_final_over_largest_layer": PEAK_OVER_LAYER,
            "reload_stream_over_copy_floor": RELOAD_STREAM_OVER_COPY_FLOOR[kind if kind == "cuda" else "cpu"],
            "decode_w8a8_over_bf16": DECODE_W8A8_OVER_BF16,
            "decode_w8a16_over_bf16": DECODE_W8A16_OVER_BF16,
            "rollout_fp8_over_bf16": rollout.FP8_OVER_BF16["cuda" if kind == "cuda" else "cpu"],  # a minimum
        },
    }
    if pm:
        for method, r in _by(pm["results"], "method").items():
            if not method.startswith("layerwise-") or "time_over_floor" not in r:
                continue
            scheme = method[len("layerwise-") :]
            out["load_over_floor"][scheme] = r["time_over_floor"]
            out["first_load_over_floor"][scheme] = r["first_over_floor"]
            if "first_with_import_over_floor" in r:
                out["first_load_with_import_over_floor"][scheme] = r["first_with_import_over_floor"]
            if "first_minus_second_seconds" in r:
                out["first_minus_second_load_seconds"][scheme] = r["first_minus_second_seconds"]
            if "first_with_import_minus_second_seconds" in r:
                out["first_with_import_minus_second_load_seconds"][scheme] = r["first_with_import_minus_second_seconds"]
            if "first_minus_best_seconds" in r:
                out["first_minus_best_load_seconds"][scheme] = r["first_minus_best_seconds"]
            out["peak_minus_final_over_largest_layer"][scheme] = r["overhead_over_largest_layer"]
            out["met"][f"peak {scheme}"] = r["overhead_over_largest_layer"] <= PEAK_OVER_LAYER
            # the load target: GPU counts the first load in a fresh process (import layerwise included), CPU the
            # steady state
            first = r.get("first_with_import_over_floor", r["first_over_floor"])
            ratio = first if kind == "cuda" else r["time_over_floor"]
            out["met"][f"load {scheme}"] = ratio <= LOAD_OVER_FLOOR
            if kind == "cpu" and "first_minus_second_seconds" in r:
                # the one-time cost of a user's first load, import layerwise included; a torchao scheme's first load
                # also imports torchao (1.4-1.8 s here, measured apart): layerwise's own one-time cost is what is left
                own = r.get(
                    "first_minus_second_less_torchao_import_seconds",
                    r.get("first_with_import_minus_second_seconds", r["first_minus_second_seconds"]),
                )
                out["met"][f"first-load cost {scheme}"] = own <= FIRST_MINUS_SECOND_CPU
                if "torchao_import_seconds" in r:
                    out["first_minus_second_less_torchao_import_seconds"][scheme] = own
    if rl:
        for r in rl["results"]:
            if "error" in r or r.get("source") not in ("dir", "stream"):
                continue
            out[f"reload_{r['source']}_over_copy_floor"][r["scheme"]] = r["over_floor"]
            if r["source"] == "stream":
                limit = out["targets"]["reload_stream_over_copy_floor"]
                out["met"][f"reload stream {r['scheme']}"] = r["over_floor"] <= limit
    if ds:
        for config, r in _by(ds["results"], "config").items():
            if "over_bf16" not in r or config == "none":
                continue
            out["decode_over_bf16"][config] = r["over_bf16"]
            scheme, mode = decode_step.parse_config(config)
            if scheme in FP8_SCHEMES:  # auto: the library's fast path for the GPU, held to the W8A8 target
                limit = DECODE_W8A16_OVER_BF16 if mode == "w8a16" else DECODE_W8A8_OVER_BF16
                out["decode_targets"][config] = limit
                out["met"][f"decode {config}"] = r["over_bf16"] <= limit
    if ro:
        out["rollout_fp8_over_bf16"] = dict(ro["fp8_over_bf16"])
        out["rollout_over_transformers"] = dict(ro["over_transformers"])
        out["targets"]["rollout_fp8_over_bf16"] = ro["targets"]["fp8_over_bf16"]
        out["targets"]["rollout_batches"] = ro["targets"]["batches"]
        out["met"].update(ro["met"])  # "rollout <scheme> batch <b>"
    return out


def warm_caches(path: str, device: str, schemes: list[str]):
    """Worker: load the small checkpoint at ``path`` once per scheme, so that the on-disk compile caches
    (Triton's, Inductor's) hold what the timed loads compile; yields {scheme, seconds} (or its error).
    Each timed first load still pays its own process's imports and cache reads."""
    import layerwise

    for scheme in schemes:
        start = time.perf_counter()
        try:
            layerwise.load_model(path, quantization=scheme, device=device)
            yield {"scheme": scheme, "seconds": time.perf_counter() - start}
        except Exception as e:  # recorded; the timed load of this scheme will show the same error
            yield {"scheme": scheme, "error": f"{type(e).__name__}: {e}"[:300]}


def _left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def run(
    size: str,
    device: str,
    out_dir: Path,
    cache: Path,
    budget: float,
    parts: list[str],
    methods: list[str] | None = None,
    schemes: list[str] | None = None,
    configs: list[str] | None = None,
    warm: bool = True,
) -> dict:
    """Run the parts in order within ``budget`` seconds; writes each part's JSON and returns the summary
    (written by main). ``methods``, ``schemes``, ``configs``: subsets of peak_memory's methods, reload_latency's
    schemes and decode_step's configurations (default: all). ``warm``: first load the small checkpoint once
    per layerwise scheme in a throwaway process (see :func:`warm_caches`)."""
    start = time.monotonic()
    deadline = start + budget
    kind = torch.device(device).type
    t = time.perf_counter()
    path = make_checkpoint(size, cache, device=device, verbose=True)
    generation = time.perf_counter() - t
    if kind == "cuda":
        torch.cuda.empty_cache()  # the generator's blocks: the GPU is the workers' now
    torchao = _torchao_missing()
    written, seconds, results = {}, {}, {}
    warmed = None
    if warm and "peak_memory" in parts:  # a user's second process finds its compiles cached on disk: so do ours
        began = time.monotonic()
        small = make_checkpoint("small", cache, device=device)
        schemes_to_warm = [m[len("layerwise-") :] for m in methods or peak_memory.METHODS if m.startswith("layerwise-")]
        schemes_to_warm = [x for x in schemes_to_warm if not (torchao and "torchao" in x)]
        kwargs = dict(path=str(small), device=device, schemes=schemes_to_warm)
        out = run_worker("suite", "warm_caches", kwargs, timeout=min(180.0, 0.2 * _left(deadline)))
        warmed = {"rows": out.rows, "error": out.error, "seconds": time.monotonic() - began}
        print(f"suite: compile caches warmed in {warmed['seconds']:.0f} s", file=sys.stderr)

    def finish(part: str, result: dict, began: float) -> None:
        seconds[part] = time.monotonic() - began
        results[part] = result
        name = f"{part}_{device.replace(':', '')}_{result['size']}"  # the rollout's CPU size may differ
        written[part] = str(write_json(result, out_dir, name))
        if part == "peak_memory" and importlib.util.find_spec("matplotlib") is not None:
            peak_memory.plot(result, out_dir / f"{name}.png")  # else no plot: the JSON has the timelines
        print(f"suite: {part} done in {seconds[part]:.0f} s ({_left(deadline):.0f} s left)", file=sys.stderr)

    if "peak_memory" in parts:
        began = time.monotonic()
        methods = methods or peak_memory.METHODS
        skipped = peak_memory.missing_modules(methods)
        if kind == "cuda":  # not one of the figures, and a whole BF16 model on the GPU: time for others
            skipped["naive-bf16-then-fp8"] = "skipped: not part of the GPU suite (run layerwise bench for it)"
        share = _left(deadline) * SHARES["peak_memory"]
        result = peak_memory.run(
            size,
            device,
            methods,
            cache,
            loads=2 if kind == "cuda" else 4,  # CPU: the first, then the best of three (as the figures)
            hf_loads=1 if kind == "cuda" else 2,
            timeout=max(45.0, share / 3),  # no one method may starve the others
            skipped=skipped,
            deadline=began + share,
        )
        finish("peak_memory", result, began)
    if "reload_latency" in parts:
        began = time.monotonic()
        schemes = schemes or reload_latency.SCHEMES
        skipped = peak_memory.missing_modules(schemes)
        repeats = 2 if kind == "cuda" else 3
        result = reload_latency.run(
            size, device, repeats, cache, schemes, timeout=_left(deadline) * SHARES["reload_latency"], skipped=skipped
        )
        finish("reload_latency", result, began)
    if "decode_step" in parts:
        began = time.monotonic()
        configs = configs or decode_step.CONFIGS
        if kind == "cuda":
            skipped = peak_memory.missing_modules(configs)
        else:
            skipped = {c: "skipped: GPU-only (the issue's decode step is a CUDA-graph step on a GPU)" for c in configs}
        left = _left(deadline) * (SHARES["decode_step"] if "rollout" in parts else 1.0)
        result = decode_step.run(
            size, device, cache, configs, steps=20, warmup=3, timeout=max(left - 5, 1), skipped=skipped
        )
        finish("decode_step", result, began)
    if "rollout" in parts:
        began = time.monotonic()
        problem = rollout.PROBLEMS[kind] if kind != "cuda" else replace(rollout.PROBLEMS["cuda"], size=size)
        # one timed call per configuration (the rollout benchmark's CPU default is the best of three)
        result = rollout.run(device, cache, problem, budget=max(_left(deadline) - 5, 1), repeats=1)
        finish("rollout", result, began)

    shape = checkpoint_shape(size)
    return {
        "benchmark": "suite",
        **provenance(device, size, shape),
        "device": device,
        "checkpoint": str(path),
        "generation_seconds": generation,
        "compile_caches_warmed": warmed,
        "budget_seconds": budget,
        "part_seconds": seconds,
        "total_seconds": time.monotonic() - start,
        "files": written,
        "torchao": torchao or "installed",
        "hf_placement": peak_memory.hf_placement_note(torch.device(device)),
        "machine": describe_machine(device),
        **targets(device, *(results.get(part) for part in PARTS)),
    }


def summarize(out_dir: Path, device: str, size: str) -> dict:
    """The summary of part results already in ``out_dir`` ({part}_{device}_{size}.json, e.g. from two runs of
    the suite with different ``--parts``; on CPU the rollout's at its own size), without running anything; where
    and when come from the parts (the newest one's device name, versions, commit and date).

    Raises:
        FileNotFoundError: none of the part results is there.
    """
    import json

    stem = f"{device.replace(':', '')}_{size}"
    files = {part: out_dir / f"{part}_{stem}.json" for part in PARTS}
    if torch.device(device).type != "cuda":
        files["rollout"] = out_dir / f"rollout_{device.replace(':', '')}_{rollout.PROBLEMS['cpu'].size}.json"
    results = {part: json.loads(path.read_text()) for part, path in files.items() if path.exists()}
    if not results:
        raise FileNotFoundError(f"no {'/'.join(PARTS)}_{stem}.json in {out_dir}")
    newest = max(results.values(), key=lambda r: r.get("date") or "")
    keys = ("device_name", "versions", "commit", "date", "size", "shape", "checkpoint", "machine")
    return {
        "benchmark": "suite",
        **{k: newest.get(k) for k in keys},
        "device": device,
        "summarized_from": {part: r.get("date") for part, r in results.items()},
        "generation_seconds": None,
        "total_seconds": None,
        "files": {part: str(files[part]) for part in results},
        **targets(device, *(results.get(part) for part in PARTS)),
    }


def main(argv=None) -> int:
    """Parse ``argv``, run the suite, write DIR/suite_<device>_<size>.json, print the ratios."""
    parser = benchmark_parser("python -m layerwise.benchmarks.suite", __doc__)
    parser.add_argument(
        "--budget",
        type=float,
        default=500.0,
        metavar="S",
        help="seconds for the whole run, generation included (default: 500, for a 9-minute job)",
    )
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        metavar="P1,P2",
        help=f"which parts to run (default: all, {','.join(PARTS)})",
    )
    for option, choices in (
        ("--methods", peak_memory.METHODS),
        ("--schemes", reload_latency.SCHEMES),
        ("--configs", decode_step.CONFIGS),
    ):
        parser.add_argument(option, default=None, metavar="A,B", help=f"a subset of {','.join(choices)} (default: all)")
    parser.add_argument(
        "--cold-caches",
        action="store_true",
        help="do not warm the on-disk compile caches first (by default a throwaway process loads the small "
        "checkpoint once per scheme, so the timed first loads find Triton's and Inductor's caches warm)",
    )
    parser.add_argument(
        "--summarize",
        action="store_true",
        help="run nothing: write the summary from the part results already in --out-dir (e.g. after running "
        "the parts in separate jobs)",
    )
    add_output_arguments(parser, default_name="suite_<device>_<size>")
    args = parser.parse_args(argv)
    name = args.name or f"suite_{args.device.replace(':', '')}_{args.size}"
    if args.summarize:
        from layerwise.benchmarks.readme import targets_table

        summary = summarize(args.out_dir, args.device, args.size)
        print(targets_table(summary))
        print(f"written to {write_json(summary, args.out_dir, name)}")
        return 0
    subsets = {}
    for option, choices in (
        ("methods", peak_memory.METHODS),
        ("schemes", reload_latency.SCHEMES),
        ("configs", decode_step.CONFIGS),
    ):
        chosen = getattr(args, option).split(",") if getattr(args, option) else None
        if chosen and set(chosen) - set(choices):
            parser.error(f"unknown {option}: {', '.join(sorted(set(chosen) - set(choices)))}")
        subsets[option] = chosen
    parts = args.parts.split(",")
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}")
    if importlib.util.find_spec("transformers") is None:
        parser.error("transformers is needed (it writes the checkpoint's config.json): pip install transformers")
    cache = args.cache_dir or default_cache_dir()
    summary = run(args.size, args.device, args.out_dir, cache, args.budget, parts, **subsets, warm=not args.cold_caches)
    path = write_json(summary, args.out_dir, name)
    from layerwise.benchmarks.readme import targets_table

    print(targets_table(summary))
    print(f"written to {path} (total {summary['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
