"""Tune the Triton FP8 GEMMs' launch configurations on this GPU, against cuBLAS BF16 and torch._scaled_mm.

For each projection of the --size model (qkv_proj, o_proj, gate_up_proj and down_proj as [N, K]) and each M of --m
(decode batch sizes), every candidate ``GemmTiles`` of each GEMM kind is timed (``kernels.gemm_configs``): "w8a16"
(per-channel weight scales; per tensor runs the same loop), "w8a16-block", "w8a8-block" and "w8a8" (per-channel
weights and per-token activations, checked per tensor too: the Triton alternative to the activation quantization and
``torch._scaled_mm``), as the forward calls them: "w8a8" with x quantized inside the GEMM
(``kernels.fp8_gemm.dynamic_w8a8_gemm``), "w8a8-block" with x quantized beforehand. Each time is a CUDA graph's
replay of 20 calls divided by 20, as the decode step replays them (no launch overhead), the calls cycling through
copies of the weight that together exceed twice the L2 cache (each call streams its weight from memory, as in a
decode step). A candidate is checked first, its outputs and partials filled with NaN beforehand, against the float32
product of the dequantized operands (within 2% of its largest magnitude); one that fails or does not compile is
recorded with its error and never chosen. The references, timed the same way: F.linear in BF16 (cuBLAS),
torch._scaled_mm per tensor and per row (sm89+; with and without the fused activation quantization), and the
activation quantization alone.

    python -m layerwise.benchmarks.gemm_tune --device cuda --size 8b [--m 1,8] [--quick] [--budget S]
        [--compile-threads N] [--write-configs]

Writes DIR/gemm_tune_<device>_<size>.json: per kind, shape and M the best and the default configuration
(microseconds, GB/s of weight bytes read, ratio to BF16), the five fastest candidates, every error, and the
references. --write-configs also writes ``kernels/configs/<device>.json`` (the best per kind, shape and M; "w8a8"
only where it beat both ``_scaled_mm`` references, each with its activation quantization), which the GEMMs launch
with from then on (``kernels.fp8_gemm.launch_tiles``; a batch takes the entry of the smallest tuned M at or above
it), and where the W8A8 forward of per-tensor and per-channel weights runs the Triton GEMM instead of
``_scaled_mm``. On CPU the kernels run interpreted on two candidates: a check of the code path, not a measurement.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from layerwise.benchmarks.checkpoints import shape as checkpoint_shape
from layerwise.benchmarks.machine import provenance
from layerwise.benchmarks.options import add_output_arguments, benchmark_parser, write_json
from layerwise.benchmarks.timing import graph_seconds
from layerwise.kernels import fp8_gemm, fp8_quantize_weight, reference
from layerwise.kernels.fp8_act import quantize_activation
from layerwise.kernels.fp8_gemm import (
    TILES_INTERPRET,
    GemmTiles,
    dynamic_w8a8_gemm,
    fp8_native,
    launch_tiles,
    w8a8_gemm,
    w8a16_gemm,
)
from layerwise.kernels.gemm_configs import KINDS, config_path, write_configs
from layerwise.kernels.reference import ACT_GRANULARITY

DEFAULT_M = (1, 8)  # one sequence, and the Engine's default max_batch_size (the captured decode step's M)
TOLERANCE = 0.02  # of the float32 reference's largest |output|: bf16 outputs, split sums and FP8 tensor cores round
TOP = 5  # fastest candidates kept per kind, shape and M
COMPILE_THREADS = min(16, os.cpu_count() or 1)  # threads that compile a slice's candidates side by side
# the references "w8a8" (x quantized inside the GEMM) must beat to be used: the quantization kernel + _scaled_mm
SCALED_MM = ("act quant + scaled_mm per tensor", "act quant + scaled_mm per row")


def projections(spec: dict) -> dict[str, tuple[int, int]]:
    """[N, K] of each projection of a Llama-shaped ``spec`` (q/k/v and gate/up fused, as the model runs them)."""
    h, i = spec["hidden_size"], spec["intermediate_size"]
    d = h // spec["num_attention_heads"]
    q, kv = spec["num_attention_heads"] * d, spec["num_key_value_heads"] * d
    return {"qkv_proj": (q + 2 * kv, h), "o_proj": (h, q), "gate_up_proj": (2 * i, h), "down_proj": (h, i)}


def candidates(kind: str, m: int, device: torch.device, quick: bool = False) -> list[GemmTiles]:
    """The configurations tried for ``kind`` at ``m`` rows, in a fixed shuffled order: BLOCK_M the next power
    of two of M (16 to 64); column tiles 16-128 (and 256 for "w8a8", whose every column tile quantizes x again:
    wider tiles quantize it fewer times), K steps 128-512 (128 for the W8A8 kinds), 1-8 splits, 3-4 stages, 4 or
    8 warps (--quick: a subset). CPU (interpreter): the interpreter's tile, unsplit and split in two."""
    if device.type == "cpu":
        return [TILES_INTERPRET, TILES_INTERPRET._replace(split_k=2)]
    block_m = min(64, max(16, 1 << (m - 1).bit_length()))
    block_ns, splits, stages, warps = (
        ((16, 64), (1, 4), (4,), (4,)) if quick else ((16, 32, 64, 128), (1, 2, 4, 8), (3, 4), (4, 8))
    )
    block_ks = (128,) if kind != "w8a16" else (128, 256) if quick else (128, 256, 512)
    if kind == "w8a8" and not quick:
        block_ns += (256,)
    out = [
        GemmTiles(block_m, n, k, s, w, st)
        for n, k, s, st, w in itertools.product(block_ns, block_ks, splits, stages, warps)
        if not (k == 512 and n > 32)  # a 64+ x 512 FP8 tile per stage outgrows registers once decoded
    ]
    # dealt in a shuffled order, the same in every run: a search cut short by --budget has sampled the whole
    # space rather than its first corner (the narrowest column tiles)
    random.Random(f"{kind},{m},{quick}").shuffle(out)
    return out


