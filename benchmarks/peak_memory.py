"""Peak device memory and load time: layerwise FP8 vs the ways users would otherwise load, one run.

Every method runs in a fresh subprocess on the same checkpoint and is measured by the same tracker
(``layerwise.memory.DeviceMemoryTracker``: CUDA allocator stats, or on CPU the live-storage
tracker that ignores memory-mapped checkpoint pages). Methods:

  layerwise-<scheme>        layerwise.load_model, every FP8 scheme and a torchao config
  naive-bf16-then-fp8       the same model materialized in BF16 on the device, loaded, then each
                            Linear quantized in place (what a load-then-quantize engine does)
  hf+torchao-quantize_      transformers from_pretrained (BF16) + torchao quantize_(Float8WeightOnly)
  hf-TorchAoConfig          transformers from_pretrained(quantization_config=TorchAoConfig(...))
  floor-read-copy           read every checkpoint tensor and copy it to the device, no quantization

Per method, in one fresh process: the first load (``first_seconds``: imports, compiles and caches
paid once per process), then ``--loads``-1 more (``seconds``: the best of them, the steady state), and
``first_minus_second_seconds``; peak bytes, final model bytes, peak / final, (peak - final) / largest
layer; ``time_over_floor`` (seconds / the floor's seconds) and ``first_over_floor`` (first_seconds /
the floor's seconds); ``first_seconds_with_import`` adds ``import layerwise`` (``import_seconds``, timed alone in a
fresh interpreter after ``import torch``: each method's process imports it before the first load), and
``first_with_import_minus_second_seconds`` is the whole one-time cost a user's first load pays. On CUDA the first
load is also the tracked one (the allocator's statistics cost nothing); on CPU the tracker slows
every operator, so the memory is measured in one more load after the timed ones.

Every method's process gets one regime of glibc's heap (``--pages``): "fresh" (the default)
maps every allocation of 128 KiB or more anew, so each load pays the page faults of the memory it writes, as the one
load of a real process does; "reused" keeps freed memory, so a load after the first reuses the pages the one before
it freed (a loop of loads in one process). Left to glibc, which regime a method's later loads got depended on what
it happened to free, and the steady-state ratios with it.

On CPU, a method that keeps memory-mapped checkpoint tensors as parameters (transformers does, for
embeddings, lm_head and norms) is charged their bytes on top of its tracked peak
(``untracked_final_bytes``): on a GPU they would be device memory too. For hf+torchao-quantize_ the
device-equivalent bytes are also sampled when from_pretrained returns (the whole BF16 model held, as
mmap views on CPU), a lower bound of its GPU peak. hf-TorchAoConfig quantizes inside from_pretrained,
so the mmap views it drops along the way are not counted: its CPU figure is a lower bound too. On a GPU
without accelerate, the HF methods load on the CPU and move the model (``hf_placement`` says which).

    layerwise bench [--size small|default|0.9b|8b] [--device cpu|cuda] [--loads N] [--pages fresh|reused]
                    [--timeout S] [--out-dir DIR] [--cache-dir DIR]
    python -m layerwise.benchmarks.peak_memory ...   (the same)

Writes DIR/<name>.json (every figure above, plus the memory timelines and where it ran: device name,
versions, commit, date) and DIR/<name>.png (the timelines plotted), and prints the table.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import time
from pathlib import Path

import torch

from layerwise.benchmarks.checkpoints import SIZES, make_checkpoint
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
from layerwise.benchmarks.readme import peak_memory_table
from layerwise.benchmarks.workers import PAGES_ENV, run_worker

LAYERWISE = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block", "torchao:Float8WeightOnlyConfig"]
# in the order they run: the floor first (every ratio needs it), the peers last
METHODS = [
    "floor-read-copy",
    *(f"layerwise-{s}" for s in LAYERWISE),
    "hf+torchao-quantize_",
    "hf-TorchAoConfig",
    "naive-bf16-then-fp8",
]


def required_modules(methods: list[str], device: str) -> list[str]:
    """The optional modules a run of ``methods`` on ``device`` imports (the "bench" extra). transformers'
    device_map needs accelerate; without it the HF methods load on the CPU and move the model (recorded)."""
    modules = ["transformers", "matplotlib"]  # the checkpoint's config.json, the plot
    if any("torchao" in m.lower() for m in methods):
        modules.append("torchao")
    return modules


def missing_modules(methods: list[str]) -> dict[str, str]:
    """method -> why it cannot run here (an optional module that does not import), for the suite, which
    records these methods as skipped instead of failing."""
    import importlib.util

    reasons = {}
    for m in methods:
        needs = (["transformers"] if m.startswith("hf") else []) + (["torchao"] if "torchao" in m.lower() else [])
        for module in needs:
            if importlib.util.find_spec(module) is None:
                reasons[m] = f"skipped: {module} is not installed"
                break
    return reasons


# ----------------------------------------------------------------------------- one method (worker)


def _non_lm_head_linear(module, fqn: str) -> bool:
    return isinstance(module, torch.nn.Linear) and "lm_head" not in fqn


def _load(method: str, path: str, device: torch.device, tracker=None):
    import layerwise

    if method.startswith("layerwise-"):
        return layerwise.load_model(path, quantization=method[len("layerwise-") :], device=device)
    if method == "naive-bf16-then-fp8":
        from layerwise.checkpoint import Checkpoint
        from layerwise.config import ModelConfig
        from layerwise.quant.config import QuantConfig
        from layerwise.registry import get_model_class

        ckpt = Checkpoint(path)
        config = ModelConfig.from_dict(ckpt.config)
        _, cls = get_model_class(config)
        with torch.device(device):  # every parameter materialized in BF16 up front
            model = cls(config, QuantConfig("fp8"), torch.bfloat16, device)
        model.load_weights(iter(ckpt))
        for module in model.modules():
            if getattr(module, "quant_method", None) is not None:
                module.quant_method.process_weights_after_loading(module)
        return model
    if method == "floor-read-copy":
        from layerwise.checkpoint import Checkpoint

        return {k: t.to(device, copy=True) for k, t in Checkpoint(path)}
    import transformers
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    placement, move = _hf_placement(device)
    placement.update(_hf_dtype())
    if method == "hf+torchao-quantize_":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, **placement).to(move)
        if tracker is not None:  # the whole BF16 model is held now (on CPU as mmap views: count them)
            tracker.mark("bf16 model loaded", tracker.current_bytes + tracker.untracked_bytes(_tensors(model)))
        quantize_(model, Float8WeightOnlyConfig(), filter_fn=_non_lm_head_linear)
        return model
    if method == "hf-TorchAoConfig":
        config = transformers.TorchAoConfig(Float8WeightOnlyConfig(), modules_to_not_convert=["lm_head"])
        return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, **placement).to(move)
    raise ValueError(f"unknown method {method!r}")


def _hf_dtype() -> dict:
    """from_pretrained's BF16 argument: ``dtype`` (transformers >= 4.56), ``torch_dtype`` before."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": torch.bfloat16} if (major, minor) >= (4, 56) else {"torch_dtype": torch.bfloat16}


