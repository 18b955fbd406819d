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

Per method: peak bytes, final model bytes, peak / final, (peak - final) / largest layer, wall
seconds and seconds / floor (timed in a second, untracked load). On CPU, a method that keeps
memory-mapped checkpoint tensors as parameters (transformers does, for embeddings, lm_head and
norms) is charged their bytes on top of its tracked peak (``untracked_final_bytes``): on a GPU
they would be device memory too. For hf+torchao-quantize_ the device-equivalent bytes are also
sampled when from_pretrained returns (the whole BF16 model held, as mmap views on CPU), a lower
bound of its GPU peak. hf-TorchAoConfig quantizes inside from_pretrained, so the mmap views it
drops along the way are not counted: its CPU figure is a lower bound too. The one-time process
warm-up (imports, Inductor's compile of the fused CPU quantize, the tracker's first dispatch) is
done before the timed load and reported separately.

    layerwise bench [--size default|small] [--device cpu|cuda] [--out-dir DIR] [--cache-dir DIR]
    python -m layerwise.benchmarks.peak_memory ...   (the same)

Writes DIR/<name>.json (every figure above, plus the memory timelines) and DIR/<name>.png (the
timelines plotted), and prints the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from layerwise.benchmarks.options import RESULTS_NOTE, add_output_arguments, default_cache_dir, require, write_json
from layerwise.benchmarks.readme import peak_memory_table

SIZES = {  # Llama-style checkpoints written by transformers' save_pretrained, BF16
    "default": dict(
        num_hidden_layers=24,
        hidden_size=1024,
        intermediate_size=2816,
        vocab_size=32000,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_shard_size="200MB",
    ),
    "small": dict(
        num_hidden_layers=4,
        hidden_size=256,
        intermediate_size=704,
        vocab_size=2048,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_shard_size="2MB",
    ),
}
LAYERWISE = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block", "torchao:Float8WeightOnlyConfig"]
METHODS = [f"layerwise-{s}" for s in LAYERWISE] + [
    "naive-bf16-then-fp8",
    "hf+torchao-quantize_",
    "hf-TorchAoConfig",
    "floor-read-copy",
]


def make_checkpoint(size: str, root: Path) -> Path:
    """The benchmark checkpoint ``root/llama-<size>``, generated with transformers the first time and reused
    after; returns its directory. It is written under a temporary name and renamed when complete, so an
    interrupted run never leaves a checkpoint that looks finished."""
    path = root / f"llama-{size}"
    if path.is_dir():
        return path
    import transformers

    spec = dict(SIZES[size])
    shard = spec.pop("max_shard_size")
    partial = root / f".llama-{size}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**spec, tie_word_embeddings=False, max_position_embeddings=4096)
    with torch.device("cpu"):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(partial, max_shard_size=shard)
    partial.rename(path)
    return path


def required_modules(methods: list[str], device: str) -> list[str]:
    """The optional modules a run of ``methods`` on ``device`` imports (the "bench" extra)."""
    modules = ["transformers", "matplotlib"]  # the checkpoint generator, the plot
    if any("torchao" in m.lower() for m in methods):
        modules.append("torchao")
    if torch.device(device).type != "cpu" and any(m.startswith("hf") for m in methods):
        modules.append("accelerate")  # transformers' device_map
    return modules


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

    # device_map (which needs accelerate) only where the model must leave the CPU
    placement = {} if device.type == "cpu" else {"device_map": str(device)}
    if method == "hf+torchao-quantize_":
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **placement)
        if tracker is not None:  # the whole BF16 model is held now (on CPU as mmap views: count them)
            tracker.mark("bf16 model loaded", tracker.current_bytes + tracker.untracked_bytes(_tensors(model)))
        quantize_(model, Float8WeightOnlyConfig(), filter_fn=_non_lm_head_linear)
        return model
    if method == "hf-TorchAoConfig":
        config = transformers.TorchAoConfig(Float8WeightOnlyConfig(), modules_to_not_convert=["lm_head"])
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, quantization_config=config, **placement
        )
    raise ValueError(f"unknown method {method!r}")


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


