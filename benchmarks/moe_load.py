"""Mixture-of-experts load: peak device memory and load time of online FP8, expert by expert, on a
Qwen3-30B-A3B-shaped checkpoint scaled to fit the machine (issue 13).

The checkpoint keeps Qwen3-30B-A3B's expert structure (128 experts, top-8, per-expert
gate_proj/up_proj/down_proj keys, hidden : moe_intermediate = 2048 : 768) with fewer layers and a smaller
hidden size (sizes below); random BF16 normal(0, 0.02) weights written with safetensors, one shard per
decoder layer, cached under --cache-dir. Every method runs in a fresh subprocess through
``layerwise.benchmarks.peak_memory``'s worker (same tracker; the fastest load after the first of --loads; every
allocation of 128 KiB or more in fresh pages, as in a process's one real load: ``workers.PAGES_ENV["fresh"]``):

  floor-read-copy           read every checkpoint tensor and copy it to the device
  layerwise-fp8-per-*       layerwise.load_model, the three FP8 schemes (one expert unit at a time)
  hf+torchao-quantize_      transformers from_pretrained (BF16) + torchao quantize_(Float8WeightOnlyConfig)
                            on nn.Linear modules; transformers keeps experts as fused 3-D parameters,
                            which quantize_'s Linear filter does not reach: they stay BF16 (final bytes
                            show it)

Per method: peak and final bytes, peak / final, seconds and seconds / floor; for layerwise also the
largest processing unit (one expert's fused gate+up in BF16) per layer, from its LoadReport. Targets
(issue 13): peak / final <= 1.05 and load <= 1.5x floor for the layerwise methods.

    python -m layerwise.benchmarks.moe_load [--size SIZE] [--device cpu|cuda] [--threads N] [--out-dir DIR]

Sizes: "cpu" (hidden 512, moe_intermediate 192: experts of 1/16 the real size, so the per-expert fixed costs
weigh 16x more than on the real model), "cpu-full-experts" (the real expert shapes, 2 layers, 2.4 GB) and
"gpu" (the real shapes, 4 layers).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from layerwise.benchmarks.checkpoints import WEIGHT_STD
from layerwise.benchmarks.machine import describe_machine, provenance
from layerwise.benchmarks.options import RESULTS_NOTE, add_output_arguments, default_cache_dir, require, write_json
from layerwise.benchmarks.workers import PAGES_ENV, run_worker

#: Qwen3-30B-A3B: 48 layers, hidden 2048, moe_intermediate 768, 128 experts, top-8, 32 q / 4 kv heads of 128
SIZES = {
    "test": dict(  # seconds: tests/test_moe_benchmark.py
        num_hidden_layers=1,
        hidden_size=64,
        moe_intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=128,
    ),
    "cpu": dict(
        num_hidden_layers=2,
        hidden_size=512,
        moe_intermediate_size=192,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=64,
        vocab_size=4096,
    ),
    "cpu-full-experts": dict(  # Qwen3-30B-A3B's own expert and attention shapes, 2 layers: 2.4 GB of BF16
        num_hidden_layers=2,
        hidden_size=2048,
        moe_intermediate_size=768,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=8192,
    ),
    "gpu": dict(  # about 5 GB of BF16: the whole run fits a 10-minute GPU job
        num_hidden_layers=4,
        hidden_size=2048,
        moe_intermediate_size=768,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=32000,
    ),
}
NUM_EXPERTS, TOP_K = 128, 8
TARGETS = {"peak_over_final": 1.05, "time_over_floor": 1.5}  # issue 13, for the layerwise methods
LAYERWISE = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]
METHODS = ["floor-read-copy"] + [f"layerwise-{s}" for s in LAYERWISE] + ["hf+torchao-quantize_"]


def config_json(size: str) -> dict:
    """The Hugging Face config.json of the ``size`` checkpoint (Qwen3MoeForCausalLM)."""
    shape = SIZES[size]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        **shape,
        "intermediate_size": 3 * shape["hidden_size"],  # dense MLP size (unused: every layer is sparse)
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def layer_tensors(size: str, layer: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint key -> shape of decoder layer ``layer`` (Qwen3-MoE naming)."""
    s = SIZES[size]
    h, i, d = s["hidden_size"], s["moe_intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    p = f"model.layers.{layer}"
    out = {
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
        f"{p}.self_attn.q_proj.weight": (q, h),
        f"{p}.self_attn.k_proj.weight": (kv, h),
        f"{p}.self_attn.v_proj.weight": (kv, h),
        f"{p}.self_attn.o_proj.weight": (h, q),
        f"{p}.self_attn.q_norm.weight": (d,),
        f"{p}.self_attn.k_norm.weight": (d,),
        f"{p}.mlp.gate.weight": (NUM_EXPERTS, h),
    }
    for e in range(NUM_EXPERTS):
        out[f"{p}.mlp.experts.{e}.gate_proj.weight"] = (i, h)
        out[f"{p}.mlp.experts.{e}.up_proj.weight"] = (i, h)
        out[f"{p}.mlp.experts.{e}.down_proj.weight"] = (h, i)
    return out


def make_checkpoint(size: str, root: Path, num_hidden_layers: int | None = None) -> Path:
    """``root/qwen3-moe-<size>``: generated once (random BF16, one safetensors shard per decoder layer plus one
    for embeddings, norm and lm_head) and reused. ``num_hidden_layers``: another number of decoder layers than the
    size's (``root/qwen3-moe-<size>-<n>l``; used by ``layerwise.benchmarks.tp_load --moe``)."""
    from safetensors.torch import save_file

    s = dict(SIZES[size], **({"num_hidden_layers": num_hidden_layers} if num_hidden_layers else {}))
    layers_suffix = f"-{num_hidden_layers}l" if num_hidden_layers else ""
    folder = root / f"qwen3-moe-{size}{layers_suffix}"
    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards = {
        "model-embed.safetensors": {
            "model.embed_tokens.weight": (s["vocab_size"], s["hidden_size"]),
            "model.norm.weight": (s["hidden_size"],),
            "lm_head.weight": (s["vocab_size"], s["hidden_size"]),
        }
    }
    for layer in range(s["num_hidden_layers"]):
        shards[f"model-layer{layer:03d}.safetensors"] = layer_tensors(size, layer)
    weight_map = {}
    for file, shapes in shards.items():
        tensors = {}
        for key, shape in shapes.items():
            t = torch.ones(shape) if key.endswith("norm.weight") else torch.randn(shape, generator=gen) * WEIGHT_STD
            tensors[key] = t.to(torch.bfloat16)
            weight_map[key] = file
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
    config = dict(config_json(size), num_hidden_layers=s["num_hidden_layers"])
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    index = {"metadata": {}, "weight_map": weight_map}  # written last: its presence means complete
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def unit_report(path: str, scheme: str, device: str):
    """Worker: the layerwise LoadReport's per-unit figures for ``scheme`` (untracked load)."""
    import layerwise

    _, report = layerwise.load_model_with_report(path, quantization=scheme, device=device, track_memory=False)
    yield {
        "largest_unit_bytes": report.largest_unit_bytes,
        "unit_bytes_by_layer": report.unit_bytes_by_layer,
        "largest_layer_checkpoint_bytes": report.largest_layer_checkpoint_bytes,
    }


def run(size: str, device: str, cache: Path, loads: int = 6, timeout: float | None = None) -> dict:
    """Every method in its own subprocess; returns the result written as JSON."""
    from layerwise.benchmarks.peak_memory import add_ratios
    from layerwise.checkpoint import Checkpoint

    path = make_checkpoint(size, cache)
    ckpt = Checkpoint(path)
    largest = max(ckpt.group_bytes().values())
    rows = []
    for method in METHODS:
        args = dict(method=method, path=str(path), device=device, loads=loads)
        # every load in fresh pages, as the one load of a real process: with glibc's adaptive mmap threshold the
        # floor's third load reused the freed pages of the ones before (0.04-0.056 s against 0.10 s fresh), a
        # reuse FP8 models (25 MB expert tensors here) mostly do not get
        out = run_worker("peak_memory", "worker", args, timeout, env=PAGES_ENV["fresh"])
        if not out.rows:
            rows.append({"method": method, "error": out.error})
            print(f"  {method}: did not run: {out.error}", file=sys.stderr)
            continue
        row = out.rows[0]
        row.pop("timeline", None), row.pop("mark_points", None)
        if method.startswith("layerwise-"):
            scheme = method.removeprefix("layerwise-")
            units = run_worker("moe_load", "unit_report", dict(path=str(path), scheme=scheme, device=device))
            row.update(units.rows[0] if units.rows else {"unit_report_error": units.error})
        rows.append(row)
        print(f"  {method}: peak {row['peak_bytes'] / 2**20:.1f} MiB, {row['seconds']:.2f} s", file=sys.stderr)
    add_ratios(rows, largest)
    s = SIZES[size]
    expert_bf16 = 3 * s["moe_intermediate_size"] * s["hidden_size"] * 2
    for r in rows:
        if r["method"].startswith("layerwise-") and "error" not in r:
            r["meets_peak_target"] = r["peak_over_final"] <= TARGETS["peak_over_final"]
            r["meets_time_target"] = r.get("time_over_floor", float("inf")) <= TARGETS["time_over_floor"]
            r["peak_minus_final_over_one_expert_bf16"] = (r["peak_bytes"] - r["final_bytes"]) / expert_bf16
    return {
        "benchmark": "moe_load",
        **provenance(device, size, dict(s, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)),
        "device": device,
        "checkpoint": str(path),
        "checkpoint_bytes": ckpt.total_bytes,
        "largest_layer_checkpoint_bytes": largest,
        "one_expert_bf16_bytes": expert_bf16,
        "whole_moe_layer_bf16_bytes": NUM_EXPERTS * expert_bf16,
        "loads_per_method": loads,
        "targets": TARGETS,
        "machine": describe_machine(device),
        "results": rows,
    }


def table(result: dict) -> str:
    """A Markdown table of the rows (MiB, seconds, ratios)."""
    lines = [
        "| method | peak MiB | final MiB | peak / final | load s | / floor | largest unit MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["results"]:
        if "error" in r:
            lines.append(f"| {r['method']} | did not run: {r['error']} | | | | | |")
            continue
        unit = f"{r['largest_unit_bytes'] / 2**20:.2f}" if "largest_unit_bytes" in r else ""
        lines.append(
            f"| {r['method']} | {r['peak_bytes'] / 2**20:.1f} | {r['final_bytes'] / 2**20:.1f} | "
            f"{r['peak_over_final']:.3f} | {r['seconds']:.2f} | {r.get('time_over_floor', float('nan')):.2f} | {unit} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.moe_load",
        description=__doc__.split("\n\n")[0],
        epilog=RESULTS_NOTE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--size", choices=sorted(SIZES), default=None, help="default: cpu, or gpu with --device cuda")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--loads",
        type=int,
        default=6,
        help="loads per method; the fastest after the first counts (default 6: on the small size a load takes "
        "~0.1 s and the floor's own best varied from 0.056 to 0.11 s here between runs, with how much freed "
        "memory the allocator reuses)",
    )
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per method (default 1800)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="OMP_NUM_THREADS of every method's process (default: torch's own choice); on a CPU shared with "
        "other work, 1 avoids timing the OpenMP pool's wake-ups instead of the load",
    )
    add_output_arguments(parser, "moe_load_<device>")
    args = parser.parse_args(argv)
    device_default = "gpu" if args.device == "cuda" else "cpu"
    size = args.size or device_default
    require(["transformers", "torchao"], purpose="python -m layerwise.benchmarks.moe_load")  # before any work
    if args.threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the worker processes
    start = time.perf_counter()
    load_before = os.getloadavg()  # other work on the machine makes CPU timings noisy: record how much
    result = run(size, args.device, args.cache_dir or default_cache_dir(), args.loads, args.timeout)
    result["load_average_1_5_15_min"] = {"before": load_before, "after": os.getloadavg()}
    result["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    result["malloc_mmap_threshold"] = PAGES_ENV["fresh"]["MALLOC_MMAP_THRESHOLD_"]
    result["wall_seconds"] = time.perf_counter() - start
    default_name = f"moe_load_{args.device}" if size == device_default else f"moe_load_{args.device}_{size}"
    path = write_json(result, args.out_dir, args.name or default_name)
    print(table(result))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