def _hf_placement(device: torch.device) -> tuple[dict, torch.device]:
    """(from_pretrained keyword arguments, the device to move the result to). transformers places a model
    on a GPU through device_map, which needs accelerate; without accelerate it loads on the CPU and the
    model is moved with ``.to(device)`` (slower, recorded as the row's ``hf_placement``)."""
    import importlib.util

    if device.type == "cpu":
        return {}, device
    if importlib.util.find_spec("accelerate") is not None:
        return {"device_map": str(device)}, device
    return {}, device


def hf_placement_note(device: torch.device) -> str:
    """How the HF methods put the model on ``device`` (for the results)."""
    placement, _ = _hf_placement(device)
    if device.type == "cpu":
        return "cpu"
    return "device_map" if placement else "loaded on cpu, then .to(device) (accelerate is not installed)"


def _tensors(result) -> list:
    if isinstance(result, dict):
        return list(result.values())
    return list(result.parameters()) + list(result.buffers())


def _downsample(timeline: list, points: int = 400) -> list:
    if len(timeline) <= points:
        return [[round(t, 4), b] for t, b in timeline]
    step = len(timeline) / points
    out = []
    for i in range(points):  # keep the maximum of each bin, so the peak survives
        chunk = timeline[int(i * step) : int((i + 1) * step)] or [timeline[-1]]
        t, b = max(chunk, key=lambda p: p[1])
        out.append([round(t, 4), b])
    out.append([round(timeline[-1][0], 4), timeline[-1][1]])
    return out