L2_FALLBACK_BYTES = 64 << 20  # where the device properties do not say (an H100 has 50 MB)


def weight_copies(nbytes: int, device: torch.device) -> int:
    """Copies of an ``nbytes`` weight that the timed calls cycle through, so that one cycle reads more than
    twice the GPU's L2 cache: every call streams its weight from memory, as in a decode step that reads
    8 GB of weights, instead of from L2 (an o_proj's 17 MB of FP8 would fit it)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or L2_FALLBACK_BYTES
    return max(1, -(-2 * l2 // nbytes))


def _operands(n: int, k: int, m: int, device: torch.device, seed: int) -> dict:
    """x, its quantized forms, and lists of weight copies (:func:`weight_copies`) per format."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = (0.02 * torch.randn(n, k, generator=g)).to(device=device, dtype=torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)

    def copies(pair, nbytes):
        return [pair] + [tuple(t.clone() for t in pair) for _ in range(weight_copies(nbytes, device) - 1)]

    ops = {"x": x, "w": [w] + [w.clone() for _ in range(weight_copies(2 * n * k, device) - 1)]}
    for granularity in ("tensor", "channel", "block"):
        ops[granularity] = copies(fp8_quantize_weight(w, granularity), n * k)
    for granularity in ("tensor", "token", "group"):
        ops[f"x_{granularity}"] = quantize_activation(x, granularity)
    return ops


