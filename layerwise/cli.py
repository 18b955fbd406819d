"""Command line: ``layerwise load PATH``, ``layerwise generate PATH``, ``layerwise demo``,
``layerwise reload [PATH_A PATH_B]``, ``layerwise sync-demo [PATH]``, ``layerwise mismatch [PATH]``,
``layerwise bench``.

Expected errors (a bad path or option, a bad checkpoint, a missing optional package, no GPU) print
one or two lines on stderr naming the file, tensor key or option and what to do, and exit with 2
(usage: checked before anything is loaded) or 1 (the load or reload failed). ``--debug`` shows the
traceback instead.

``layerwise --help`` and ``layerwise --version`` import no torch: this module imports the load path (and so torch)
only inside the commands, and a command's options are added to the parser only when that command runs (their
choices come from modules that import torch).

Logging: the CLI's handler prints the ``layerwise`` loggers' records as ``layerwise: ...``; other libraries'
records (torchao, transformers, matplotlib) print only from WARNING up, under their own logger's name, so that
they never read as ours (``--debug``: theirs from INFO up, ours from DEBUG up).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from layerwise.errors import DeviceError, LayerwiseError, MissingDependencyError

if TYPE_CHECKING:
    from layerwise.api import LoadReport

EXIT_FAILED = 1
EXIT_USAGE = 2
DEVICE_HELP = "cpu (default), cuda or cuda:N"
CACHE_DIR_HELP = "where the demo checkpoints are written (default: $LAYERWISE_CACHE or ~/.cache/layerwise)"
TOKENS_HELP = "tokens to generate per prompt (default: 8)"


class UsageError(Exception):
    """A command-line option that cannot work, found before loading (exit code 2)."""


def load_model_with_report(*args, **kwargs):
    """:func:`layerwise.api.load_model_with_report`, imported at the first load (the import brings torch)."""
    from layerwise.api import load_model_with_report as load

    return load(*args, **kwargs)


def _scheme(text: str) -> str:
    """argparse type of --quantization: the canonical scheme name, except "fp8", kept as given: on a pre-quantized
    FP8 checkpoint it means the checkpoint's own layout (``layerwise.quant.checkpoint_fp8.resolve_scheme``)."""
    from layerwise.quant.config import parse_scheme

    try:
        name, argument = parse_scheme(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if text.strip().lower() == "fp8":
        return "fp8"
    return f"{name}:{argument}" if argument else name


def _add_quantization(parser: argparse.ArgumentParser) -> None:
    """The --quantization option of the commands that load a model (load, generate, reload)."""
    from layerwise.quant.config import scheme_names

    parser.add_argument(
        "--quantization",
        default="fp8",
        type=_scheme,
        metavar="SCHEME",
        help=f"{' | '.join(scheme_names())} (case-insensitive; default fp8)",
    )


def dtype_argument(text: str) -> str:
    """argparse type of a --dtype option: the name if layerwise accepts it (layerwise.dtypes), else an argparse
    error listing the names."""
    from layerwise.dtypes import parse_dtype

    try:
        parse_dtype(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return text


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
        (
            "peak - model",
            f"{_mib(report.peak_bytes - report.model_bytes)} = {report.overhead_per_layer:.2f} x largest layer",
        ),
        ("peak anonymous RSS (OS)", _mib(report.peak_rss_anon_bytes)),
        ("load time", f"{report.seconds:.2f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


# ---- checks that need no loading (exit 2) ----


def _checkpoint_dir(path: str, option: str) -> str:
    """The checkpoint directory ``path`` names: a directory, or a file inside one (config.json,
    a shard), whose directory is then used."""
    from layerwise.checkpoint import CONFIG_NAME, missing_directory_reason

    p = Path(path)
    if p.is_dir():
        return str(p)
    if p.is_file():
        if (p.parent / CONFIG_NAME).is_file():
            print(f"layerwise: {option} {path} is a file; using its checkpoint directory {p.parent}", file=sys.stderr)
            return str(p.parent)
        raise UsageError(
            f"{option} {path} is a file, not a checkpoint directory (one with config.json and *.safetensors)"
        )
    raise UsageError(f"{option} {path}: {missing_directory_reason(path)}")


def _device(text: str) -> None:
    """Check ``--device`` before anything is loaded (:func:`layerwise.api.resolve_device`, as the API does)."""
    from layerwise.api import resolve_device

    try:
        resolve_device(text)
    except DeviceError as e:
        raise UsageError(f"--device {text}: {e.reason}") from e


def _report_file(path: str | None, option: str = "--report") -> None:
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {path} is a directory; give a file name such as {p / 'report.json'}")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path}: directory {parent} is not writable")


def _kernel(kernel: str | None) -> None:
    if kernel == "triton":
        from layerwise.kernels import resolve_kernel

        try:
            resolve_kernel(kernel, "cpu")
        except MissingDependencyError as e:
            raise UsageError(f"--kernel triton: {e}; or use --kernel torch") from e


# ---- commands ----


def _load(args) -> int:
    path = _checkpoint_dir(args.path, "PATH")
    _device(args.device)
    _report_file(args.report)
    _kernel(args.kernel)
    _, report = load_model_with_report(
        path, args.quantization, args.device, args.dtype, args.kernel, args.fp8_mode, progress=True
    )
    print(format_report(report))
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report.to_dict(), f, indent=2)
        print(f"report written to {args.report}")
    return 0


def _demo(args) -> int:
    from layerwise.demo import PROMPT, PROMPT_TEXT, demo_checkpoint
    from layerwise.engine import Engine
    from layerwise.sampling_params import SamplingParams
    from layerwise.tokenizer import eos_token_ids, load_tokenizer

    if args.tokens < 1:
        raise UsageError(f"--tokens {args.tokens}: give at least 1")
    _device(args.device)
    path = demo_checkpoint(args.cache_dir)
    print(f"demo checkpoint (random BF16 Qwen3, generated locally): {path}")
    model, report = load_model_with_report(path, "fp8", args.device, progress=True)
    print(format_report(report))
    try:
        tokenizer = load_tokenizer(path)
    except MissingDependencyError:
        tokenizer = None
    engine = Engine(model, 1, 32 + args.tokens, tokenizer=tokenizer, eos_token_ids=eos_token_ids(path))
    tokens = _greedy(engine, [PROMPT], args.tokens)[0]
    print(f"greedy tokens after prompt {PROMPT}: {tokens}")
    if tokenizer is None:
        print("sampled text: skipped, transformers is not installed (pip install 'layerwise[text]')")
        return 0
    (output,) = engine.generate(PROMPT_TEXT, SamplingParams(max_tokens=args.tokens, seed=0))
    print(f"sampled text after {PROMPT_TEXT!r} (seed 0): {output.outputs[0].text!r}")
    print(
        f"  (random weights, so the text is noise; the tokenizer knows {len(tokenizer)} of the "
        f"{model.config.vocab_size} ids, the others print nothing)"
    )
    return 0


def _greedy(engine, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """``tokens`` greedy tokens after each prompt, EOS ignored (the demos compare fixed-length outputs)."""
    from layerwise.sampling_params import SamplingParams

    outputs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    return [output.outputs[0].token_ids for output in outputs]


def _generate(args) -> int:
    """``layerwise generate``: complete the prompts; one prompt streams, several show a progress bar."""
    path = _checkpoint_dir(args.path, "PATH")
    _device(args.device)
    prompts = _prompts(args)
    params = _sampling_params(args)
    _engine_sizes(args)
    tokenizer = _generate_tokenizer(path, prompts, args.chat)
    if args.chat:
        prompts = [_chat_prompt(tokenizer, text) for text in prompts]
    from layerwise.engine import Engine

    max_batch_size = args.max_batch_size or max(args.n, min(8, len(prompts) * args.n))
    engine = Engine.from_pretrained(
        path,
        max_batch_size=max_batch_size,
        max_seq_len=args.max_seq_len,
        tokenizer=tokenizer if tokenizer is not None else False,
        quantization=args.quantization,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    if len(prompts) == 1 and args.n == 1:
        return _stream_one(engine, prompts[0], params)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    for output in outputs:
        for completion in output.outputs:
            label = f"prompt {output.request_id}" + (f", completion {completion.index}" if args.n > 1 else "")
            shown = output.prompt if output.prompt is not None else output.prompt_token_ids
            finish = _finish(completion, engine.eos_token_ids)
            print(f"=== {label}: {shown!r} ({finish}, {len(completion.token_ids)} tokens)")
            print(completion.text if engine.tokenizer is not None else completion.token_ids)
            _print_logprobs(completion, params.logprobs)
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"{len(outputs)} prompts, {tokens} tokens in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s")
    return 0


def _engine_sizes(args) -> None:
    """--max-batch-size, --max-seq-len and --n checked before loading (the Engine would refuse them after)."""
    if args.max_batch_size is not None and args.max_batch_size < 1:
        raise UsageError(f"--max-batch-size {args.max_batch_size}: give at least 1")
    if args.max_seq_len < 2:
        raise UsageError(f"--max-seq-len {args.max_seq_len}: give at least 2 (a prompt token and a generated one)")
    if args.max_batch_size is not None and args.n > args.max_batch_size:
        raise UsageError(f"--n {args.n} completions do not fit --max-batch-size {args.max_batch_size}")


def _prompts(args) -> list:
    """The prompts in command-line order (text or token ids), then those of --prompt-file."""
    prompts = list(args.prompts or [])
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompts += [line.rstrip("\r\n") for line in f if line.strip()]
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: {getattr(e, 'strerror', None) or e}") from e
    if not prompts:
        raise UsageError("give a prompt: --prompt TEXT, --prompt-ids '1 17 42' or --prompt-file FILE (one per line)")
    if args.chat and not all(isinstance(p, str) for p in prompts):
        raise UsageError("--chat renders text prompts with the chat template; --prompt-ids are tokens already")
    return prompts


def _sampling_params(args):
    """SamplingParams from the options, checked before loading: a bad value names its option (exit 2)."""
    from layerwise.sampling_params import SamplingParams

    options = {
        "n": args.n,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "max_tokens": args.max_tokens,
        "logprobs": args.logprobs,
    }
    try:
        return SamplingParams(**options)
    except ValueError as e:
        field = next((name for name in options if str(e).startswith(name + " ")), None)
        option = f"--{field.replace('_', '-')} {options[field]}: " if field else ""
        raise UsageError(f"{option}{e}") from e


def _generate_tokenizer(path: str, prompts: list, chat: bool):
    """The checkpoint's tokenizer, or None (token ids in and out); loaded before the model so that a text prompt
    PATH cannot read fails first (exit 2, or 1 for a missing transformers)."""
    from layerwise.tokenizer import has_tokenizer, load_tokenizer

    text = any(isinstance(p, str) for p in prompts)
    if not has_tokenizer(path):
        if text:
            raise UsageError(
                f"{path} has no tokenizer (no tokenizer.json or tokenizer_config.json): give token ids, "
                "--prompt-ids '1 17 42', instead of text prompts"
            )
        return None
    try:
        tokenizer = load_tokenizer(path)
    except MissingDependencyError:
        if text:
            raise
        print("layerwise: transformers is not installed: the completions are printed as token ids", file=sys.stderr)
        return None
    if chat and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"--chat: the tokenizer of {path} has no chat template; leave --chat out")
    return tokenizer


def _chat_prompt(tokenizer, text: str) -> dict:
    """One user message rendered by the chat template, with the assistant turn opened."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )
    return {"prompt": rendered, "add_special_tokens": False}  # the template wrote the special tokens


def _stream_one(engine, prompt, params) -> int:
    """Print the completion as it is generated, then a line with its finish reason, length and speed."""
    start = time.perf_counter()
    printed, shown_ids, output = "", 0, None
    for output in engine.stream(prompt, params):
        completion = output.outputs[0]
        if engine.tokenizer is None:  # token ids, as they come
            piece = "".join(f"{t} " for t in completion.token_ids[shown_ids:])
            shown_ids = len(completion.token_ids)
        else:  # an unfinished multi-byte character decodes as U+FFFD: wait for its other bytes
            text = completion.text if output.finished else completion.text.rstrip("\ufffd")
            piece = text[len(printed) :] if text.startswith(printed) else ""
            printed += piece
        sys.stdout.write(piece)
        sys.stdout.flush()
    seconds = time.perf_counter() - start
    completion = output.outputs[0]
    if engine.tokenizer is not None and completion.text != printed:  # the text changed behind what was printed
        print(f"\n(the whole completion: {completion.text!r})", end="")
    n = len(completion.token_ids)
    finish = _finish(completion, engine.eos_token_ids)
    print(f"\n[{finish}, {n} tokens in {seconds:.2f} s: {n / seconds:.1f} tokens/s]")
    _print_logprobs(completion, params.logprobs)
    return 0


def _finish(completion, eos_token_ids) -> str:
    """The finish reason in words: 'length', 'stop (EOS 603)' (one of the engine's ``eos_token_ids``, which vLLM
    reports with stop_reason None for the tokenizer's and with the id for the checkpoint's others) or
    'stop (stop id 5)'."""
    if completion.finish_reason != "stop":
        return str(completion.finish_reason)
    last = completion.token_ids[-1]  # the stop or EOS id is kept in token_ids
    if completion.stop_reason is None or last in eos_token_ids:
        return f"stop (EOS {last})"
    return f"stop (stop id {completion.stop_reason})"


def _print_logprobs(completion, k: int | None) -> None:
    """Per generated token (--logprobs K): its id, text, log-probability and rank, then the K most likely tokens."""
    if completion.logprobs is None or k is None:
        return
    print(f"logprobs (raw model distribution): position, token, logprob, rank | the {k} most likely")
    for position, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        sampled = entries[token]
        top = sorted((lp.rank, t, lp) for t, lp in entries.items() if lp.rank is not None and lp.rank <= k)
        listed = ", ".join(f"{_token_label(t, lp)} {lp.logprob:.3f}" for _, t, lp in top)
        label = _token_label(token, sampled)
        print(f"  {position:>4}  {label:<24} {sampled.logprob:8.3f}  rank {sampled.rank} | {listed}")


def _token_label(token: int, logprob) -> str:
    """``17`` without a tokenizer, ``17 ' the'`` with one."""
    return str(token) if logprob.decoded_token is None else f"{token} {logprob.decoded_token!r}"


def _reload(args) -> int:
    from layerwise.demo import PROMPT, demo_checkpoint
    from layerwise.engine import Engine
    from layerwise.reload.kernel_format import named_kernel_tensors

    if (args.path_a is None) != (args.path_b is None):
        raise UsageError("give both PATH_A and PATH_B, or neither (two demo checkpoints are generated)")
    _device(args.device)
    path_a = _checkpoint_dir(args.path_a, "PATH_A") if args.path_a else demo_checkpoint(args.cache_dir, seed=0)
    path_b = _checkpoint_dir(args.path_b, "PATH_B") if args.path_b else demo_checkpoint(args.cache_dir, seed=1)
    prompts = [PROMPT, [5, 3]]

    def engine_of(path):
        return Engine.from_pretrained(
            path,
            max_batch_size=len(prompts),
            max_seq_len=64,
            tokenizer=False,
            quantization=args.quantization,
            device=args.device,
        )

    engine = engine_of(path_a)
    tokens_a = _greedy(engine, prompts, args.tokens)
    addresses = {name: (t, t.data_ptr()) for name, t in named_kernel_tensors(engine.model).items()}
    report = engine.reload_weights(path_b)
    tokens_after = _greedy(engine, prompts, args.tokens)
    tokens_b = _greedy(engine_of(path_b), prompts, args.tokens)
    now = named_kernel_tensors(engine.model)
    kept = sum(now[n] is t and now[n].data_ptr() == ptr for n, (t, ptr) in addresses.items())
    print(f"A: {path_a}\nB: {path_b}")
    print(f"generated on A:            {tokens_a}")
    print(f"after reloading B:         {tokens_after}")
    print(f"fresh engine on B:         {tokens_b}")
    print(f"outputs follow B:          {tokens_after == tokens_b}")
    print(f"tensors kept in place:     {kept}/{len(addresses)} (same object, same data_ptr)")
    print(
        f"updated:                   {len(report.updated_decoder_layers)} decoder layers, "
        f"{len(report.updated_modules)} modules in {report.seconds:.3f} s"
    )
    if engine.use_cuda_graph:
        print(f"CUDA graph captures:       {engine.captures}")
    return 0 if tokens_after == tokens_b and kept == len(addresses) else EXIT_FAILED


def _sync_demo(args) -> int:
    from layerwise.sync_demo import FAULT_ENV, format_sync_demo, run_sync_demo, sync_demo_ok

    if args.tokens < 1:
        raise UsageError(f"--tokens {args.tokens}: give at least 1")
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    path = _checkpoint_dir(args.path, "PATH") if args.path else None
    print("trainer (transformers, BF16 sent) -> FP8 engine, backend nccl (gloo on CPU), 127.0.0.1", flush=True)
    result = run_sync_demo(
        args.cache_dir, args.tokens, args.timeout, checkpoint=path, fault=os.environ.get(FAULT_ENV) or None
    )
    print(format_sync_demo(result))
    return 0 if sync_demo_ok(result) else EXIT_FAILED


def _mismatch(args) -> int:
    """``layerwise mismatch``: rollouts of each scheme and KV cache dtype scored by the BF16 reference
    (layerwise/benchmarks/mismatch.py); prints the table, writes --json."""
    from layerwise import optional
    from layerwise.benchmarks import mismatch

    path = _checkpoint_dir(args.path, "PATH") if args.path else str(mismatch.default_checkpoint(args.cache_dir))
    _device(args.device)
    _report_file(args.json, "--json")
    if args.reference == "transformers":
        optional.require(["transformers"], extra="bench", purpose="--reference transformers")
    result = mismatch.run_from_args(args, path, log=lambda line: print(line.strip(), flush=True))
    print(mismatch.describe(result))
    print(mismatch.table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"results written to {args.json}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors in two lines (the error, then where to read the usage), exit 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n{self.prog}: see '{self.prog} --help'\n")


def _load_options(load: argparse.ArgumentParser) -> None:
    from layerwise.kernels import KERNELS
    from layerwise.quant.fp8 import FP8_MODES

    load.add_argument("path", help="directory with config.json and *.safetensors")
    _add_quantization(load)
    load.add_argument("--device", default="cpu", help=DEVICE_HELP)
    load.add_argument(
        "--dtype", default=None, type=dtype_argument, help="bfloat16 | float16 | float32 (default: config.json)"
    )
    load.add_argument(
        "--kernel",
        default=None,
        choices=KERNELS,
        help="FP8 quantization kernels (default: triton on cuda, torch on cpu)",
    )
    load.add_argument(
        "--fp8-mode",
        default="auto",
        choices=FP8_MODES,
        help="forward of FP8 layers: auto (W8A8 on CUDA sm89+, W8A16 elsewhere; default), w8a8 (FP8 activations "
        "too) or w8a16 (dequantize, then matmul)",
    )
    load.add_argument("--report", default=None, metavar="FILE.json", help="write the summary as JSON")


def _token_ids(text: str) -> list[int]:
    """``--prompt-ids '1 17 42'`` (or ``1,17,42``) -> [1, 17, 42]."""
    try:
        ids = [int(part) for part in text.replace(",", " ").split()]
    except ValueError:
        ids = None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"{text!r}: give token ids, integers >= 0 separated by spaces, e.g. '1 17 42'")
    return ids


def _generate_options(gen: argparse.ArgumentParser) -> None:

    gen.add_argument("path", help="checkpoint directory (text prompts need its tokenizer files)")
    gen.add_argument(
        "--prompt", dest="prompts", action="append", metavar="TEXT", help="a text prompt; repeat it for several"
    )
    gen.add_argument(
        "--prompt-ids",
        dest="prompts",
        action="append",
        type=_token_ids,
        metavar="IDS",
        help="a prompt of token ids, e.g. '1 17 42' (any checkpoint, with or without a tokenizer); repeatable",
    )
    gen.add_argument("--prompt-file", default=None, metavar="FILE", help="text prompts, one per line")
    gen.add_argument(
        "--chat", action="store_true", help="send each text prompt as a user message through the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens per completion (default 64)")
    gen.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1.0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, in (0, 1] (default 1: off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (default 0: off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the most likely's (default 0)")
    gen.add_argument("--seed", type=int, default=None, help="sample reproducibly (default: unseeded)")
    gen.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    gen.add_argument(
        "--logprobs", type=int, default=None, metavar="K", help="print each token's logprob and the K most likely"
    )
    _add_quantization(gen)
    gen.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8"],
        default="auto",
        help="KV cache: auto (the model's dtype) or fp8 (e4m3, per-layer scales calibrated at load; half the bytes)",
    )
    gen.add_argument("--device", default="cpu", help=DEVICE_HELP)
    gen.add_argument(
        "--max-batch-size", type=int, default=None, help="KV cache slots (default: every completion, at most 8)"
    )
    gen.add_argument(
        "--max-seq-len", type=int, default=256, help="most tokens per sequence, prompt included (default 256)"
    )


def _demo_options(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--device", default="cpu", help=DEVICE_HELP)
    demo.add_argument("--cache-dir", default=None, help=CACHE_DIR_HELP)
    demo.add_argument("--tokens", type=int, default=8, help=TOKENS_HELP)


def _reload_options(reload: argparse.ArgumentParser) -> None:

    reload.add_argument("path_a", nargs="?", default=None, help="default: the demo checkpoint")
    reload.add_argument("path_b", nargs="?", default=None, help="default: the demo checkpoint with seed 1")
    _add_quantization(reload)
    reload.add_argument("--device", default="cpu", help=DEVICE_HELP)
    reload.add_argument("--cache-dir", default=None, help=CACHE_DIR_HELP)
    reload.add_argument("--tokens", type=int, default=8, help=TOKENS_HELP)


def _sync_demo_options(sync: argparse.ArgumentParser) -> None:
    from layerwise.sync_demo import DEFAULT_TIMEOUT_SECONDS

    sync.add_argument("path", nargs="?", default=None, help="default: the demo checkpoint")
    sync.add_argument("--cache-dir", default=None, help=CACHE_DIR_HELP)
    sync.add_argument("--tokens", type=int, default=8, help=TOKENS_HELP)
    sync.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help=f"bound on every wait (default {DEFAULT_TIMEOUT_SECONDS:g})",
    )


def _mismatch_options(parser: argparse.ArgumentParser) -> None:
    from layerwise.benchmarks.mismatch import add_arguments

    add_arguments(parser)
    parser.add_argument("--json", default=None, metavar="FILE.json", help="write the results as JSON")


#: command -> (one line for ``layerwise --help``, the function adding its options, the function running it)
COMMANDS = {
    "load": ("load a checkpoint directory and print a memory/time summary", _load_options, _load),
    "generate": (
        "complete text or token-id prompts with sampling (one prompt streams as it is generated)",
        _generate_options,
        _generate,
    ),
    "demo": ("generate a small BF16 Qwen3 checkpoint, load it as FP8, generate", _demo_options, _demo),
    "reload": ("load A, generate, hot-reload B in place, generate, compare with B", _reload_options, _reload),
    "sync-demo": (
        "a trainer process takes one optimizer step and sends its weights into a live FP8 engine",
        _sync_demo_options,
        _sync_demo,
    ),
    "mismatch": (
        "score FP8 rollouts with the BF16 model: KL, importance ratios, top-1 agreement, perplexity per scheme",
        _mismatch_options,
        _mismatch,
    ),
}


def build_parser(options_of: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The ``layerwise`` argument parser: commands load, generate, demo, reload, sync-demo, mismatch and bench.

    Args:
        options_of: the commands whose options are added (default: every command's). :func:`main` adds only the
            command it runs: the options' choices (schemes, kernels) come from modules that import torch, and
            ``layerwise --help`` lists the commands alone.
    """
    parser = _Parser(prog="layerwise", description=__doc__.split("\n\n")[0].replace("``", ""))
    from layerwise import __version__  # the package's one version (pyproject reads it); imports no torch

    parser.add_argument("--version", action="version", version=f"layerwise {__version__}", help="print the version")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", help="see 'layerwise COMMAND --help' for its options"
    )
    for name, (summary, add_options, run) in COMMANDS.items():
        command = sub.add_parser(name, help=summary, description=summary)
        if options_of is None or name in options_of:
            add_options(command)
        command.set_defaults(func=run)
    sub.add_parser("bench", help="peak-memory and load-time benchmark (layerwise bench --help)", add_help=False)
    return parser