def _final_bytes(result, device: torch.device) -> int:
    from layerwise.memory import tensor_bytes

    if isinstance(result, dict):
        return sum(t.untyped_storage().nbytes() for t in result.values())
    return tensor_bytes(result, device)


def _timed_load(method: str, path: str, device: torch.device, tracker=None) -> tuple[object, float]:
    start = time.perf_counter()
    result = _load(method, path, device, tracker)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start


def worker(method: str, path: str, device: str, loads: int = 2):
    """Load ``path`` with ``method`` ``loads`` times in this (fresh) process; yields one row of measurements
    (bytes, seconds).

    The first load is the first in the process (imports, compiles and caches a user pays once); the
    second shows the steady state. On CUDA the allocator's statistics cost nothing, so the first load is
    also the tracked one; on CPU the tracker's dispatch mode slows every operator, so the timed loads run
    untracked and one more load runs under the tracker. Only the CUDA context is created before the first
    load (every method, the floor included, would pay it once, and it is not a load cost).
    """
    import layerwise.api  # noqa: F401  (imported at first use by layerwise: here, before the timed loads)
    from layerwise.memory import DeviceMemoryTracker

    device = torch.device(device)
    if device.type == "cuda":
        torch.empty(1, device=device)
    seconds = []
    tracker = None
    for i in range(loads):
        if i == 0 and device.type == "cuda":
            with DeviceMemoryTracker(device) as tracker:
                result, took = _timed_load(method, path, device, tracker)
                tracker.sample()
            untracked, final = 0, _final_bytes(result, device)
        else:
            result, took = _timed_load(method, path, device)
        seconds.append(took)
        del result
        gc.collect()  # models hold reference cycles: free each one before the next load
    if tracker is None:  # CPU: the memory run, under the live-storage tracker
        with DeviceMemoryTracker(device) as tracker:
            result = _load(method, path, device, tracker)
            tracker.sample()
        # A method may keep memory-mapped checkpoint tensors as parameters (transformers does on CPU);
        # the tracker does not see them, but on a GPU they would be device memory: add them to the peak.
        untracked = tracker.untracked_bytes(_tensors(result))
        final = _final_bytes(result, device)
        del result
        gc.collect()
    timeline = [p for p in tracker.timeline if p not in tracker.timeline_marks]
    marks = {name: b for name, b in tracker.marks}
    row = {
        "method": method,
        "peak_bytes": max([tracker.peak_bytes + untracked, *marks.values()]),
        "tracked_peak_bytes": tracker.peak_bytes,
        "untracked_final_bytes": untracked,
        "marks": marks,
        "final_bytes": final,
        "load_seconds": seconds,
        "first_seconds": seconds[0],
        "seconds": min(seconds[1:]) if loads > 1 else seconds[0],
        "tracker": tracker.method,
        "peak_rss_anon_bytes": tracker.peak_rss_anon_bytes,
        "timeline": _downsample(timeline),
        "mark_points": [[round(t, 4), b] for t, b in tracker.timeline_marks],
    }
    if loads > 1:
        row["second_seconds"] = seconds[1]
        row["first_minus_second_seconds"] = seconds[0] - seconds[1]
        # the second load may still pay one-time costs (a compile for a second shape): also first - the best
        row["first_minus_best_seconds"] = seconds[0] - min(seconds[1:])
    if method.startswith("hf"):
        row["hf_placement"] = hf_placement_note(device)
    yield row


# ----------------------------------------------------------------------------- the whole run


