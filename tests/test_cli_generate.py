"""``layerwise generate`` on the demo checkpoint (random weights, its local tokenizer), run in-process as
tests/test_cli.py does, and once as a user would (a subprocess in a clean environment); its usage errors are one
line and exit 2 before anything loads. ``--quantization none`` where the scheme does not matter: on CPU the FP8
reference dequantizes every weight at every step."""

import os
import re
import subprocess
import sys

import pytest
import torch

from layerwise.cli import main
from layerwise.demo import PROMPT_TEXT, demo_checkpoint, write_checkpoint
from tests.test_errors import TINY

pytest.importorskip("transformers")

FAST = ["--quantization", "none", "--max-seq-len", "32"]
SUMMARY = re.compile(r"^\[(length|stop \(EOS \d+\)), (\d+) tokens in [\d.]+ s: [\d.]+ tokens/s\]$", re.M)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache directory holding the demo checkpoint (``layerwise demo --cache-dir`` reuses it)."""
    root = tmp_path_factory.mktemp("cache")
    demo_checkpoint(root)
    return root


@pytest.fixture(scope="module")
def demo(cache):
    return str(demo_checkpoint(cache))


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory):
    """A tiny checkpoint of token ids only (vocabulary 64: no tokenizer, no EOS)."""
    return str(write_checkpoint(tmp_path_factory.mktemp("ids") / "ckpt", TINY))


class _Writes:
    """stdout that records each write (a streamed token is one write)."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append(text)
        return len(text)

    def flush(self):
        pass

    @property
    def text(self):
        return "".join(self.writes)


def _without_times(out: str) -> str:
    return re.sub(r"[\d.]+ s: [\d.]+ tokens/s", "", out)


def test_one_prompt_streams_its_tokens_then_a_summary(demo, monkeypatch):
    stdout = _Writes()
    monkeypatch.setattr(sys, "stdout", stdout)
    argv = ["generate", demo, "--prompt", PROMPT_TEXT, "--max-tokens", "4", "--seed", "0", "--temperature", "0.8"]
    assert main(argv + FAST) == 0
    out = stdout.text
    reason, count = SUMMARY.search(out).groups()
    assert reason == "length" and count == "4"
    # one write per generated token (an id past the tokenizer's vocabulary writes ""), then the summary
    summary = next(i for i, w in enumerate(stdout.writes) if w.startswith("\n["))
    assert summary == 4


def test_a_seed_makes_two_runs_identical(demo, capsys):
    argv = ["generate", demo, "--prompt", PROMPT_TEXT, "--max-tokens", "3", "--seed", "7", *FAST]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    assert _without_times(capsys.readouterr().out) == _without_times(first)