def _fail(message: str, code: int) -> int:
    print(f"layerwise: error: {message}", file=sys.stderr)
    if code == EXIT_FAILED:
        print("layerwise: run with --debug for the full traceback", file=sys.stderr)
    return code


class _StderrHandler(logging.StreamHandler):
    """A handler writing to ``sys.stderr`` as it is when a record is emitted (not when the handler was made: the
    CLI may run in a process whose stderr is swapped later, as pytest's capture does)."""

    saved: tuple[int, bool, int]  # the levels and propagation the first setup_logging call found

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def setup_logging(debug: bool = False) -> Callable[[], None]:
    """Print the ``layerwise`` loggers' records as ``layerwise: message`` (INFO up; DEBUG up with ``debug``), and
    other libraries' records under their own logger's name, WARNING up (INFO up with ``debug``). Calling it again
    replaces what an earlier call installed. Returns the function that removes the handlers and restores the levels
    and propagation it changed (``main`` calls it on its way out, so an in-process call leaves logging as it was)."""
    ours, root = logging.getLogger("layerwise"), logging.getLogger()
    earlier = [h for h in ours.handlers if isinstance(h, _StderrHandler)]
    # the levels before the first call: an earlier call's handler keeps them
    saved = earlier[0].saved if earlier else (ours.level, ours.propagate, root.level)
    for logger in (ours, root):
        for handler in [h for h in logger.handlers if isinstance(h, _StderrHandler)]:
            logger.removeHandler(handler)
    handler = _StderrHandler()
    handler.saved = saved
    handler.setFormatter(logging.Formatter("layerwise: %(message)s"))
    ours.addHandler(handler)
    ours.setLevel(logging.DEBUG if debug else logging.INFO)
    ours.propagate = False  # printed once, by our handler, not again by a handler the host put on the root
    theirs = _StderrHandler()
    theirs.setLevel(logging.INFO if debug else logging.WARNING)  # a library logger set to INFO stays quiet too
    theirs.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    root.addHandler(theirs)
    if debug:
        root.setLevel(min(root.level, logging.INFO))

    def restore() -> None:
        ours.removeHandler(handler)
        root.removeHandler(theirs)
        ours.level, ours.propagate = saved[0], saved[1]
        root.setLevel(saved[2])

    return restore


