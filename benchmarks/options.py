"""What the benchmark scripts share on the command line: where results go (``--out-dir``, ``--name``),
where the generated checkpoints are cached (``--cache-dir``), and the up-front check of optional imports."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from layerwise import optional

DEFAULT_OUT_DIR = Path("layerwise-results")  # relative to the current working directory
REFERENCE_DIR = "benchmarks/results"  # the committed results the README is generated from
RESULTS_NOTE = f"""\
Results go to --out-dir (default ./{DEFAULT_OUT_DIR}/, created if missing). The committed reference
results are refreshed only on purpose: run from the repository root with --out-dir {REFERENCE_DIR},
then regenerate the README with python -m layerwise.benchmarks.readme."""


def benchmark_parser(
    prog: str,
    description: str,
    device_help: str = "cpu or cuda (default: cpu)",
    size_help: str = "checkpoint size (as layerwise bench)",
) -> argparse.ArgumentParser:
    """The parser every checkpoint benchmark starts from: ``--size`` (the checkpoint sizes of
    benchmarks/checkpoints.py) and ``--device``, with the module docstring as description and the
    results note as epilog."""
    from layerwise.benchmarks.checkpoints import SIZES

    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=RESULTS_NOTE, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="default", choices=sorted(SIZES), help=size_help)
    parser.add_argument("--device", default="cpu", help=device_help)
    return parser


def default_cache_dir() -> Path:
    """Where generated benchmark checkpoints are kept: $LAYERWISE_CACHE/bench, else ~/.cache/layerwise/bench."""
    from layerwise.demo import default_cache_dir as layerwise_cache_dir

    return layerwise_cache_dir() / "bench"


def add_output_arguments(parser: argparse.ArgumentParser, default_name: str, checkpoint: bool = True) -> None:
    """Add ``--out-dir`` and ``--name`` (and ``--cache-dir`` if the script generates a checkpoint)."""
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT_DIR,
        metavar="DIR",
        help=f"directory for the results, created if missing (default: ./{DEFAULT_OUT_DIR}/)",
    )
    parser.add_argument("--name", default=None, help=f"file name of the results, no suffix (default: {default_name})")
    if checkpoint:
        parser.add_argument(
            "--cache-dir",
            type=Path,
            default=None,
            metavar="DIR",
            help="where the BF16 checkpoint is generated once and reused "
            "(default: $LAYERWISE_CACHE/bench, else ~/.cache/layerwise/bench)",
        )


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def require(modules: list[str], purpose: str = "layerwise bench") -> None:
    """Import each optional module now, before any work starts (:func:`layerwise.optional.require`).

    Raises:
        MissingDependencyError: some are not installed; the message names only those, with the pip line that
            installs them (their bounds from the "bench" extra).
    """
    optional.require(modules, extra="bench", purpose=purpose)


def write_json(result: dict, out_dir: Path, name: str) -> Path:
    """Write ``result`` to ``out_dir/name.json`` (creating ``out_dir``), through a temporary file renamed over it
    (a run interrupted while writing keeps the previous file whole); returns the file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, path)
    return path