def add_ratios(rows: list[dict], largest_layer_bytes: int) -> None:
    """Add peak_over_final, overhead_over_largest_layer and, with a floor row, time_over_floor (the
    steady-state load over the floor's), first_over_floor (the first load in a process over the floor's
    steady state) and first_with_import_over_floor (the same with ``import layerwise``) to every measured
    row, in place."""
    floor = next((r for r in rows if r["method"] == "floor-read-copy" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            continue
        r["peak_over_final"] = r["peak_bytes"] / r["final_bytes"]
        r["overhead_over_largest_layer"] = (r["peak_bytes"] - r["final_bytes"]) / largest_layer_bytes
        if floor:
            r["time_over_floor"] = r["seconds"] / floor["seconds"]
            r["first_over_floor"] = r["first_seconds"] / floor["seconds"]
            if "first_seconds_with_import" in r:
                r["first_with_import_over_floor"] = r["first_seconds_with_import"] / floor["seconds"]


def import_seconds(statement: str = "import layerwise.api") -> float:
    """Seconds ``statement`` takes in a fresh interpreter that has imported torch: importing layerwise's API (the
    part of a user's first load that the workers, which import it before timing, do not see; ``import layerwise``
    alone defers it to the first ``layerwise.load_model``), or torchao's own import (part of the first load of a
    ``torchao:*`` scheme, paid by anyone who uses torchao)."""
    code = f"import time, torch; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return float(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else float("nan")


def run(
    size: str,
    device: str,
    methods: list[str],
    cache: Path,
    loads: int = 2,
    hf_loads: int | None = None,
    timeout: float | None = None,
    skipped: dict[str, str] | None = None,
    deadline: float | None = None,
    pages: str = "fresh",
) -> dict:
    """Every method in its own subprocess on the ``size`` checkpoint (generated under ``cache`` if needed);
    returns the result that main writes as JSON (bytes, seconds, ratios).

    Args:
        loads: loads per method (>= 2 gives first_minus_second_seconds); hf_loads: the same for the two
            transformers methods (default: loads).
        timeout: seconds each method's process may take; deadline: a ``time.monotonic()`` after which no
            method starts and the running one is cut off (each is recorded with its reason, as are the
            ``skipped`` methods: method -> reason).
        pages: the workers' heap regime, a key of ``workers.PAGES_ENV`` ("fresh" or "reused").
    Raises:
        KeyError: an unknown ``pages``.
    """
    env = PAGES_ENV[pages]
    from layerwise.checkpoint import Checkpoint

    path = make_checkpoint(size, cache, device=device, verbose=True)
    ckpt = Checkpoint(path)
    largest = max(ckpt.group_bytes().values())
    rows = []
    for method in methods:
        if skipped and method in skipped:
            rows.append({"method": method, "error": skipped[method]})
            continue
        limit = timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left < 5:
                rows.append({"method": method, "error": "skipped: the run's time budget was spent"})
                continue
            limit = left if limit is None else min(limit, left)
        n = hf_loads if (hf_loads and method.startswith("hf")) else loads
        kwargs = dict(method=method, path=str(path), device=device, loads=n)
        out = run_worker("peak_memory", "worker", kwargs, limit, env=env)
        if out.rows:
            rows.append(out.rows[0])
        else:
            rows.append({"method": method, "error": out.error})
            print(f"  {method}: did not run here: {out.error}", file=sys.stderr)
            continue
        print(f"  {method}: done in {out.seconds:.1f} s", file=sys.stderr)
    imports = import_seconds()
    torchao_import = None
    for r in rows:
        if r["method"].startswith("layerwise-") and "error" not in r:
            r["import_seconds"] = imports
            r["first_seconds_with_import"] = r["first_seconds"] + imports
            if "second_seconds" in r:  # a user's one-time cost: first load + import layerwise - the second load
                r["first_with_import_minus_second_seconds"] = r["first_seconds_with_import"] - r["second_seconds"]
        if r["method"].startswith("layerwise-torchao:") and "first_minus_second_seconds" in r:
            if torchao_import is None:
                torchao_import = import_seconds("import torchao.quantization")
            # the first load imports torchao (the second does not): what is left of first - second is layerwise's
            r["torchao_import_seconds"] = torchao_import
            r["first_minus_second_less_torchao_import_seconds"] = r["first_minus_second_seconds"] - torchao_import
    add_ratios(rows, largest)
    shape = checkpoint_shape(size)
    return {
        "benchmark": "peak_memory",
        **provenance(device, size, shape),
        "device": device,
        "checkpoint": str(path),
        "config": dict(SIZES[size]),
        "checkpoint_bytes": ckpt.total_bytes,
        "largest_layer_checkpoint_bytes": largest,
        "loads_per_method": loads,
        "pages": pages,
        "malloc_env": env,
        "import_layerwise_seconds": imports,
        "machine": describe_machine(device),
        "results": rows,
    }


def plot(result: dict, out: Path) -> None:
    """Device bytes over time, one line per method, the final FP8 model size as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    fp8_final = None
    for r in result["results"]:
        if "error" in r:
            continue
        t, b = zip(*r["timeline"], strict=True)
        label = r["method"]
        if r.get("untracked_final_bytes"):
            label += f" (+{r['untracked_final_bytes'] / 2**20:.0f} MiB kept as mmap views, not drawn)"
        (line,) = ax.plot(
            t, [x / 2**20 for x in b], label=label, lw=1.5, ls="-" if r["method"].startswith("layerwise") else "--"
        )
        for mt, mb in r.get("mark_points", []):
            ax.plot([mt], [mb / 2**20], marker="x", ms=9, color=line.get_color())
            ax.annotate(
                "BF16 model held\n(device equivalent)",
                (mt, mb / 2**20),
                fontsize=7,
                xytext=(6, -18),
                textcoords="offset points",
            )
        if r["method"] == "layerwise-fp8-per-tensor":
            fp8_final = r["final_bytes"]
    if fp8_final:
        ax.axhline(fp8_final / 2**20, color="black", lw=1, ls=":", label="final FP8 model (per-tensor)")
    ax.set_xlabel("seconds since load start (the run under the tracker, which slows every method)")
    ax.set_ylabel(f"live tensor bytes on {result['device']} (MiB)")
    ax.set_title(
        f"Loading a {result['config']['num_hidden_layers']}-layer BF16 Llama checkpoint "
        f"({result['checkpoint_bytes'] / 2**20:,.0f} MiB) as FP8"
    )
    ax.legend(fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    """``layerwise bench``: parse ``argv``, run, write DIR/NAME.json and DIR/NAME.png, print the table.

    Raises:
        MissingDependencyError: an optional dependency of the run is missing (checked before any work).
    """
    sizes = "; ".join(
        f"'{k}' = {v['num_hidden_layers']} layers, hidden {v['hidden_size']}, vocab {v['vocab_size']}"
        for k, v in SIZES.items()
    )
    parser = benchmark_parser(
        "layerwise bench",
        __doc__,
        size_help=f"the BF16 Llama checkpoint to generate: {sizes} (a quick run; default: default)",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        metavar="M1,M2,...",
        help="comma-separated subset of the methods above (default: all)",
    )
    parser.add_argument(
        "--loads",
        type=positive_int,
        default=2,
        help="loads per method in its process: the first, then the steady state (default: 2)",
    )
    parser.add_argument(
        "--pages",
        choices=sorted(PAGES_ENV),
        default="fresh",
        help="glibc's heap in every method's process: fresh pages for every load (as a process's one load), or "
        "the pages an earlier load freed reused (a loop of loads); default: fresh",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="seconds each method may take (default: no limit)"
    )
    add_output_arguments(parser, default_name="peak_memory_<device>_<size>[_reused]")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    require(required_modules(methods, args.device))

    cache = args.cache_dir or default_cache_dir()
    result = run(args.size, args.device, methods, cache, args.loads, None, args.timeout, pages=args.pages)
    name = args.name or f"peak_memory_{args.device}_{args.size}" + ("" if args.pages == "fresh" else f"_{args.pages}")
    path = write_json(result, args.out_dir, name)
    plot(result, path.with_suffix(".png"))
    print(peak_memory_table(result))
    print(f"written to {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