def worker(method: str, path: str, device: str) -> dict:
    """Load ``path`` with ``method`` under the tracker; returns the measurements (bytes, seconds)."""
    from layerwise.memory import DeviceMemoryTracker

    device = torch.device(device)
    start = time.perf_counter()
    with DeviceMemoryTracker(device):  # warm-up: the tracker's first dispatch imports torch._dynamo
        torch.empty(1, device=device) + 1
    if method == "layerwise-fp8-per-tensor" and device.type == "cpu":
        from layerwise.kernels import cpu_fused, fp8_quantize_weight

        w = torch.ones(cpu_fused.FUSED_MIN_NUMEL, dtype=torch.bfloat16)
        fp8_quantize_weight(w)  # compiles the fused CPU quantize (Inductor cache) before timing
    warmup = time.perf_counter() - start
    with DeviceMemoryTracker(device) as tracker:  # memory: one load under the tracker
        result = _load(method, path, device, tracker)
        tracker.sample()
    # A method may keep memory-mapped checkpoint tensors as parameters (transformers does on CPU);
    # the tracker does not see them, but on a GPU they would be device memory: add them to the peak.
    untracked = tracker.untracked_bytes(_tensors(result))
    from layerwise.memory import tensor_bytes

    final = (
        tensor_bytes(result, device)
        if not isinstance(result, dict)
        else sum(t.untyped_storage().nbytes() for t in result.values())
    )
    timeline = [p for p in tracker.timeline if p not in tracker.timeline_marks]
    del result
    gc.collect()  # models hold reference cycles: free the tracked one before the timed loads
    # time: the best of two loads without the tracker (its per-op Python work would weigh on
    # methods unevenly); the page cache is warm for these loads, as for every method
    seconds = float("inf")
    for _ in range(2):
        start = time.perf_counter()
        result = _load(method, path, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = min(seconds, time.perf_counter() - start)
        del result
        gc.collect()
    marks = {name: b for name, b in tracker.marks}
    return {
        "method": method,
        "peak_bytes": max([tracker.peak_bytes + untracked, *marks.values()]),
        "tracked_peak_bytes": tracker.peak_bytes,
        "untracked_final_bytes": untracked,
        "marks": marks,
        "final_bytes": final,
        "seconds": seconds,
        "warmup_seconds": warmup,
        "tracker": tracker.method,
        "peak_rss_anon_bytes": tracker.peak_rss_anon_bytes,
        "timeline": _downsample(timeline),
        "mark_points": [[round(t, 4), b] for t, b in tracker.timeline_marks],
    }


# ----------------------------------------------------------------------------- the whole run

# Each method runs in a fresh interpreter: ``worker(METHOD, PATH, DEVICE)``, its result as JSON on stdout.
# A private entry point, so the command line of `layerwise bench` has nothing internal in it.
_WORKER = (
    "import json, sys; from layerwise.benchmarks.peak_memory import worker; print(json.dumps(worker(*sys.argv[1:4])))"
)


def run(size: str, device: str, methods: list[str], cache: Path) -> dict:
    """Every method in its own subprocess on the ``size`` checkpoint (generated under ``cache`` if needed);
    returns the result that main writes as JSON (bytes, seconds, ratios)."""
    from layerwise.checkpoint import Checkpoint

    path = make_checkpoint(size, cache)
    ckpt = Checkpoint(path)
    largest = max(ckpt.group_bytes().values())
    rows = []
    for method in methods:
        cmd = [sys.executable, "-c", _WORKER, method, str(path), device]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            reason = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"method": method, "error": reason})
            print(f"  {method}: did not run here: {reason}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"  {method}: done", file=sys.stderr)
    floor = next((r for r in rows if r["method"] == "floor-read-copy" and "error" not in r), None)
    for r in rows:
        if "error" in r:
            continue
        r["peak_over_final"] = r["peak_bytes"] / r["final_bytes"]
        r["overhead_over_largest_layer"] = (r["peak_bytes"] - r["final_bytes"]) / largest
        if floor:
            r["time_over_floor"] = r["seconds"] / floor["seconds"]
    return {
        "benchmark": "peak_memory",
        "size": size,
        "device": device,
        "checkpoint": str(path),
        "config": {k: v for k, v in SIZES[size].items()},
        "checkpoint_bytes": ckpt.total_bytes,
        "largest_layer_checkpoint_bytes": largest,
        "machine": describe_machine(device),
        "results": rows,
    }


def describe_machine(device: str) -> dict:
    """Platform, Python, torch, CPU count and threads (and the GPU's name on cuda), for the results JSON."""
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


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
    parser = argparse.ArgumentParser(
        prog="layerwise bench",
        description=__doc__,
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sizes = "; ".join(f"'{k}' = {v['num_hidden_layers']} layers, hidden {v['hidden_size']}" for k, v in SIZES.items())
    parser.add_argument(
        "--size",
        default="default",
        choices=sorted(SIZES),
        help=f"the BF16 Llama checkpoint to generate: {sizes} (a quick run; default: default)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        metavar="M1,M2,...",
        help="comma-separated subset of the methods above (default: all)",
    )
    add_output_arguments(parser, default_name="peak_memory_<device>_<size>")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    require(required_modules(methods, args.device))

    result = run(args.size, args.device, methods, args.cache_dir or default_cache_dir())
    name = args.name or f"peak_memory_{args.device}_{args.size}"
    path = write_json(result, args.out_dir, name)
    plot(result, path.with_suffix(".png"))
    print(peak_memory_table(result))
    print(f"written to {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