def _gemm(kind: str, ops: dict, layout: str | None = None):
    """The call of ``kind`` on ``ops`` as a function of (tiles, weight copy index), and the float32 product of
    its dequantized operands, the reference its output is checked against. ``layout`` "tensor": kind "w8a8"
    with per-tensor weight and activation scales (default: per channel and per token)."""
    x = ops["x"]
    if kind == "w8a16" or kind == "w8a16-block":
        weights = ops["channel" if kind == "w8a16" else "block"]
        call = lambda tiles, i: w8a16_gemm(x, *weights[i % len(weights)], tiles=tiles)
        return call, x.float() @ reference.dequantize(*weights[0], torch.float32).t()
    weight_layout = "block" if kind == "w8a8-block" else layout or "channel"
    act = ACT_GRANULARITY[weight_layout]
    weights, (xq, xs) = ops[weight_layout], ops[f"x_{act}"]
    if kind == "w8a8":  # as the forward calls them: x quantized inside the GEMM (per block: quantized first)
        call = lambda tiles, i: dynamic_w8a8_gemm(x, act, *weights[i % len(weights)], tiles=tiles)
    else:
        call = lambda tiles, i: w8a8_gemm(xq, xs, *weights[i % len(weights)], torch.bfloat16, tiles=tiles)
    x_scale = xs.repeat_interleave(128, dim=1)[:, : xq.shape[1]] if act == "group" else xs
    return call, (xq.float() * x_scale) @ reference.dequantize(*weights[0], torch.float32).t()


@contextlib.contextmanager
def poisoned_outputs():
    """The GEMMs' outputs and split-K partials start as NaN, not as whatever the allocator hands back (often
    the previous candidate's correct result): a configuration that leaves elements unwritten fails its check."""
    real = fp8_gemm._empty
    fp8_gemm._empty = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype, device=device)
    try:
        yield
    finally:
        fp8_gemm._empty = real


def check(call, expected: torch.Tensor, tiles: GemmTiles) -> None:
    """Raise ValueError where ``call``'s output with ``tiles`` strays from ``expected`` by more than TOLERANCE of
    its largest magnitude (or holds NaN: an element left unwritten)."""
    with poisoned_outputs():
        y = call(tiles, 0).float()
    err, limit = (y - expected).abs().max().item(), TOLERANCE * expected.abs().max().item()
    if not err <= limit:  # NaN fails too
        raise ValueError(f"output off by {err:.3g} (limit {limit:.3g})")


def cycling(call, copies: int):
    """A no-argument function that calls ``call(i)`` with i = 0, 1, ... modulo ``copies`` (each captured call of
    :func:`graph_seconds` then reads the next weight copy)."""
    counter = itertools.count()
    return lambda: call(next(counter) % copies)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]


def _references(ops: dict, device: torch.device) -> dict[str, float]:
    """Microseconds of BF16 F.linear, torch._scaled_mm (sm89+) and the activation quantization, the weights
    cycled through their copies as the candidates' are."""
    x, bf16 = ops["x"], ops["w"]
    calls = {"bf16 F.linear": cycling(lambda i: F.linear(x, bf16[i]), len(bf16))}
    if device.type == "cuda" and fp8_native(device):
        tensor, channel = ops["tensor"], ops["channel"]
        (xt, xst), (xr, xsr), dtype = ops["x_tensor"], ops["x_token"], x.dtype

        def per_tensor(i, xt=xt, xst=xst):
            wt, st = tensor[i]
            return torch._scaled_mm(xt, wt.t(), scale_a=xst, scale_b=st, out_dtype=dtype)

        def per_row(i, xr=xr, xsr=xsr):
            wc, sc = channel[i]
            return torch._scaled_mm(xr, wc.t(), scale_a=xsr, scale_b=sc.t(), out_dtype=dtype)

        calls["scaled_mm per tensor"] = cycling(per_tensor, len(tensor))
        calls["scaled_mm per row"] = cycling(per_row, len(channel))
        calls[SCALED_MM[0]] = cycling(lambda i: per_tensor(i, *quantize_activation(x, "tensor")), len(tensor))
        calls[SCALED_MM[1]] = cycling(lambda i: per_row(i, *quantize_activation(x, "token")), len(channel))
    for granularity in ("token", "tensor", "group"):
        calls[f"act quant {granularity}"] = lambda g=granularity: quantize_activation(x, g)
    out = {}
    for name, fn in calls.items():
        try:
            out[name] = 1e6 * graph_seconds(fn, device)
        except Exception as e:  # recorded: a reference this GPU or torch lacks
            out[name] = _error(e)
    return out


