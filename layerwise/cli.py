"""Command line: ``layerwise load PATH``, ``layerwise demo``, ``layerwise reload [PATH_A PATH_B]``."""

from __future__ import annotations

import argparse
import json
import sys

from layerwise.loader import LoadReport, load_model_with_report
from layerwise.quant.config import check_quantization


def _quantization(name: str) -> str:
    try:
        return check_quantization(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _mib(n: int) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_report(report: LoadReport) -> str:
    """A two-column summary table of a load."""
    rows = [
        ("architecture", report.architecture),
        ("decoder layers", str(report.num_layers)),
        ("device", report.device),
        ("quantization", f"{report.quantization} (kernel: {report.kernel}, dtype: {report.dtype})"),
        ("checkpoint", _mib(report.checkpoint_bytes)),
        ("largest layer (checkpoint)", _mib(report.largest_layer_checkpoint_bytes)),
        ("model on device", _mib(report.model_bytes)),
        ("peak on device", f"{_mib(report.peak_bytes)}  [{report.memory_tracker}]"),
        ("peak - model", f"{_mib(report.peak_bytes - report.model_bytes)} = "
                         f"{report.overhead_per_layer:.2f} x largest layer"),
        ("peak anonymous RSS (OS)", _mib(report.peak_rss_anon_bytes)),
        ("load time", f"{report.seconds:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _load(args) -> int:
    _, report = load_model_with_report(args.path, args.quantization, args.device, args.dtype, args.kernel,
                                       args.fp8_mode, progress=True)
    print(format_report(report))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
        print(f"report written to {args.report}")
    return 0


def _demo(args) -> int:
    from layerwise.demo import demo_checkpoint, greedy_tokens

    path = demo_checkpoint(args.cache_dir)
    print(f"demo checkpoint (random BF16 Qwen3, generated locally): {path}")
    model, report = load_model_with_report(path, "fp8", args.device, progress=True)
    print(format_report(report))
    prompt = [1, 17, 42, 7]
    tokens = greedy_tokens(model, prompt, args.tokens)
    print(f"greedy tokens after prompt {prompt}: {tokens}")
    return 0


def _reload(args) -> int:
    from layerwise.demo import demo_checkpoint
    from layerwise.engine import Engine

    if (args.path_a is None) != (args.path_b is None):
        print("give both PATH_A and PATH_B, or neither (demo checkpoints)", file=sys.stderr)
        return 2
    path_a = args.path_a or demo_checkpoint(args.cache_dir, seed=0)
    path_b = args.path_b or demo_checkpoint(args.cache_dir, seed=1)
    prompts = [[1, 17, 42, 7], [5, 3]]
    engine = Engine.from_pretrained(path_a, max_batch_size=len(prompts), max_seq_len=64, quantization=args.quantization,
                                    device=args.device)
    tokens_a = engine.generate(prompts, args.tokens)
    tensors = list(engine.model.named_parameters()) + list(engine.model.named_buffers())
    addresses = {name: (t, t.data_ptr()) for name, t in tensors}
    report = engine.reload_weights(path_b)
    tokens_after = engine.generate(prompts, args.tokens)
    fresh = Engine.from_pretrained(path_b, max_batch_size=len(prompts), max_seq_len=64, quantization=args.quantization,
                                   device=args.device)
    tokens_b = fresh.generate(prompts, args.tokens)
    now = dict(list(engine.model.named_parameters()) + list(engine.model.named_buffers()))
    kept = sum(now[n] is t and now[n].data_ptr() == ptr for n, (t, ptr) in addresses.items())
    print(f"A: {path_a}\nB: {path_b}")
    print(f"generated on A:            {tokens_a}")
    print(f"after reloading B:         {tokens_after}")
    print(f"fresh engine on B:         {tokens_b}")
    print(f"outputs follow B:          {tokens_after == tokens_b}")
    print(f"tensors kept in place:     {kept}/{len(addresses)} (same object, same data_ptr)")
    print(f"layers updated:            {len(report.updated_layers)} in {report.seconds:.3f} s")
    if engine.use_cuda_graph:
        print(f"CUDA graph captures:       {engine.captures}")
    return 0 if tokens_after == tokens_b and kept == len(addresses) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="layerwise", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="load a checkpoint directory and print a memory/time summary")
    load.add_argument("path", help="directory with config.json and *.safetensors")
    load.add_argument("--quantization", default="fp8", type=_quantization, metavar="SCHEME",
                      help="fp8 | fp8-per-tensor | fp8-per-channel | fp8-per-block | torchao:<Config> | none")
    load.add_argument("--device", default="cpu")
    load.add_argument("--dtype", default=None, help="bfloat16 | float16 | float32 (default: config.json)")
    load.add_argument("--kernel", default=None, choices=["torch", "triton"])
    load.add_argument("--fp8-mode", default="auto", choices=["auto", "w8a8", "w8a16"])
    load.add_argument("--report", default=None, metavar="FILE.json", help="write the summary as JSON")
    load.set_defaults(func=_load)
    demo = sub.add_parser("demo", help="generate a small BF16 Qwen3 checkpoint, load it as FP8, generate")
    demo.add_argument("--device", default="cpu")
    demo.add_argument("--cache-dir", default=None)
    demo.add_argument("--tokens", type=int, default=8)
    demo.set_defaults(func=_demo)
    reload = sub.add_parser("reload", help="load A, generate, hot-reload B in place, generate, compare with B")
    reload.add_argument("path_a", nargs="?", default=None, help="default: the demo checkpoint")
    reload.add_argument("path_b", nargs="?", default=None, help="default: the demo checkpoint with seed 1")
    reload.add_argument("--quantization", default="fp8", type=_quantization, metavar="SCHEME")
    reload.add_argument("--device", default="cpu")
    reload.add_argument("--cache-dir", default=None)
    reload.add_argument("--tokens", type=int, default=8)
    reload.set_defaults(func=_reload)
    sub.add_parser("bench", help="peak-memory and load-time benchmark (see benchmarks/peak_memory.py)",
                   add_help=False)
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # the benchmark owns its arguments
        from layerwise.benchmarks.peak_memory import main as bench_main

        return bench_main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