def test_several_prompts_show_a_progress_bar_then_each_completion(demo, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("from a file\n\nsecond line of the file\n")
    argv = ["generate", demo, "--prompt", "hello", "--prompt-ids", "1 17 42", "--prompt-file", str(prompts)]
    assert main([*argv, "--max-tokens", "2", "--seed", "0", *FAST]) == 0
    captured = capsys.readouterr()
    headers = re.findall(r"^=== prompt (\d): (.*) \((length|stop \(EOS \d+\)), (\d) tokens\)$", captured.out, re.M)
    assert [(h[0], h[1]) for h in headers] == [
        ("0", "'hello'"),
        ("1", "[1, 17, 42]"),
        ("2", "'from a file'"),
        ("3", "'second line of the file'"),
    ]
    assert re.search(r"^4 prompts, \d+ tokens in [\d.]+ s", captured.out, re.M)
    assert "100%" in captured.err  # tqdm's bar


def test_n_completions_with_logprobs(demo, capsys):
    argv = ["generate", demo, "--prompt", "hi", "--n", "2", "--logprobs", "3", "--max-tokens", "2", "--seed", "1"]
    assert main(argv + FAST) == 0
    out = capsys.readouterr().out
    assert re.findall(r"^=== prompt 0, completion (\d)", out, re.M) == ["0", "1"]
    rows = re.findall(r"^\s+(\d+)\s+(\d+) '.*'\s+(-[\d.]+)\s+rank (\d+) \| (.*)$", out, re.M)
    assert len(rows) == 4  # 2 completions x 2 tokens
    for _, _, logprob, rank, top in rows:
        assert float(logprob) <= 0 and int(rank) >= 1
        top_logprobs = [float(x) for x in re.findall(r" (-[\d.]+)(?:,|$)", top)]
        assert len(top_logprobs) == 3 and top_logprobs == sorted(top_logprobs, reverse=True)
        assert float(logprob) <= top_logprobs[0]


def test_chat_renders_the_template(demo, capsys):
    argv = ["generate", demo, "--chat", "--prompt", "hi", "--prompt", "bye", "--max-tokens", "1", "--seed", "0"]
    assert main(argv + FAST) == 0
    out = capsys.readouterr().out
    assert "=== prompt 0: '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n'" in out


def test_token_ids_without_a_tokenizer_stream_as_ids(no_tokenizer, capsys):
    assert main(["generate", no_tokenizer, "--prompt-ids", "1,2,3", "--max-tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    streamed = out.split("\n[")[0].split()
    assert len(streamed) == 5 and all(0 <= int(t) < TINY["vocab_size"] for t in streamed)
    assert SUMMARY.search(out).groups() == ("length", "5")


def test_a_completion_ending_at_eos_says_so(no_tokenizer, tmp_path, capsys):
    import shutil

    from tests.hf_checkpoints import add_text_files

    argv = ["generate", "--prompt-ids", "1 2 3", "--max-tokens", "5", "--temperature", "0"]
    assert main([argv[0], no_tokenizer, *argv[1:]]) == 0
    first = int(capsys.readouterr().out.split()[0])
    path = shutil.copytree(no_tokenizer, tmp_path / "eos")
    add_text_files(path, tokenizer=False, eos_token_ids=[first])  # the greedy first token becomes the EOS
    assert main([argv[0], str(path), *argv[1:]]) == 0
    assert SUMMARY.search(capsys.readouterr().out).groups() == (f"stop (EOS {first})", "1")


@pytest.mark.slow
def test_the_fp8_default_from_a_clean_environment(demo, tmp_path):
    """As a user runs it: a subprocess, the default scheme (fp8), no inherited environment but PATH and HOME."""
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path)}
    argv = ["generate", demo, "--prompt", PROMPT_TEXT, "--max-tokens", "2", "--max-seq-len", "32", "--seed", "0"]
    proc = subprocess.run(
        [sys.executable, "-m", "layerwise.cli", *argv], capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert SUMMARY.search(proc.stdout).groups() == ("length", "2")


def test_demo_shows_a_sampled_text(cache, capsys):
    assert main(["demo", "--cache-dir", str(cache), "--tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^greedy tokens after prompt \[1, 17, 42, 7\]: \[\d+, \d+\]$", out, re.M)
    assert f"sampled text after {PROMPT_TEXT!r} (seed 0): " in out
    assert "random weights, so the text is noise" in out


# ---- usage errors: one line, exit 2, nothing loaded


def _usage_error(capsys, *argv) -> str:
    assert main(["generate", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("layerwise: error: "), err
    return err[0]


def test_a_missing_path(tmp_path, capsys):
    line = _usage_error(capsys, str(tmp_path / "nope"), "--prompt", "hi")
    assert f"PATH {tmp_path / 'nope'}" in line


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--temperature", "-1", "--temperature -1.0: temperature must be >= 0"),
        ("--top-p", "0", "--top-p 0.0: top_p must be in (0, 1]"),
        ("--max-tokens", "0", "--max-tokens 0: max_tokens must be >= 1"),
        ("--n", "0", "--n 0: n must be >= 1"),
        ("--max-seq-len", "1", "--max-seq-len 1: give at least 2"),
    ],
)
def test_a_bad_sampling_option_names_it(demo, capsys, option, value, message):
    assert message in _usage_error(capsys, demo, "--prompt", "hi", option, value)


def test_a_text_prompt_without_tokenizer_asks_for_ids(no_tokenizer, capsys):
    line = _usage_error(capsys, no_tokenizer, "--prompt", "hello")
    assert "has no tokenizer" in line and "--prompt-ids '1 17 42'" in line


def test_no_prompt_and_chat_over_ids(demo, tmp_path, capsys):
    assert "give a prompt" in _usage_error(capsys, demo)
    assert "--chat" in _usage_error(capsys, demo, "--chat", "--prompt-ids", "1 2")
    assert "--prompt-file" in _usage_error(capsys, demo, "--prompt-file", str(tmp_path / "missing.txt"))
    assert "--n 4 completions do not fit --max-batch-size 2" in _usage_error(
        capsys, demo, "--prompt", "hi", "--n", "4", "--max-batch-size", "2"
    )


def test_bad_token_ids_are_an_argparse_error(demo, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", demo, "--prompt-ids", "1 two 3"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "--prompt-ids: '1 two 3': give token ids" in err[0]


def test_help_lists_generate(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "generate" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for option in ("--prompt-ids", "--prompt-file", "--chat", "--logprobs", "--seed", "--max-seq-len"):
        assert option in out


def test_an_fp8_kv_cache_reaches_the_engine(no_tokenizer, monkeypatch, capsys):
    """--kv-cache-dtype fp8: the engine the CLI generates with stores its cache in e4m3."""
    from layerwise.engine import Engine

    made = []
    real = Engine.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        made.append(real(cls, *args, **kwargs))
        return made[-1]

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(spy))
    argv = ["generate", no_tokenizer, "--prompt-ids", "1,2,3", "--max-tokens", "5", "--temperature", "0"]
    assert main([*argv, "--kv-cache-dtype", "fp8", "--quantization", "none"]) == 0
    assert SUMMARY.search(capsys.readouterr().out).groups() == ("length", "5")
    assert made[0].kv_caches[0].k.dtype == torch.float8_e4m3fn and made[0].kv_scales() is not None