def tune(
    size: str,
    device: str,
    ms: tuple[int, ...] = DEFAULT_M,
    kinds: tuple[str, ...] = KINDS,
    quick: bool = False,
    budget: float | None = None,
    threads: int = COMPILE_THREADS,
    progress: Callable[[dict], None] | None = None,
) -> dict:
    """Time every candidate of each kind on each projection and M; returns the result main writes as JSON.

    The work runs in slices, one per M and kind; within a slice each candidate is compiled once and timed on
    every projection (the shapes share the compiled kernel: their sizes are all multiples of 16). ``budget``:
    seconds for the whole run, dealt equally to the slices (time a slice leaves unused passes to the next);
    past its share a slice times only the default tiles. So a run cut short has searched the same candidates
    for every projection, a uniform sample of the space (:func:`candidates` deals them in a shuffled order),
    instead of all of them for the first projections and none for the last (a compile takes about a second per
    configuration and M specialization: a full run at several M can outlast a device session). ``threads``: how
    many compile a slice's candidates at once, before its timings (:func:`precompile`; 1: each as it is timed).
    ``progress``: called with the result so far (``"complete": False``) after every slice, so that a run cut off
    keeps what it measured.
    """
    device = torch.device(device)
    start = time.monotonic()
    spec = checkpoint_shape(size)
    if device.type == "cuda" and not fp8_native(device):
        kinds = tuple(k for k in kinds if not k.startswith("w8a8"))  # FP8 tensor cores only
    shapes = projections(spec)
    best, references, errors = [], [], []
    result = {
        "benchmark": "gemm_tune",
        **provenance(device, size, spec),
        "m": list(ms),
        "quick": quick,
        "budget_seconds": budget,
        "compile_threads": threads,
        "complete": False,
        "seconds": 0.0,
        "projections": {name: list(nk) for name, nk in shapes.items()},
        "best": best,
        "references": references,
        "errors": errors,
        "skipped_over_budget": 0,
    }
    done = 0
    for m in ms:
        ops = {name: _operands(n, k, m, device, seed=n + k + m) for name, (n, k) in shapes.items()}
        refs = {name: _references(ops[name], device) for name in shapes}
        references += [{"shape": name, "n": n, "k": k, "m": m, "us": refs[name]} for name, (n, k) in shapes.items()]
        for kind in kinds:
            done += 1
            deadline = None if budget is None else start + budget * done / (len(ms) * len(kinds))
            timed, defaults, slice_skipped = _tune_slice(kind, m, shapes, ops, device, quick, deadline, errors, threads)
            result["skipped_over_budget"] += slice_skipped
            for name, (n, k) in shapes.items():
                rows = sorted(timed[name])
                if not rows:
                    continue  # every candidate failed: the errors say why
                default_us = next((us for us, t in rows if t == defaults[name]), None)
                us, tiles = rows[0]
                bf16_us = refs[name]["bf16 F.linear"] if isinstance(refs[name]["bf16 F.linear"], float) else None
                best.append({
                    "kind": kind, "shape": name, "n": n, "k": k, "m": m, "tiles": list(tiles), "us": us,
                    "weight_gbps": n * k / us / 1e3, "default_tiles": list(defaults[name]), "default_us": default_us,
                    "over_bf16": us / bf16_us if bf16_us else None,
                    "default_over_bf16": default_us / bf16_us if bf16_us and default_us else None,
                    "top": [{"tiles": list(t), "us": u} for u, t in rows[:TOP]],
                })  # fmt: skip
                default_text = f"{default_us:.1f} us" if default_us else "failed"
                print(f"  {name} [{n}, {k}] M={m} {kind}: best {us:.1f} us {tuple(tiles)}, default {default_text}",
                      file=sys.stderr)  # fmt: skip
            print(f"  M={m} {kind}: {time.monotonic() - start:.0f} s, {slice_skipped} timings skipped over budget",
                  file=sys.stderr)  # fmt: skip
            result["seconds"] = time.monotonic() - start
            if progress is not None:
                progress(result)
    result["complete"] = True
    return result


