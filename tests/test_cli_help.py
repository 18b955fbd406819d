"""The CLI is clean: ``--version``, help text on every option, ``--help`` without torch, only our log lines under
our prefix, and the first-hour errors (tests/test_errors_first_hour.py) as one or two lines without a traceback."""

import argparse
import logging
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from layerwise import cli
from tests.test_cli_errors import _error_lines, _run
from tests.test_errors import TINY

# ---- --version, --help


def test_version_prints_the_installed_version():
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout == f"layerwise {metadata.version('layerwise')}\n"
    # the one source: pyproject reads layerwise.__version__ (read here from the file, not by importing it)
    init = (Path(__file__).resolve().parents[1] / "layerwise" / "__init__.py").read_text()
    assert f'__version__ = "{metadata.version("layerwise")}"' in init


NO_TORCH = """
import sys
from layerwise.cli import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    print("EXIT", e.code)
print("TORCH", "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["-h"], []])
def test_help_and_version_import_no_torch(argv):
    proc = subprocess.run([sys.executable, "-c", NO_TORCH, *argv], capture_output=True, text=True, timeout=120)
    assert "TORCH False" in proc.stdout, proc.stdout + proc.stderr
    assert ("EXIT 0" if argv else "EXIT 2") in proc.stdout  # no command: a usage error, still without torch


def test_the_package_imports_its_api_at_first_use():
    script = (
        "import sys, layerwise\n"
        "print('TORCH', 'torch' in sys.modules)\n"
        "from layerwise import load_model\n"
        "print('ALL', all(getattr(layerwise, n, None) is not None for n in layerwise.__all__))\n"
        "print('SUBMODULE', layerwise.checkpoint.Checkpoint.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["TORCH", "False", "ALL", "True", "SUBMODULE", "Checkpoint"]


def test_help_lists_the_commands():
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.cli", "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    for command in ("load", "demo", "reload", "sync-demo", "bench", "--version", "--debug"):
        assert command in proc.stdout


def _actions(parser: argparse.ArgumentParser, prog: str = "layerwise"):
    for action in parser._actions:
        yield prog, action
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # the one-line help of each command
                yield f"{prog} {choice.dest}", choice
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{prog} {name}")


def test_every_option_of_every_command_has_help():
    actions = list(_actions(cli.build_parser()))
    assert len(actions) > 25  # every command's options were added
    missing = [
        f"{prog}: {action.option_strings or action.dest}"
        for prog, action in actions
        if not isinstance(action, argparse._HelpAction) and not (action.help or "").strip()
    ]
    assert missing == []


def test_main_adds_only_the_options_of_the_command_it_runs():
    parser = cli.build_parser(options_of=())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert [a.dest for a in sub.choices["load"]._actions] == ["help"]  # its --help alone until load runs


# ---- logging: ours under our prefix, theirs not


@pytest.fixture
def cli_logging():
    """Undo what setup_logging installs (the CLI's own process would keep it)."""
    loggers = [logging.getLogger("layerwise"), logging.getLogger()]
    saved = [(logger, list(logger.handlers), logger.level) for logger in loggers]
    yield
    for logger, handlers, level in saved:
        logger.handlers[:] = handlers
        logger.setLevel(level)


RECORDS = [
    ("torchao", logging.WARNING, "Failed to load _C_mxfp8.so"),
    ("verbose_lib", logging.INFO, "a library whose own logger is set to INFO"),
    ("matplotlib.font_manager", logging.INFO, "generated new fontManager"),
    ("layerwise.quant.fp8", logging.INFO, "compiling the FP8 kernels once"),
    ("layerwise.reload", logging.DEBUG, "staging buffer kept"),
]


@pytest.mark.parametrize(
    "debug,printed",
    [
        (False, ["torchao: WARNING: Failed to load _C_mxfp8.so", "layerwise: compiling the FP8 kernels once"]),
        (
            True,
            [
                "torchao: WARNING: Failed to load _C_mxfp8.so",
                "verbose_lib: INFO: a library whose own logger is set to INFO",
                "matplotlib.font_manager: INFO: generated new fontManager",
                "layerwise: compiling the FP8 kernels once",
                "layerwise: staging buffer kept",
            ],
        ),
    ],
)
def test_other_libraries_do_not_log_under_our_prefix(cli_logging, capsys, debug, printed):
    """Theirs from WARNING up under their own name (INFO up with --debug), ours under ``layerwise:``."""
    logging.getLogger("verbose_lib").setLevel(logging.INFO)
    before = [(lg, list(lg.handlers), lg.level, lg.propagate) for lg in (logging.getLogger("layerwise"), logging.root)]
    cli.setup_logging(debug)
    restore = cli.setup_logging(debug)  # a second call replaces the first: nothing printed twice
    for name, level, message in RECORDS:
        logging.getLogger(name).log(level, message)
    assert capsys.readouterr().err.splitlines() == printed
    restore()  # as main does on its way out: an in-process call leaves logging as it found it
    assert [(lg, list(lg.handlers), lg.level, lg.propagate) for lg, *_ in before] == before


def test_the_cli_process_prints_no_foreign_line_under_our_prefix(tmp_path):
    """torchao logs its own warnings when it is imported (unloadable kernel libraries): a run of the CLI that
    imports it never prints them as ``layerwise: ...``."""
    from layerwise.demo import write_checkpoint

    path = write_checkpoint(tmp_path / "ckpt", TINY)
    script = (  # a torchao warning logged once the CLI has set up its logging (whether or not torchao logs itself)
        "import logging, sys\n"
        "import layerwise.cli as cli\n"
        "setup = cli.setup_logging\n"
        "def setup_then_log(debug):\n"
        "    restore = setup(debug)\n"
        "    logging.getLogger('torchao').warning('a torchao warning')\n"
        "    return restore\n"
        "cli.setup_logging = setup_then_log\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, "load", str(path), "--quantization", "torchao:Int8WeightOnlyConfig"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "torchao: WARNING: a torchao warning" in proc.stderr.splitlines()  # under its own name
    ours = [line for line in proc.stderr.splitlines() if line.startswith("layerwise:")]
    assert not [line for line in ours if "torchao" in line or "Failed to load" in line], proc.stderr


# ---- the first-hour errors through the CLI: one or two lines, no traceback (_run asserts both)


def test_hub_id_is_a_usage_error_saying_how_to_download(tmp_path):
    proc = _run("load", "Qwen/Qwen3-8B", cwd=tmp_path)
    assert proc.returncode == 2
    assert _error_lines(proc) == [
        "layerwise: error: PATH Qwen/Qwen3-8B: no such directory; if Qwen/Qwen3-8B is a Hugging Face hub id: "
        "layerwise reads local directories and downloads nothing. Download it first (huggingface-cli download "
        "Qwen/Qwen3-8B --local-dir DIR, or huggingface_hub.snapshot_download('Qwen/Qwen3-8B', local_dir=DIR)), then "
        "pass DIR"
    ]


def test_pytorch_bin_checkpoint_fails_in_one_line(tmp_path):
    path = tmp_path / "bin"
    path.mkdir()
    (path / "config.json").write_text("{}")
    torch.save({}, path / "pytorch_model.bin")
    proc = _run("load", str(path))
    (line,) = _error_lines(proc)
    assert proc.returncode == 1 and "it holds pytorch_model.bin: PyTorch pickle weights" in line
    assert "save_pretrained(OUT, safe_serialization=True)" in line


def test_int8_is_a_usage_error_suggesting_torchao(tmp_path):
    proc = _run("load", str(tmp_path), "--quantization", "int8")
    assert proc.returncode == 2
    assert (
        "layerwise load: error: argument --quantization: unknown quantization 'int8'; did you mean "
        "'torchao:Int8WeightOnlyConfig'? choose one of: " in proc.stderr
    )


def test_e5m2_is_a_usage_error_naming_e4m3(tmp_path):
    proc = _run("reload", "--quantization", "fp8-e5m2")
    assert proc.returncode == 2 and "float8_e4m3fn (e4m3), the only FP8 format" in proc.stderr


def test_cuda_on_a_cpu_only_torch_is_a_usage_error_naming_the_build(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)
    assert cli.main(["load", str(tmp_path), "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        f"layerwise: error: --device cuda: no CUDA GPU is visible to torch (torch {torch.__version__}, a CPU-only "
        f"build without CUDA); use cpu, or a CUDA build of torch on a machine with a GPU\n"
    )


def test_missing_extra_names_only_the_missing_package(tmp_path):
    from tests.test_cli_errors import _without

    proc = _run("bench", "--size", "small", env_extra=_without(tmp_path, "matplotlib"), cwd=tmp_path)
    (line,) = _error_lines(proc)
    assert proc.returncode == 1 and "needs matplotlib, which is not installed" in line
    assert "pip install 'matplotlib>=3.7';" in line and "transformers" not in line and "torchao" not in line
