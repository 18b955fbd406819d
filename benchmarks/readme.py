"""Markdown from the benchmark results JSON: the tables the scripts print, docs/benchmarks.md, and the README's
headline table.

    python -m layerwise.benchmarks.readme [--results DIR] [--readme PATH] [--benchmarks PATH] [--check]

Rewrites only the text between markers: in docs/benchmarks.md the whole results section
(``<!-- results:begin ...-->`` ... ``<!-- results:end -->``); in the README the one headline table
(``<!-- headline:begin ...-->`` ... ``<!-- headline:end -->``) and the sample ``layerwise load`` output
(``<!-- demo:begin ...-->`` ... ``<!-- demo:end -->``, from DEMO_FILE.json, the ``--report`` of ``layerwise load``
on the demo checkpoint, first load in a fresh process; refresh it with ``layerwise demo`` then ``layerwise load
~/.cache/layerwise/demo-qwen3-8l --report benchmarks/results/demo_load_cpu.json``).
Every measured figure there (peaks, ratios, seconds, the machine, the checkpoint, dates and commits) is formatted
from DIR/*.json; a sentence or cell whose figures are missing from the JSON is left out or says so. ``--check``
writes nothing and exits 1 when either file differs from what would be generated (stale figures).
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path

from layerwise.benchmarks.options import DEFAULT_OUT_DIR, REFERENCE_DIR

BEGIN = re.compile(r"<!-- results:begin.*?-->\n", re.DOTALL)
END = "<!-- results:end -->"
# the benchmarks whose CPU results the section needs (the newest JSON of each in the results folder)
CPU_BENCHMARKS = ["peak_memory", "reload_latency", "quant_kernels", "weight_transfer", "tp_load"]
# The default-size CPU results by benchmark. Only tests/test_benchmark_weight_transfer.py still reads it; the
# section shows the newest results of each benchmark (latest_results), which may be another size.
FILES = {
    "peak_memory": "peak_memory_cpu_default",
    "reload_latency": "reload_latency_cpu_default",
    "quant_kernels": "quant_kernels_cpu",
    "weight_transfer": "weight_transfer_cpu_default",
    "tp_load": "tp_load_cpu_default",
}
# the benchmarks of a GPU's part of the section (the suite's), in the order shown
GPU_BENCHMARKS = ["suite", "peak_memory", "reload_latency", "decode_step", "rollout", "moe_load"]
DEMO_FILE = "demo_load_cpu"
DEMO_BEGIN = re.compile(r"<!-- demo:begin.*?-->\n", re.DOTALL)
DEMO_END = "<!-- demo:end -->"
HEADLINE_BEGIN = re.compile(r"<!-- headline:begin.*?-->\n", re.DOTALL)
HEADLINE_END = "<!-- headline:end -->"
HEADLINE_SCHEME = "fp8-per-tensor"  # the headline's scheme: quantization="fp8"
TARGET_TIME_OVER_FLOOR = 1.5  # the project's goal for layerwise load time / floor (a target, not a measurement)
MIB = 2**20


# ----------------------------------------------------------------------------- tables


def _f(value, fmt: str = ".2f") -> str:
    return "" if value is None else format(value, fmt)


def _pages_note(pm: dict) -> str:
    """What the run's heap regime (peak_memory ``--pages``) means for its load times, or "" for older results."""
    if pm.get("pages") == "fresh":
        return (
            "\nEvery load writes fresh pages (`--pages fresh`, glibc's mmap threshold at 128 KiB) and pays their "
            "page faults,\nas a process's one real load does; `--pages reused` times a loop of loads instead."
        )
    if pm.get("pages") == "reused":
        return "\nEvery load after the first reuses the pages the one before it freed (`--pages reused`)."
    return ""


def peak_memory_table(result: dict) -> str:
    """Markdown table of a peak_memory result: MiB, ratios, seconds per method (with the first load in the
    process and first - second where the result has them)."""
    rows = result["results"]
    first = any("first_seconds" in r for r in rows)
    head = "| method | peak MiB | final MiB | peak/final | (peak-final)/layer | "
    if first:
        head += "first load s | load s | first - second s | load/floor | first/floor |"
    else:
        head += "seconds | time/floor |"
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | did not run: {r['error'][:80]} |" + " |" * (head.count("|") - 3))
            continue
        line = (
            f"| {r['method']} | {r['peak_bytes'] / MIB:,.1f} | {r['final_bytes'] / MIB:,.1f} | "
            f"{r['peak_over_final']:.2f} | {r['overhead_over_largest_layer']:.2f} | "
        )
        if first:
            line += (
                f"{_f(r.get('first_seconds'))} | {r['seconds']:.2f} | {_f(r.get('first_minus_second_seconds'))} | "
                f"{_f(r.get('time_over_floor'))} | {_f(r.get('first_over_floor'))} |"
            )
        else:
            line += f"{r['seconds']:.2f} | {r.get('time_over_floor', float('nan')):.2f} |"
        lines.append(line)
    return "\n".join(lines)