def precompile(jobs: list, device: torch.device, threads: int = COMPILE_THREADS, deadline: float | None = None) -> None:
    """Run each ``(call, tiles)`` of ``jobs`` once, ``call(tiles, 0)``, from ``threads`` threads, so that Triton
    compiles the candidates side by side: a compile spends most of its time outside the GIL, in MLIR passes and
    ptxas. Outputs are
    dropped and errors ignored: the check that follows runs every candidate again and records its error.
    CUDA only, with 2 threads or more: the interpreter patches ``triton.language`` while a kernel runs, so on
    CPU kernels run one at a time (and there is nothing to compile). Jobs not started by ``deadline``
    (time.monotonic) are skipped: past it the slice times its defaults only.
    """
    if device.type != "cuda" or threads < 2 or len(jobs) < 2:
        return

    def run(job):
        if deadline is not None and time.monotonic() > deadline:
            return
        call, tiles = job
        with contextlib.suppress(Exception):
            call(tiles, 0)

    pool = ThreadPoolExecutor(min(threads, len(jobs)))
    try:
        list(pool.map(run, jobs))
    finally:  # interrupted (SIGINT): drop the queued compiles, wait only for the running ones
        pool.shutdown(wait=True, cancel_futures=True)


def _tune_slice(kind, m, shapes, ops, device, quick, deadline, errors, threads) -> tuple[dict, dict, int]:
    """Check and time each candidate of ``kind`` at ``m`` rows on every projection of ``shapes`` (name -> [N, K]),
    the defaults first; past ``deadline`` (time.monotonic) only the defaults. Appends failures to ``errors``.
    Every candidate is compiled first, ``threads`` at a time (:func:`precompile`).

    Returns (name -> [(us, tiles)], name -> default tiles, timings skipped over the deadline).
    """
    runs = {}
    for name in shapes:
        call, expected = _gemm(kind, ops[name])
        # kind "w8a8" serves per-tensor weights too (scale strides 0): checked in that layout as well
        checks = [(call, expected)] + ([_gemm(kind, ops[name], "tensor")] if kind == "w8a8" else [])
        runs[name] = call, checks, len(ops[name]["block" if "block" in kind else "channel"])
    defaults = {name: launch_tiles(kind, m, n, k, device) for name, (n, k) in shapes.items()}
    todo = list(dict.fromkeys([*defaults.values(), *candidates(kind, m, device, quick)]))
    first = runs[next(iter(shapes))][1]  # the projections share the compiled kernels: one shape's calls compile all
    # compiles get half the slice's time at most: the timings that follow need the rest (past the deadline a
    # candidate is not timed, compiled or not)
    now = time.monotonic()
    compile_deadline = None if deadline is None else now + max(0.0, deadline - now) / 2
    precompile([(call, tiles) for tiles in todo for call, _ in first], device, threads, compile_deadline)
    timed: dict = {name: [] for name in shapes}
    skipped = 0
    for tiles in todo:
        over = deadline is not None and time.monotonic() > deadline  # per candidate: all shapes or none
        for name in shapes:
            if over and tiles != defaults[name]:
                skipped += 1
                continue
            call, checks, copies = runs[name]
            try:
                for checked, reference_output in checks:
                    check(checked, reference_output, tiles)
                timed_call = cycling(lambda i, c=call, t=tiles: c(t, i), copies)
                timed[name].append((1e6 * graph_seconds(timed_call, device), tiles))
            except Exception as e:  # recorded, never chosen
                errors.append({"kind": kind, "shape": name, "m": m, "tiles": list(tiles), "error": _error(e)})
    return timed, defaults, skipped