def _out_of_memory(e: Exception) -> bool:
    torch = sys.modules.get("torch")  # not imported: the error cannot be torch's
    return torch is not None and isinstance(e, torch.cuda.OutOfMemoryError)


def main(argv=None) -> int:
    """Run the CLI; returns the exit code (0, 1 for a failed load/reload, 2 for a usage error)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    restore_logging = setup_logging(debug)
    try:
        if argv[:1] == ["bench"]:  # the benchmark owns its arguments
            from layerwise.benchmarks.peak_memory import main as bench_main

            return bench_main(argv[1:])
        command = next((a for a in argv if not a.startswith("-")), None)
        args = build_parser(options_of=(command,) if command else ()).parse_args(argv)  # argparse: exit 2
        return args.func(args)
    except UsageError as e:
        if debug:
            raise
        return _fail(str(e), EXIT_USAGE)
    except (LayerwiseError, ValueError, OSError) as e:  # MissingDependencyError is a LayerwiseError
        if debug:
            raise
        return _fail(str(e), EXIT_FAILED)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # torch's out of memory (the device, not a bug), or a bug: no traceback unless asked for
        if debug:
            raise
        if _out_of_memory(e):
            first = str(e).split(". ")[0]  # "CUDA out of memory", without the allocator's advice that follows
            return _fail(f"out of device memory ({first}); a smaller model or another device", EXIT_FAILED)
        return _fail(f"unexpected {type(e).__name__}: {e} (please report it)", EXIT_FAILED)
    finally:
        restore_logging()


if __name__ == "__main__":
    sys.exit(main())