def reload_latency_table(result: dict) -> str:
    """Markdown table of a reload_latency result: best seconds per case; where recorded, the best floor copy of the
    same rounds; "/ floor" (the best reload over that floor; in results without rounds, over the run's fastest
    floor); where recorded, the best reload over the fastest floor of the run; and
    the first reload of each live model where the result has it."""
    rows = result["results"]
    first = any("first_seconds" in r for r in rows)
    fastest = any("over_fastest_floor" in r for r in rows)
    head = ["case", "seconds"] + (["floor s"] if fastest else []) + ["/ floor"]
    head += (["/ fastest floor"] if fastest else []) + (["first s"] if first else [])
    lines = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | did not run: {r['error'][:80]} |" + " |" * (len(head) - 2))
            continue
        cells = [r["case"], f"{r['seconds']:.3f}"]
        if fastest:  # the floor copies paired with this row's reloads (the first floor row: its own best)
            cells.append(_f(r.get("floor_seconds", r["seconds"] if r.get("source") == "floor" else None), ".3f"))
        cells.append(f"{r.get('over_floor', 1.0):.2f}")
        if fastest:
            cells.append(_f(r.get("over_fastest_floor")) if "over_floor" in r else "")
        if first:
            cells.append(_f(r.get("first_seconds"), ".3f"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decode_table(result: dict) -> str:
    """Markdown table of a decode_step result: median ms per step and the ratio to BF16 per configuration, and
    where the rows were profiled, one eager step's time per category (``step_profile``)."""
    profiled = any("profile" in r for r in result["results"])
    lines = ["| scheme | fp8 mode | ms / step | / bf16 |", "|---|---|---:|---:|"]
    if profiled:
        lines[0] += " eager step: GEMM / act quant / attention / other, ms |"
        lines[1] += "---|"
    for r in result["results"]:
        scheme, _, mode = r["config"].partition("/")
        ms = r.get("profile", {}).get("ms_per_step")
        split = " / ".join(f"{ms[c]:.2f}" for c in ("gemm", "act_quant", "attention", "other")) if ms else ""
        column = (f" {split} |" if split else " |") if profiled else ""
        if "error" in r:
            lines.append(f"| {scheme} | {mode or 'auto'} | did not run: {r['error'][:80]} | |{column}")
        else:
            lines.append(f"| {scheme} | {mode or 'auto'} | {r['ms']:.2f} | {_f(r.get('over_bf16'))} |{column}")
    return "\n".join(lines)


def rollout_table(result: dict) -> str:
    """Markdown table of a rollout result: per configuration and batch, generated tokens/s, its ratio to the BF16
    engine and to transformers, the call's seconds with the engine's prefill / decode split and time to the first
    prefill's logits, and the FP8 target where one applies."""
    lines = [
        "| config | batch | tokens/s | / bf16 | / transformers | seconds | prefill / decode s | first prefill s "
        "| target | met |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(result["results"], key=lambda r: r["batch"]):  # stable: the run's order within a batch
        key = f"{r['config']} batch {r['batch']}"
        if "error" in r:
            lines.append(f"| {r['config']} | {r['batch']} | did not run: {r['error'][:80]} | | | | | | | |")
            continue
        split = f"{r['prefill_seconds']:.2f} / {r['decode_seconds']:.2f}" if "prefill_seconds" in r else ""
        met = result.get("met", {}).get(f"rollout {key}")
        target = f">= {result['targets']['fp8_over_bf16']:g}" if met is not None else ""
        verdict = "" if met is None else ("yes" if met else "**no**")
        bf16 = 1.0 if r["config"] == "none" else result.get("fp8_over_bf16", {}).get(key)
        lines.append(
            f"| {r['config']} | {r['batch']} | {r['tokens_per_second']:,.1f} | {_f(bf16)} | "
            f"{_f(result.get('over_transformers', {}).get(key))} | {r['seconds']:.2f} | {split} | "
            f"{_f(r.get('ttft_seconds'))} | {target} | {verdict} |"
        )
    return "\n".join(lines)


_TARGET_ROWS = [  # (field of the suite summary, what it is)
    ("load_over_floor", "load / floor (second load in a process)"),
    ("first_load_over_floor", "first load in a fresh process / floor"),
    ("first_load_with_import_over_floor", "the same + `import layerwise` / floor"),
    ("first_minus_second_load_seconds", "first - second load, seconds"),
    ("first_with_import_minus_second_load_seconds", "first + `import layerwise` - second load, seconds"),
    ("first_minus_best_load_seconds", "first - best later load, seconds"),
    ("first_minus_second_less_torchao_import_seconds", "first - second load less torchao's own import, seconds"),
    ("peak_minus_final_over_largest_layer", "(peak - final) / largest BF16 layer"),
    ("reload_dir_over_copy_floor", "reload from the checkpoint dir / copy floor"),
    ("reload_stream_over_copy_floor", "reload from an in-memory stream / copy floor"),
    ("decode_over_bf16", "decode step / BF16 step"),
    ("rollout_fp8_over_bf16", "rollout tokens/s, FP8 / BF16 (higher is better: the target is a minimum)"),
    ("rollout_over_transformers", "rollout tokens/s, engine / transformers"),
]


def _target(summary: dict, field: str, scheme: str) -> tuple[float | None, bool | None]:
    """(issue 14's target for this figure, whether it is met), or (None, None) where the issue sets none."""
    targets, met, gpu = summary["targets"], summary.get("met", {}), summary["device"] != "cpu"
    with_import = scheme in summary.get("first_load_with_import_over_floor", {})
    first = "first_load_with_import_over_floor" if with_import else "first_load_over_floor"
    if field == (first if gpu else "load_over_floor"):
        return targets["load_over_floor"], met.get(f"load {scheme}")
    less_import = summary.get("first_minus_second_less_torchao_import_seconds", {})
    # the CPU's first-load cost is judged with import layerwise where the results have it (older ones: without)
    judged = (
        "first_with_import_minus_second_load_seconds"
        if scheme in summary.get("first_with_import_minus_second_load_seconds", {})
        else "first_minus_second_load_seconds"
    )
    if field == judged and not gpu and scheme not in less_import:
        return targets["first_minus_second_load_seconds"], met.get(f"first-load cost {scheme}")
    if field == "first_minus_second_less_torchao_import_seconds":  # judged without torchao's import
        return targets["first_minus_second_load_seconds"], met.get(f"first-load cost {scheme}")
    if field == "reload_stream_over_copy_floor":
        return targets[field], met.get(f"reload stream {scheme}")
    if field == "peak_minus_final_over_largest_layer" and field in targets:
        return targets[field], met.get(f"peak {scheme}")
    if field == "decode_over_bf16" and scheme in summary.get("decode_targets", {}):
        return summary["decode_targets"][scheme], met.get(f"decode {scheme}")
    if field == "rollout_fp8_over_bf16" and f"rollout {scheme}" in met:  # scheme: "<scheme> batch <b>"
        return targets["rollout_fp8_over_bf16"], met[f"rollout {scheme}"]
    return None, None


def targets_table(summary: dict) -> str:
    """Markdown table of a suite summary: each of issue 14's figures per scheme, its target, met or not."""
    lines = ["| figure | scheme | measured | target | met |", "|---|---|---:|---:|---|"]
    for field, what in _TARGET_ROWS:
        for scheme, value in summary.get(field, {}).items():
            target, met = _target(summary, field, scheme)
            verdict = "" if met is None else ("yes" if met else "**no**")
            lines.append(f"| {what} | {scheme} | {value:.2f} | {_f(target, 'g')} | {verdict} |")
    return "\n".join(lines)


def weight_transfer_table(result: dict) -> str:
    """Markdown table of a weight_transfer result: seconds per case, / its floor, receiver peak extra MiB."""
    lines = [
        "| case | seconds | / floor | receiver peak extra MiB | header checks s (share) | checksums s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["results"]:
        extra = f"{r['peak_extra_bytes'] / MIB:,.1f}" if "peak_extra_bytes" in r else ""
        check = f"{r['check_seconds']:.4f} ({r['check_fraction']:.1%})" if "check_seconds" in r else ""
        verify = f"{r['verify_seconds']:.3f}" if "verify_seconds" in r else ""
        lines.append(
            f"| {r['case']} | {r['seconds']:.3f} | {r.get('over_floor', 1.0):.2f} | {extra} | {check} | {verify} |"
        )
    return "\n".join(lines)


def quant_kernels_table(result: dict) -> str:
    """Markdown table of a quant_kernels result: GB/s of each scheme and of clone, per shape."""
    lines = ["| shape | scheme | GB/s | clone GB/s | ratio |", "|---|---|---:|---:|---:|"]
    lines += [
        f"| {'x'.join(map(str, r['shape']))} | {r['scheme']} | {r['gbps']:.2f} | {r['clone_gbps']:.2f} | "
        f"{r['ratio_to_clone']:.2f} |"
        for r in result["results"]
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the README section


def _machine(machine: dict, device: str) -> str:
    where = machine.get("gpu") or device.upper()
    table = machine.get("cpu_fp8_table")
    path = "" if table is None else f", CPU quantize: {'AVX-512 VBMI table' if table else 'generic (no AVX-512 VBMI)'}"
    return f"{where}, {machine['cpu_count']} cores, torch {machine['torch']}, {machine['platform']}{path}"


def _intro(pm: dict) -> str:
    return f"""\
Reproduce with `python -m layerwise.benchmarks.suite` (load, reload, rollout throughput and, on a GPU, the decode
step, in one run under a time budget: `--device cuda --size 8b` for Llama-3-8B shapes), or one benchmark at a
time: `layerwise bench` (= `python -m layerwise.benchmarks.peak_memory`), `python -m
layerwise.benchmarks.reload_latency`, `python -m layerwise.benchmarks.decode_step` (on CUDA with each step's time
per kernel category), `python -m layerwise.benchmarks.rollout` (`Engine.generate` tokens/s against transformers'
`generate`) and `python -m layerwise.benchmarks.quant_kernels` (`--size small|default|0.9b|8b`, `--device
cpu|cuda`); `python -m
layerwise.benchmarks.gemm_tune --device cuda --write-configs` tunes the FP8 GEMMs' tiles for one GPU
(`kernels/configs/<gpu>.json`, against cuBLAS BF16 and `_scaled_mm`), and `python -m
layerwise.benchmarks.first_load_profile` profiles the first load in a process. Each writes its JSON (`layerwise
bench` also a PNG) to `./{DEFAULT_OUT_DIR}/`, or to `--out-dir DIR`; the BF16 checkpoint they generate is kept
in `~/.cache/layerwise/bench/` (`--cache-dir DIR`). The figures below change only on purpose: run them from the
repository root with `--out-dir {REFERENCE_DIR}`, then `python -m layerwise.benchmarks.readme` (`--check` tells
whether this section is stale); it shows the newest results of each benchmark per device.
Results below: {_machine(pm["machine"], pm["device"])}."""


def _written_by(pm: dict) -> str:
    # results without a date predate benchmarks/checkpoints.py, when transformers wrote the checkpoint
    return "of random weights written with safetensors" if pm.get("date") else "written by transformers"


def _reused_pages_line(pm: dict, reused: tuple[str, dict] | None) -> str | None:
    """The load ratios of a ``--pages reused`` run of the same checkpoint, as one bullet (None: no such run)."""
    if reused is None or reused[1].get("size") != pm.get("size"):
        return None
    stem, data = reused
    rows = {r["method"]: r for r in data["results"] if "time_over_floor" in r and r["method"].startswith("layerwise-")}
    floor = next((r for r in data["results"] if r["method"] == "floor-read-copy" and "seconds" in r), None)
    if not rows or floor is None:
        return None
    ratios = ", ".join(f"{m[len('layerwise-') :]} {r['time_over_floor']:.2f}x" for m, r in rows.items())
    run = f"commit {data.get('commit', 'unknown')}, {data.get('date', 'undated')}"
    if data.get("machine", {}).get("cpu_fp8_table") != pm.get("machine", {}).get("cpu_fp8_table"):
        run += ", another CPU quantize path than the table above"
    return (
        f"* With `--pages reused` (a loop of loads in one process, each reusing the pages the one before it freed;\n"
        f"  `{REFERENCE_DIR}/{stem}.json`, floor {floor['seconds']:.2f} s; {run}):\n  load / floor {ratios}."
    )


def _peak_memory(pm: dict, image: str | None, reused: tuple[str, dict] | None = None) -> str:
    cfg = pm["config"]
    rows = {r["method"]: r for r in pm["results"] if "error" not in r}
    parts = [
        f"""### Peak memory and load time

A {cfg["num_hidden_layers"]}-layer Llama checkpoint (hidden {cfg["hidden_size"]}, \
intermediate {cfg["intermediate_size"]}, vocab {cfg["vocab_size"]}) {_written_by(pm)} in BF16,
{pm["checkpoint_bytes"] / MIB:,.0f} MiB; every method in a fresh process, measured by the same tracker.{_pages_note(pm)}
{f"{chr(10)}![memory timeline]({image}){chr(10)}" if image else ""}
{peak_memory_table(pm)}"""
    ]
    ours = rows.get("layerwise-fp8-per-tensor")
    if ours is None:
        return parts[0]
    compared = [
        (m, what)
        for m, what in [
            ("naive-bf16-then-fp8", "loading in BF16 and quantizing in place"),
            ("hf+torchao-quantize_", "transformers + torchao `quantize_`"),
        ]
        if m in rows
    ]
    text = f"* layerwise FP8 per-tensor peaks at {ours['peak_over_final']:.2f}x its final size"
    if compared:
        text += "; the peak is\n  " + ", and\n  ".join(
            f"{rows[m]['peak_bytes'] / ours['peak_bytes']:.2f}x lower than {what}" for m, what in compared
        )
    text += "."
    if "final_bytes" in ours and ours["peak_bytes"] - ours["final_bytes"] < 1024:
        text += (
            f" Its peak is its\n  final size + {ours['peak_bytes'] - ours['final_bytes']} bytes: each weight is "
            "quantized from the checkpoint's memory-mapped tensors\n  straight into its FP8 tensor, with no BF16 copy."
        )
    elif f"{ours['peak_over_final']:.2f}" == "1.00":
        lm_head = cfg["vocab_size"] * cfg["hidden_size"] * 2  # BF16, not tied to the embedding
        text += (
            f" Its peak equals its\n  final size because lm_head (kept in BF16, {lm_head / MIB:,.1f} MiB) "
            "arrives\n  last and outweighs the one-layer transient."
        )
    parts.append(text)
    if pm["device"] == "cpu" and any(m.startswith("hf") for m in rows):
        text = """* On CPU, transformers keeps tensors it does not quantize as zero-copy mmap views of the checkpoint;
  they are added to its peak (on a GPU they would be device memory), and for `hf+torchao-quantize_`
  the bytes held when `from_pretrained` returns are sampled too (the x in the plot). Both HF figures
  are lower bounds of what a GPU would see."""
        if "hf-TorchAoConfig" in rows:
            ratio = rows["hf-TorchAoConfig"]["peak_bytes"] / ours["peak_bytes"]
            text += (
                " `hf-TorchAoConfig` quantizes inside `from_pretrained`\n"
                f"  one tensor at a time, so its peak is {ratio:.2f}x ours."
            )
        parts.append(text)
    if "time_over_floor" in ours:
        text = f"{ours['time_over_floor']:.2f}x the read-and-copy floor (target {TARGET_TIME_OVER_FLOOR}x)"
        if "first_over_floor" in ours:
            text += f"; the first load in a fresh process: {ours['first_over_floor']:.2f}x"
        if ours["time_over_floor"] <= TARGET_TIME_OVER_FLOOR:
            parts.append(f"* Load time: {text}.")
        else:
            parts.append(f"""* Load time is not yet where we want it in this run: {text}. Each weight
  is read twice from the memory-mapped checkpoint (amax, then quantize into fresh FP8 memory) where the floor
  copies it once into fresh BF16 memory; both are bound by page faults, and on a shared VM the floor's
  best time varies from run to run more than ours does.""")
    line = _reused_pages_line(pm, reused)
    if line:
        parts.append(line)
    return parts[0] + "\n\n" + "\n".join(parts[1:])


def _reload_method(rl: dict) -> str:
    """How a reload_latency result was measured, in a sentence or two (older results: best of N)."""
    if any("rounds" in r for r in rl["results"]):
        return (
            f"After a first reload (first s), {rl['repeats']} rounds of one floor copy and one reload back to back: "
            "seconds = the best reload, floor s = the best floor copy of those rounds, / floor = seconds / floor s "
            "(the figure the target is judged on), / fastest floor = the best reload over the fastest floor copy of "
            "the whole run."
        )
    first = " after a first reload (first s)" if any("first_seconds" in r for r in rl["results"]) else ""
    return f"Best of {rl['repeats']} runs each{first}; / floor = over the fastest floor copy of the run."


def _reload_latency(rl: dict, pm: dict) -> str:
    if rl["checkpoint"] == pm["checkpoint"]:
        what = "The same checkpoint"
    else:
        what = f"A {rl['stream_bytes'] / MIB:,.0f} MiB BF16 checkpoint ({rl['size']} size)"
    where = "" if rl["machine"] == pm["machine"] else f" Run on {_machine(rl['machine'], rl['device'])}."
    return f"""### Hot reload latency

{what} as an in-memory BF16 stream (as from a trainer) and from disk, into a live model;
floor = `copy_` of the same tensors into preallocated BF16 tensors. {_reload_method(rl)}{where}

{reload_latency_table(rl)}"""


def _met(ok: bool) -> str:
    return "met" if ok else "not met"


def _weight_transfer(wt: dict, pm: dict) -> str:
    rows = {r["case"]: r for r in wt["results"]}
    if (wt["config"], wt["checkpoint_bytes"]) == (pm["config"], pm["checkpoint_bytes"]):
        what = "The same checkpoint"
    else:
        what = f"A {wt['checkpoint_bytes'] / MIB:,.0f} MiB BF16 checkpoint ({wt['size']} size)"
    same = {k: v for k, v in wt["machine"].items() if k != "torch_threads"} == {
        k: v for k, v in pm["machine"].items() if k != "torch_threads"
    }
    where = "" if same else f" Run on {_machine(wt['machine'], wt['device'])}."
    transport = "gloo on 127.0.0.1" if wt["device"] == "cpu" else "NCCL"
    threads = wt["torch_threads_per_process"]
    bucket = f"{wt['packed_buffer_size_bytes'] / MIB:g} MiB"
    threads_word = "thread" if threads == 1 else "threads"
    text = f"""### Weight sync from a trainer

{what}, held in BF16 by a trainer process, sent into a live FP8 engine in a second process over
the "nccl" backend ({transport}) by `python -m layerwise.benchmarks.weight_transfer`. Floor =
broadcasting the same bytes on the same group into preallocated buffers (each tensor alone for
unpacked, the same {bucket} buckets for packed). Seconds run from the trainer's first send until
`update_weights` returns; best of {wt["repeats"]} runs, {threads} torch {threads_word} per process.
Each update case was checked bit for bit against a fresh `load_model` of the trainer's weights.{where}

{weight_transfer_table(wt)}"""
    packed, unpacked = rows.get("update: packed"), rows.get("update: unpacked")
    notes = []
    if packed is not None:
        note = (
            f"* Packed update: {packed['over_floor']:.2f}x its floor (target {wt['target_time_over_floor']}x): "
            f"{_met(packed['meets_time_target'])}."
        )
        if not packed["meets_time_target"] and "wait_seconds" in packed and wt["device"] == "cpu":
            cores = wt["machine"]["cpu_count"]
            note += (
                f" The engine waited {packed['wait_seconds']:.2f} s of its {packed['seconds']:.2f} s for\n"
                f"  bytes; the rest is re-quantization, which shares the {cores} cores with the transfer's own copies."
            )
        notes.append(note)
    if packed is not None and unpacked is not None:
        both = packed["meets_memory_target"] and unpacked["meets_memory_target"]
        verdict = (
            _met(both)
            if both or not (packed["meets_memory_target"] or unpacked["meets_memory_target"])
            else (f"met for {'packed' if packed['meets_memory_target'] else 'unpacked'} only")
        )
        notes.append(
            f"* Receiver peak extra memory: {packed['peak_extra_bytes'] / MIB:,.1f} MiB packed and "
            f"{unpacked['peak_extra_bytes'] / MIB:,.1f} MiB unpacked, against 2 buckets + the largest layer\n"
            f"  ({packed['memory_bound_bytes'] / MIB:,.1f} and {unpacked['memory_bound_bytes'] / MIB:,.1f} MiB; "
            f"unpacked, a bucket is the largest tensor): {verdict}."
        )
    checked = [r for r in (unpacked, packed) if r is not None and "check_cost" in r]
    if checked:
        costs = ", ".join(f"{r['check_cost']:+.1%} {r['case'].removeprefix('update: ')}" for r in checked)
        met = all(r["meets_check_target"] for r in checked)
        notes.append(
            f"* The header check before each bucket (issue 32): the update with it / without it - 1 = {costs} "
            f"(target <= {wt['target_check_cost']:.0%}: {_met(met)}); header checks s = the engine's waits for\n"
            f"  an agreement, waiting for the trainer to reach the bucket included."
        )
    verified = rows.get("update: packed, verify")
    if verified is not None:
        notes.append(
            f"* `verify=True` (a checksum of every bucket, CRC-32 here): {verified['over_unverified']:.2f}x the "
            f"plain packed update ({verified['verify_seconds']:.2f} s of checksums and their all-reduces)."
        )
    return "\n\n".join([text, "\n".join(notes)]) if notes else text


def _quant_kernels(qk: dict, pm: dict) -> str:
    device = qk["device_name"] if qk["device"].startswith("cuda") else qk["device"].upper()
    kernels = "/".join(sorted({r["kernel"] for r in qk["results"]}))
    same = (qk["torch"], qk["threads"]) == (pm["machine"]["torch"], pm["machine"]["torch_threads"])
    where = "" if same else f" Run with torch {qk['torch']}, {qk['threads']} threads."
    text = f"""### Quantization kernels ({device}, {kernels} path)

amax + scale + quantize on BF16 weights; GB/s counts the input bytes once, clone in the same run.{where}

{quant_kernels_table(qk)}"""
    if qk["device"] == "cpu" and kernels == "torch":
        native = qk.get("cpu_native")
        text += (
            "\n\nOn CPU the torch kernel runs the native kernels (`kernels/_cpu_fp8.c`, built by `pip install`: one "
            "vectorized pass for the amax, one for the quantization, on torch's OpenMP threads; bit-exact with the "
            "reference)"
            + (
                ": here the quantization of BF16 with a scale from its own amax was a table lookup (AVX-512 VBMI)."
                if qk.get("cpu_table_path")
                else "."
            )
            if native
            else "\n\nOn CPU every granularity ran the chunked eager reference (widen into a reused float32 buffer, "
            "divide in place, cast): the native kernels (`kernels/_cpu_fp8.c`) were not built."
        )
    return text


def tp_load_table(result: dict) -> str:
    """Markdown table of a tp_load result: per-rank bytes read, model, peak and load time per tp size."""
    lines = [
        "| tp | bytes read per rank (MiB) | model per rank (MiB) | peak per rank (MiB) | "
        "(peak - model) / (largest layer / tp) | load s (slowest rank) |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["results"]:
        tp, ranks = run["tp"], run["ranks"]
        worst = max(ranks, key=lambda r: r["peak_bytes"] - r["model_bytes"])
        layer_share = worst["largest_layer_checkpoint_bytes"] / tp
        lines.append(
            f"| {tp} | {max(r['bytes_read'] for r in ranks) / MIB:,.1f} | {worst['model_bytes'] / MIB:,.1f} | "
            f"{worst['peak_bytes'] / MIB:,.1f} | {(worst['peak_bytes'] - worst['model_bytes']) / layer_share:.2f} | "
            f"{max(r['seconds'] for r in ranks):.2f} |"
        )
    return "\n".join(lines)


def _tp_load(tp: dict, pm: dict) -> str:
    runs = {run["tp"]: run["ranks"] for run in tp["results"]}
    total = runs[1][0]["bytes_read"] if 1 in runs else tp["results"][0]["ranks"][0]["checkpoint_bytes"]
    shares = ", ".join(
        f"{max(r['bytes_read'] for r in ranks) / total:.2f} at tp={n}" for n, ranks in runs.items() if n > 1
    )
    return f"""### Tensor-parallel load

The same checkpoint loaded as {tp["quantization"]} with `global_scales=True` on tp ranks (gloo on
127.0.0.1, one thread per process; a warm-up load first, then the measured one) by
`python -m layerwise.benchmarks.tp_load`. Each rank reads only its slices: bytes read per rank /
checkpoint = {shares}. Run it yourself with `torchrun --nproc-per-node 2 -m layerwise.tp_demo --compare`.

{tp_load_table(tp)}"""


def tp_load_moe_table(result: dict) -> str:
    """Markdown table of a tp_load --moe result: per tp size and layout, the largest rank's bytes read over the
    checkpoint against its target, peak - model against one expert unit + the work buffer, and load seconds."""
    lines = [
        "| tp | layout | bytes read / checkpoint | target | peak - model (KiB) | one expert unit + work buffer (KiB) "
        "| largest unit (KiB) | load s (slowest rank) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for run in result["results"]:
        ranks = run["ranks"]
        read = max(r["bytes_read_fraction"] for r in ranks)
        over = max(r["peak_minus_model_bytes"] for r in ranks)
        peak_target = max(r["peak_target_bytes"] for r in ranks)
        read_mark = "" if all(r["meets_read_target"] for r in ranks) else " **(not met)**"
        peak_mark = "" if all(r["meets_peak_target"] for r in ranks) else " **(not met)**"
        lines.append(
            f"| {run['tp']} | {run['layout']} | {read:.4f}{read_mark} | {run['read_target']['target_fraction']:.4f} "
            f"| {over / 1024:,.1f}{peak_mark} | {peak_target / 1024:,.0f} "
            f"| {max(r['largest_unit_bytes'] for r in ranks) / 1024:,.0f} | {run['slowest_rank_seconds']:.2f} |"
        )
    return "\n".join(lines)


def _tp_load_moe(result: dict) -> str:
    c = result["checkpoint"]
    runs = result["results"]
    met = all(r["meets_read_target"] and r["meets_peak_target"] for run in runs for r in run["ranks"])
    replicated = ", ".join(
        f"{run['read_target']['replicated_bytes'] / MIB:.2f} MiB at tp={run['tp']}"
        for run in runs
        if run["tp"] > 1 and run["layout"] == runs[-1]["layout"]
    )
    shape = (
        f"{c['num_experts']} experts, top-{c['num_experts_per_tok']}, {c['num_hidden_layers']} layers, "
        f"hidden {c['hidden_size']}, moe_intermediate_size {c['moe_intermediate_size']}, "
        f"{c['num_key_value_heads']} kv head(s); {c['checkpoint_bytes'] / MIB:,.1f} MiB of BF16"
    )
    return f"""### Tensor-parallel load, mixture of experts

`python -m layerwise.benchmarks.tp_load --moe`: the Qwen3-30B-A3B-shaped checkpoint of the MoE load benchmark
({shape}) loaded as {result["quantization"]} with `global_scales=True` on tp ranks ({result.get("backend", "gloo")},
one thread per process; a warm-up load, a tracked load for the bytes, an untracked one for the time), in both MoE
layouts: **tp** (every expert, its intermediate dimension sharded) and **ep** (`expert_parallel=True`: whole experts
per rank, the others never read). Targets per rank: bytes read / checkpoint <= 1/tp + the share every rank reads
whole (norms, routers, and the k/v heads when tp exceeds them: {replicated}); peak - model <= one expert unit (an
expert's gate+up on that rank, BF16) + the FP8 work buffer ({result["work_buffer_bytes"] / 1024:,.0f} KiB). All
targets {"met" if met else "**not met**"}. With global scales the tp layout reduces every expert's amax over the
ranks, one all-reduce per expert unit, and quantizes each expert from its materialized unit; the ep layout needs
neither. Run with {_provenance(result)}. The same layouts generate text in
`torchrun --nproc-per-node 2 -m layerwise.tp_demo --moe [--expert-parallel] --compare`.

{tp_load_moe_table(result)}"""


def device_key(data: dict) -> str:
    """ "cpu", or the GPU's name, for grouping results by the device they ran on."""
    if str(data.get("device", "cpu")).startswith("cpu"):
        return "cpu"
    return data.get("device_name") or data.get("machine", {}).get("gpu") or str(data["device"])


def latest_results(results: Path, by=None) -> dict[tuple, tuple[str, dict]]:
    """(benchmark, device key) -> (file stem, data) of the newest results JSON in ``results``: the latest
    ``date`` field (files without one count as oldest), ties broken by file name. ``by``: another grouping
    key of a results dict (default: its benchmark and device key; a peak_memory run in a heap regime other than
    the default one counts as the benchmark "peak_memory_<pages>", e.g. peak_memory_reused)."""
    by = by or (lambda data: (_benchmark_name(data), device_key(data)))
    latest: dict = {}
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "benchmark" not in data:
            continue  # e.g. the demo's LoadReport
        key = by(data)
        rank = (data.get("date") or "", path.stem)
        if key not in latest or rank > latest[key][0]:
            latest[key] = (rank, path.stem, data)
    return {key: (stem, data) for key, (_, stem, data) in latest.items()}


def _benchmark_name(data: dict) -> str:
    pages = data.get("pages", "fresh")
    return data["benchmark"] if pages == "fresh" else f"{data['benchmark']}_{pages}"


def _latest_per_size(results: Path, benchmark: str) -> list[dict]:
    """The newest CPU results of ``benchmark`` for each checkpoint ``size`` it ran at, by size name."""
    latest = latest_results(results, by=lambda data: (data["benchmark"], device_key(data), data.get("size")))
    ours = {key[2]: data for key, (_, data) in latest.items() if key[:2] == (benchmark, "cpu")}
    return [ours[size] for size in sorted(ours, key=str)]


def _moe_load(ml: dict) -> str:
    """The MoE load table (benchmarks/moe_load.py): peak and final bytes, peak/final and time/floor per method."""
    c = ml["shape"]
    rows = []
    for r in ml["results"]:
        if "error" in r:
            rows.append(f"| {r['method']} | did not run: {r['error']} | | | | |")
            continue
        rows.append(
            f"| {r['method']} | {_f(r['peak_bytes'] / MIB, ',.1f')} | {_f(r['final_bytes'] / MIB, ',.1f')} "
            f"| {_f(r['peak_over_final'])} | {_f(r['seconds'])} | {_f(r['time_over_floor'])} |"
        )
    ours = [r for r in ml["results"] if r["method"].startswith("layerwise") and "error" not in r]
    peak_met = "met" if ours and all(r["meets_peak_target"] for r in ours) else "**not met**"
    time_met = "met" if ours and all(r["meets_time_target"] for r in ours) else "**not met**"
    peak_target, time_target = ml["targets"]["peak_over_final"], ml["targets"]["time_over_floor"]
    expert_kib = _f(ml["one_expert_bf16_bytes"] / 1024, ",.0f")
    layer_mib = _f(ml["whole_moe_layer_bf16_bytes"] / MIB, ",.1f")
    threads = ml.get("omp_num_threads") or ml.get("machine", {}).get("torch_threads", "default")
    where = "CPU" if device_key(ml) == "cpu" else device_key(ml)
    return f"""### Mixture of experts load ({where}, size {ml.get("size")})

A Qwen3-30B-A3B-shaped checkpoint with fewer layers, by `python -m layerwise.benchmarks.moe_load`:
{c["num_experts"]} experts, top-{c["num_experts_per_tok"]}, {c["num_hidden_layers"]} layers, hidden {c["hidden_size"]},
moe_intermediate_size {c["moe_intermediate_size"]} ({_f(ml["checkpoint_bytes"] / MIB, ",.1f")} MiB of BF16; one expert
{expert_kib} KiB, a whole MoE layer {layer_mib} MiB).
Run with {ml["versions"].get("torch")}, commit {ml.get("commit")}, {ml.get("date")}, {threads} thread(s).

| method | peak MiB | final MiB | peak/final | load s | load/floor |
|---|---:|---:|---:|---:|---:|
{chr(10).join(rows)}

Targets: peak/final <= {peak_target}: {peak_met}; load <= {time_target}x the floor: {time_met}.
transformers + torchao `quantize_` leaves the fused 3-D experts in BF16 (its final size is the checkpoint's)."""


def _shape(data: dict) -> str:
    s = data.get("shape") or {}
    if not s:
        return f"size {data.get('size')}"
    return (
        f"{data.get('size')} size: {s['num_hidden_layers']} layers, hidden {s['hidden_size']}, "
        f"intermediate {s['intermediate_size']}, vocab {s['vocab_size']}, "
        f"{s['num_attention_heads']}/{s['num_key_value_heads']} heads"
    )


def _provenance(data: dict) -> str:
    v = data.get("versions") or {}
    parts = [f"{name} {v[name]}" for name in ("torch", "triton", "transformers", "torchao") if v.get(name)]
    return ", ".join(parts + [f"commit {data.get('commit', 'unknown')}", data.get("date", "undated")])


def _took(summary: dict) -> str:
    if summary.get("total_seconds") is None:  # --summarize: the parts ran in separate jobs
        return "the parts ran in separate jobs (" + ", ".join(summary.get("summarized_from", {})) + ")"
    generation = f", checkpoint generation {summary['generation_seconds']:.0f} s of it"
    return f"{summary['total_seconds']:.0f} s{generation}"


def _targets(summary: dict, where: str) -> str:
    t = summary["targets"]
    return f"""#### Targets ({where})

`python -m layerwise.benchmarks.suite --device {summary["device"]} --size {summary["size"]}`: {_took(summary)}.
Checkpoint: {_shape(summary)}.
Run with {_provenance(summary)}.
Targets: load / floor <= {t["load_over_floor"]} (GPU: the first load in a fresh process, `import layerwise`
included; CPU: the second load); on CPU, the first load + `import layerwise` - the second load <=
{t["first_minus_second_load_seconds"]} s (a torchao scheme: first - second less torchao's own import, measured in a
fresh interpreter; results that predate the import figure: first - second);
peak - final <= one BF16 layer; reload from a stream <= {t["reload_stream_over_copy_floor"]}x the copy floor;
decode W8A8 (and auto) <= {t["decode_w8a8_over_bf16"]}x and W8A16 <= {t["decode_w8a16_over_bf16"]}x the BF16 step\
{_rollout_target(t)}.

{targets_table(summary)}"""


def _rollout_target(t: dict) -> str:
    """The suite's rollout target in words ("" for results that predate it)."""
    if "rollout_fp8_over_bf16" not in t:
        return ""
    batches = t.get("rollout_batches", "every batch")
    at = batches if isinstance(batches, str) else "batch " + ", ".join(map(str, batches))
    return f"; rollout FP8 tokens/s >= {t['rollout_fp8_over_bf16']}x BF16's ({at})"


def _rollout(ro: dict, heading: str = "###") -> str:
    """The rollout section (benchmarks/rollout.py): the problem as run, the table, the targets' verdict."""
    p, t = ro["problem"], ro["targets"]
    batches = "every batch" if t["batches"] == "every batch" else "batch " + ", ".join(map(str, t["batches"]))
    verdicts = list(ro.get("met", {}).values())
    verdict = "not measured" if not verdicts else ("met" if all(verdicts) else "**not met**")
    warm = f", cut to {p['warmup_prompt_len']} tokens" if p.get("warmup_prompt_len") else ""
    threads = ro["machine"]["torch_threads"]
    return f"""{heading} Rollout throughput ({"CPU" if device_key(ro) == "cpu" else device_key(ro)}, size {ro["size"]})

`Engine.generate` of {p["prompts"]} prompts of random token ids, {p["min_prompt_len"]} to {p["max_prompt_len"]} tokens \
long (uniform, seed {p["seed"]}), each completed
with exactly {p["max_tokens"]} tokens (temperature 1.0, `ignore_eos`, a seed per request), by `python -m
layerwise.benchmarks.rollout`. Every configuration runs in a fresh process: one warm-up generate (the first
`batch` prompts{warm}, their completions ending one captured batch size apart),
then {_calls(ro)} with all prompts at once through `batch` KV cache slots (continuous batching).
transformers: `AutoModelForCausalLM` in BF16, `generate` over left-padded batches of `batch` prompts
(do_sample, temperature 1.0, min_new_tokens = max_new_tokens). Prefill / decode s: the engine's forwards
within the call (sampling excluded); first prefill s: from the call until the first prefill's logits.
Checkpoint: {_shape(ro)}.
Run with {_provenance(ro)}, {threads} thread(s), {ro["total_seconds"]:.0f} s in all{_load_average(ro)}.

{rollout_table(ro)}

Target: FP8 tokens/s >= {t["fp8_over_bf16"]}x the BF16 engine's, each scheme, at {batches}: {verdict}."""


def _mismatch(mm: dict, results: Path, readme: Path) -> str:
    """The rollout / reference mismatch section (benchmarks/mismatch.py) of one model's CPU run: what ran, the
    table, the plot of the importance ratios."""
    from layerwise.benchmarks.mismatch import describe, table

    png = results.resolve() / f"mismatch_cpu_{mm['model']}.png"
    image = ""
    if png.exists():
        relative = Path(os.path.relpath(png, readme.resolve().parent)).as_posix()
        image = f"\n\n![log importance ratio per scheme]({relative})"
    return f"""### Rollout / reference mismatch (CPU, {mm["model"]})

{describe(mm)} Reproduce with `layerwise mismatch [PATH]` or `python -m layerwise.benchmarks.mismatch`.

{table(mm)}{image}"""


def _calls(ro: dict) -> str:
    repeats = ro.get("repeats", 1)
    return "the timed call" if repeats == 1 else f"{repeats} timed calls (the fastest counts), each"


def _load_average(ro: dict) -> str:
    """The range of the rows' 1-minute load averages on a CPU, as a clause ("" on a GPU or for older results)."""
    loads = [r["load_average"] for r in ro["results"] if "load_average" in r]
    if not loads or device_key(ro) != "cpu":
        return ""
    cores = ro["machine"]["cpu_count"]
    return f"; 1-minute load average {min(loads):.1f} to {max(loads):.1f} on {cores} cores before the timed calls"


def _hf_placement(pm: dict) -> str:
    return next((r["hf_placement"] for r in pm["results"] if "hf_placement" in r), "device_map")


def _gpu_section(device: str, data: dict) -> str:
    """The results measured on one GPU: load, reload, decode and the issue's targets."""
    first = next(data[b] for b in GPU_BENCHMARKS if b in data)
    parts = [
        f"""### On {device}

The newest results of this GPU, from `python -m layerwise.benchmarks.suite --device cuda --size {first.get("size")}`;
page cache warm. Checkpoint: {_shape(first)}.
Run with {_provenance(first)}."""
    ]
    if "peak_memory" in data:
        pm = data["peak_memory"]
        parts.append(f"""#### Load: peak memory and time

{pm["checkpoint_bytes"] / 2**30:,.2f} GiB of BF16; every method in a fresh process: its first load, then a \
second (load s); transformers places the model by {_hf_placement(pm)}.

{peak_memory_table(pm)}""")
    if "reload_latency" in data:
        rl = data["reload_latency"]
        parts.append(f"""#### Hot reload

{rl["stream_bytes"] / 1e9:.2f} GB of BF16 into a live model; floor = `copy_` of the same pinned host tensors
into preallocated device tensors (the H2D copy floor). {_reload_method(rl)}

{reload_latency_table(rl)}""")
    if "decode_step" in data:
        ds = data["decode_step"]
        parts.append(f"""#### Decode step

`layerwise.Engine`, batch {ds["batch"]}, one token per sequence at position {ds["position"]} of a \
{ds["max_seq_len"]}-token static cache, CUDA graph replayed; median of the timed steps.

{decode_table(ds)}""")
    if "rollout" in data:
        parts.append(_rollout(data["rollout"], heading="####"))
    if "suite" in data:
        parts.append(_targets(data["suite"], device))
    if "moe_load" in data:
        parts.append("#" + _moe_load(data["moe_load"]))
    return "\n\n".join(parts)


def _cell(value, fmt: str = ".2f", suffix: str = "x") -> str:
    return "not measured" if value is None else f"{value:{fmt}}{suffix}"


def _headline_column(latest: dict, device: str) -> dict[str, str]:
    """One device's cells of the headline table, from its newest suite, peak_memory, weight_transfer results."""
    suite = latest.get(("suite", device), (None, {}))[1]
    pm = latest.get(("peak_memory", device), (None, {}))[1]
    wt = latest.get(("weight_transfer", device), (None, {}))[1]
    rows = {r.get("method"): r for r in pm.get("results", [])}
    ours, hf = rows.get(f"layerwise-{HEADLINE_SCHEME}", {}), rows.get("hf+torchao-quantize_", {})
    peak = _cell(ours.get("peak_over_final"))
    if hf.get("peak_over_final") is not None:
        peak += f" (transformers + torchao: {hf['peak_over_final']:.2f}x)"
    first = suite.get("first_load_with_import_over_floor", {}).get(HEADLINE_SCHEME)
    later = suite.get("load_over_floor", {}).get(HEADLINE_SCHEME)
    load = _cell(first) + ("" if later is None else f" (later loads {later:.2f}x)")
    packed = {r["case"]: r for r in wt.get("results", [])}.get("update: packed", {})
    decode = suite.get("decode_over_bf16", {}).get(f"{HEADLINE_SCHEME}/w8a8")
    when = f"{suite['date'][:10]}, commit {suite.get('commit', 'unknown')}" if suite.get("date") else "not measured"
    ro = latest.get(("rollout", device), (None, {}))[1]
    return {
        "peak": peak,
        "load": load,
        "reload": _cell(suite.get("reload_stream_over_copy_floor", {}).get(HEADLINE_SCHEME)),
        "sync": _cell(packed.get("over_floor")),
        "decode": _cell(decode) if device != "cpu" else "GPU only",
        "rollout": _rollout_cell(ro, suite.get("size")),
        "when": when,
    }


def _mismatch_cell(mm: dict) -> str:
    """The headline's mismatch cell: the default scheme's figures with the BF16 KV cache, on a trained model."""
    row = next(
        (r for r in mm.get("results", []) if r["scheme"] == HEADLINE_SCHEME and r["kv_cache_dtype"] == "auto"), None
    )
    if row is None:
        return "not measured"
    return (
        f"KL {row['mean_kl']:.3f}, r {row['ratio_p1']:.2f}-{row['ratio_p99']:.2f}, "
        f"perplexity {row['perplexity'] / row['reference_perplexity']:.3f}x; {mm['model']}, {row['tokens']} tokens, "
        f"{mm.get('date', '')[:10]}, commit {mm.get('commit', 'unknown')}"
    )


def _rollout_cell(ro: dict, size: str | None) -> str:
    """The headline's rollout cell: FP8 (HEADLINE_SCHEME) tokens/s over BF16 at the largest batch run, the BF16
    engine over transformers, and where and when it ran when that is not the column's checkpoint or run."""
    prefix = f"{HEADLINE_SCHEME} batch "  # the keys of fp8_over_bf16: "<scheme> batch <b>"
    found = sorted((int(k[len(prefix) :]), v) for k, v in ro.get("fp8_over_bf16", {}).items() if k.startswith(prefix))
    if not found:
        return "not measured"
    batch, ratio = found[-1]
    text = f"{ratio:.2f}x at batch {batch}"
    hf = ro.get("over_transformers", {}).get(f"none batch {batch}")
    if hf is not None:
        text += f" (BF16 engine / transformers: {hf:.2f}x)"
    if ro.get("size") != size:
        text += f"; {ro.get('size')} checkpoint, {ro.get('date', '')[:10]}, commit {ro.get('commit', 'unknown')}"
    return text


_HEADLINE_ROWS = [
    ("peak", "peak memory / FP8 model"),
    ("load", "load / read-and-copy floor, first load in a process, `import` included"),
    ("reload", "reload from a trainer's tensors / `copy_` floor"),
    ("sync", "weight sync, trainer process -> engine (packed) / broadcast floor"),
    ("decode", "decode step, FP8 W8A8 / BF16 (batch 8, CUDA graph)"),
    ("rollout", "rollout tokens/s, FP8 / BF16 (`Engine.generate`; higher is better)"),
    ("mismatch", "FP8 rollouts vs the BF16 policy: mean KL, importance ratio p1-p99, perplexity / BF16's"),
    ("when", "measured"),
]


def headline_section(results: Path) -> str:
    """The README's one table: peak, load, reload, sync and decode of the default scheme, newest GPU first,
    then the CPU, each column with its checkpoint, date and commit (docs/benchmarks.md has every scheme).

    Raises:
        FileNotFoundError: no CPU suite results in ``results``.
    """
    latest = latest_results(results)
    if ("suite", "cpu") not in latest:
        raise FileNotFoundError(f"no CPU results of the suite benchmark in {results}")
    gpus = sorted({d for b, d in latest if d != "cpu" and b == "suite"}, key=lambda d: latest[("suite", d)][1]["date"])
    devices = list(reversed(gpus)) + ["cpu"]
    heads = []
    for d in devices:
        suite = latest[("suite", d)][1]
        where = d if d != "cpu" else f"CPU, {suite['machine']['cpu_count']} cores"
        heads.append(f"{where}, {suite.get('size')} checkpoint")
    columns = [_headline_column(latest, d) for d in devices]
    # the newest mismatch run on a trained model (not the demo's random weights) per device
    trained = latest_results(results, by=lambda d: (d["benchmark"], device_key(d), d.get("model") != "demo"))
    for column, d in zip(columns, devices, strict=True):
        column["mismatch"] = _mismatch_cell(trained.get(("mismatch", d, True), (None, {}))[1])
    lines = ['| `quantization="fp8"` | ' + " | ".join(heads) + " |", "|---" + "|---:" * len(devices) + "|"]
    lines += [f"| {label} | " + " | ".join(c[key] for c in columns) + " |" for key, label in _HEADLINE_ROWS]
    wt = latest.get(("weight_transfer", "cpu"), (None, {}))[1]
    note = ""
    if wt:
        undated = "" if wt.get("date") else " (a run that predates recording dates and commits)"
        note = f"Weight sync on the CPU: two processes over gloo, {wt['size']} checkpoint{undated}."
    return "\n".join(lines) + "\n" + (f"\n{note}\n" if note else "")


def section(results: Path, readme: Path) -> str:
    """The text between the README markers, from the newest JSON of each benchmark and device in ``results``
    (image paths relative to ``readme``'s folder): the CPU figures first, then one part per GPU.

    Raises:
        FileNotFoundError: no CPU results of a benchmark in CPU_BENCHMARKS.
    """
    latest = latest_results(results)
    data = {}
    for name in CPU_BENCHMARKS:
        if (name, "cpu") not in latest:
            raise FileNotFoundError(f"no CPU results of the {name} benchmark in {results}")
        data[name] = latest[(name, "cpu")][1]
    png = results.resolve() / f"{latest[('peak_memory', 'cpu')][0]}.png"
    image = Path(os.path.relpath(png, readme.resolve().parent)).as_posix() if png.exists() else None
    pm = data["peak_memory"]
    reused = latest.get(("peak_memory_reused", "cpu"))
    tp_moe = latest.get(("tp_load_moe", "cpu"))
    parts = [
        _intro(pm),
        _peak_memory(pm, image, reused),
        _reload_latency(data["reload_latency"], pm),
        _weight_transfer(data["weight_transfer"], pm),
        _tp_load(data["tp_load"], pm),
        *([_tp_load_moe(tp_moe[1])] if tp_moe else []),  # right after the dense tensor-parallel load
        _quant_kernels(data["quant_kernels"], pm),
    ]
    for ml in _latest_per_size(results, "moe_load"):
        parts.append(_moe_load(ml))
    if ("rollout", "cpu") in latest:
        parts.append(_rollout(latest[("rollout", "cpu")][1]))
    for mm in _latest_per_size(results, "mismatch"):
        parts.append(_mismatch(mm, results, readme))
    if ("suite", "cpu") in latest:
        parts.append(_targets(latest[("suite", "cpu")][1], "CPU"))
    for device in sorted({d for b, d in latest if d != "cpu" and b in GPU_BENCHMARKS}):
        parts.append(_gpu_section(device, {b: v[1] for (b, d), v in latest.items() if d == device}))
    return "\n\n".join(parts) + "\n"


def demo_section(results: Path) -> str:
    """The sample ``layerwise load`` output, formatted by the CLI's own ``format_report`` from the
    LoadReport JSON in ``results``/DEMO_FILE.json."""
    from dataclasses import fields

    from layerwise.api import LoadReport
    from layerwise.cli import format_report

    data = json.loads((results / f"{DEMO_FILE}.json").read_text())
    report = LoadReport(**{f.name: data[f.name] for f in fields(LoadReport) if f.name in data})
    return f"```text\n$ layerwise load ~/.cache/layerwise/demo-qwen3-8l --report r.json\n{format_report(report)}\n```\n"


def render(text: str, new_section: str, begin_re=BEGIN, end_mark: str = END) -> str:
    """``text`` (a README) with the part between a pair of markers replaced by ``new_section``.

    Raises:
        ValueError: the markers are missing or out of order.
    """
    begin = begin_re.search(text)
    end = text.find(end_mark, begin.end()) if begin else -1
    if end < 0:
        raise ValueError(f"no '{begin_re.pattern}' line followed by '{end_mark}'")
    return text[: begin.end()] + new_section + text[end:]


def _generated(results: Path, readme: Path, benchmarks: Path) -> dict[Path, tuple[str, str]]:
    """{path: (current text, generated text)} of the README and docs/benchmarks.md."""
    old_readme, old_bench = readme.read_text(), benchmarks.read_text()
    new_readme = render(old_readme, headline_section(results), HEADLINE_BEGIN, HEADLINE_END)
    new_readme = render(new_readme, demo_section(results), DEMO_BEGIN, DEMO_END)
    new_bench = render(old_bench, section(results, benchmarks))
    return {readme: (old_readme, new_readme), benchmarks: (old_bench, new_bench)}


def main(argv=None) -> int:
    """Rewrite (or with ``--check``, compare) docs/benchmarks.md's results and the README's headline table;
    returns the exit status (0 written or up to date, 1 stale under ``--check``, 2 missing files or markers)."""
    parser = argparse.ArgumentParser(
        prog="python -m layerwise.benchmarks.readme",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=Path(REFERENCE_DIR),
        metavar="DIR",
        help=f"folder with the results JSON (default: {REFERENCE_DIR})",
    )
    parser.add_argument(
        "--readme",
        type=Path,
        default=Path("README.md"),
        metavar="PATH",
        help="the README whose headline table and demo output to rewrite (default: README.md)",
    )
    parser.add_argument(
        "--benchmarks",
        type=Path,
        default=Path("docs/benchmarks.md"),
        metavar="PATH",
        help="the page whose results section to rewrite (default: docs/benchmarks.md)",
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if either file differs from what would be generated"
    )
    args = parser.parse_args(argv)
    try:
        pages = _generated(args.results, args.readme, args.benchmarks)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stale = [path for path, (old, new) in pages.items() if old != new]
    if args.check:
        for path in stale:
            old, new = pages[path]
            diff = difflib.unified_diff(old.splitlines(), new.splitlines(), str(path), "generated", lineterm="")
            print("\n".join(diff), file=sys.stderr)
            print(f"{path} is stale: run python -m layerwise.benchmarks.readme", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path][1])
    for path in pages:
        print(f"{path}: {'rewritten' if path in stale else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