def best_configs(result: dict) -> dict:
    """kind -> "N,K" -> {M: tiles fields or None} of a :func:`tune` result (the layout ``write_configs`` takes).

    Kind "w8a8" keeps its tiles only where its best beat both ``torch._scaled_mm`` references (per tensor, per
    row), each timed with the activation quantization it needs; elsewhere its row is None, so that the forward
    keeps calling ``_scaled_mm`` at that M instead of taking the tiles of a larger M (``gemm_configs.lookup``).
    Per-tensor weights run the tiles timed on per-channel weights with per-token x (the same kernel; a per-tensor
    x scale adds a max over the program's rows); they were checked in both layouts.
    """
    refs = {(r["shape"], r["m"]): r["us"] for r in result["references"]}
    out: dict = {}
    for row in result["best"]:
        tiles = row["tiles"]
        if row["kind"] == "w8a8":
            scaled_mm = [refs[(row["shape"], row["m"])].get(name) for name in SCALED_MM]
            if not all(isinstance(us, float) and row["us"] < us for us in scaled_mm):
                tiles = None
        out.setdefault(row["kind"], {}).setdefault(f"{row['n']},{row['k']}", {})[row["m"]] = tiles
    return out


def table(result: dict) -> str:
    """Plain-text table: per shape and M, BF16 and (per-tensor activation quantization + _scaled_mm) against each
    kind's best and default (us)."""
    refs = {(r["shape"], r["m"]): r["us"] for r in result["references"]}
    lines = [f"{'shape':<14}{'M':>4}{'kind':>13}{'best us':>10}{'default':>10}{'bf16':>9}{'q+smm':>11}  tiles"]
    for row in result["best"]:
        ref = refs[(row["shape"], row["m"])]
        scaled = ref.get(SCALED_MM[0])  # the activation quantization and _scaled_mm, per tensor

        def num(v):
            return f"{v:.1f}" if isinstance(v, float) else "-"

        lines.append(
            f"{row['shape']:<14}{row['m']:>4}{row['kind']:>13}{row['us']:>10.1f}{num(row['default_us']):>10}"
            f"{num(ref.get('bf16 F.linear')):>9}{num(scaled):>11}  {tuple(row['tiles'])}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    """Parse ``argv``, tune, write DIR/NAME.json (and the configuration file with --write-configs), print
    the table."""
    parser = benchmark_parser(
        "python -m layerwise.benchmarks.gemm_tune", __doc__, size_help="model shapes (default: 8b)"
    )
    parser.set_defaults(size="8b")
    parser.add_argument(
        "--m", default=",".join(map(str, DEFAULT_M)), metavar="M1,M2,...", help="rows of x (default: %(default)s)"
    )
    parser.add_argument(
        "--kinds", default=",".join(KINDS), metavar="K1,...", help=f"GEMM kinds (default: {','.join(KINDS)})"
    )
    parser.add_argument("--quick", action="store_true", help="a subset of the candidates")
    parser.add_argument("--budget", type=float, default=None, metavar="S", help="seconds of candidates, then defaults")
    parser.add_argument(
        "--compile-threads", type=int, default=COMPILE_THREADS, metavar="N",
        help="threads compiling a slice's candidates before its timings (default: %(default)s; 1: none)",
    )  # fmt: skip
    parser.add_argument(
        "--write-configs", action="store_true", help="write kernels/configs/<device>.json from the best"
    )
    add_output_arguments(parser, default_name="gemm_tune_<device>_<size>", checkpoint=False)
    args = parser.parse_args(argv)
    ms = tuple(sorted({int(v) for v in args.m.split(",")}))
    kinds = tuple(args.kinds.split(","))
    if unknown := set(kinds) - set(KINDS):
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {','.join(KINDS)}")
    if args.write_configs and torch.device(args.device).type != "cuda":
        parser.error("--write-configs needs --device cuda (interpreted times are not measurements)")
    name = args.name or f"gemm_tune_{args.device}_{args.size}"

    def save(result: dict) -> Path:  # after every slice too: a run cut off keeps what it measured
        path = write_json(result, args.out_dir, name)
        if args.write_configs:
            keep = ("commit", "versions", "date", "size")
            target = config_path(result["device_name"])
            write_configs(target, result["device_name"], best_configs(result), {f: result[f] for f in keep})
        return path

    result = tune(args.size, args.device, ms, kinds, args.quick, args.budget, args.compile_threads, save)
    path = save(result)
    print(table(result))
    print(f"written to {path}")
    if args.write_configs:
        print(f"configurations written to {config_path(result['device_name'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
