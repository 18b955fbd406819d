"""The rollout / reference mismatch report (layerwise/benchmarks/mismatch.py, ``layerwise mismatch``): the metric
functions against direct torch computations, the scoring of exactly the generated positions, an unquantized float32
engine against a float32 reference measuring nothing, FP8 measuring something, the CLI and its errors."""

import json

import pytest
import torch
import torch.nn.functional as F

from layerwise import cli
from layerwise.benchmarks import mismatch
from layerwise.demo import write_checkpoint
from tests.test_cli_errors import _error_lines, _run

TINY_F32 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",  # for --reference transformers
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
FLOAT32 = dict(dtype="float32", reference_dtype="float32")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 2-layer BF16 Qwen3 without a tokenizer (random-id prompts), loaded as float32 by the tests."""
    return write_checkpoint(tmp_path_factory.mktemp("mismatch") / "ckpt", TINY_F32)


@pytest.fixture(scope="module")
def result(ckpt):
    """Unquantized and FP8 per-tensor rollouts, KV cache in the model dtype and in FP8, float32 throughout."""
    return mismatch.run(
        ckpt,
        schemes=["none", "fp8-per-tensor"],
        kv_cache_dtypes=["auto", "fp8"],
        num_prompts=4,
        max_tokens=12,
        perplexity_tokens=128,
        window=32,
        log=lambda line: None,
        **FLOAT32,
    )


def _row(result, scheme, kv):
    return next(r for r in result["results"] if (r["scheme"], r["kv_cache_dtype"]) == (scheme, kv))


# ---- the metrics, against torch written out by hand


def _logits(n=40, vocab=50, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g) * scale


def test_kl_equals_a_direct_torch_computation():
    p, q = _logits(seed=0), _logits(seed=1)
    direct = F.kl_div(F.log_softmax(q, -1), F.log_softmax(p, -1), log_target=True, reduction="none").sum(-1)
    assert torch.allclose(mismatch.kl_divergence(p, q), direct, rtol=1e-5, atol=1e-6)
    p64, q64 = p.double().softmax(-1), q.double().softmax(-1)
    assert torch.allclose(mismatch.kl_divergence(p, q).double(), (p64 * (p64 / q64).log()).sum(-1), atol=1e-5)
    assert float(mismatch.kl_divergence(p, q).min()) > 0
    assert torch.allclose(mismatch.kl_divergence(p, p), torch.zeros(len(p)), atol=1e-6)
    # bfloat16 logits are scored in float32
    assert mismatch.kl_divergence(p.bfloat16(), q.bfloat16()).dtype == torch.float32


def test_summary_equals_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    rollout = -torch.rand(30, generator=g) * 5
    reference = rollout + torch.randn(30, generator=g) * 0.8  # some ratios above 2, some below 1/2
    kl, top1, lengths = torch.rand(30, generator=g), torch.rand(30, generator=g) > 0.3, [10, 5, 15]
    s = mismatch.summarize(kl, rollout, reference, top1, lengths)
    diff = (reference - rollout).double()
    ratio = diff.exp()
    assert s["tokens"] == 30 and s["mean_kl"] == pytest.approx(float(kl.mean()), rel=1e-6)
    assert s["mean_abs_logprob_diff"] == pytest.approx(float(diff.abs().mean()))
    assert s["max_abs_logprob_diff"] == pytest.approx(float(diff.abs().max()))
    for key, q in (("ratio_p1", 0.01), ("ratio_p50", 0.5), ("ratio_p99", 0.99)):
        assert s[key] == pytest.approx(float(torch.quantile(ratio, q)))
    assert 0 < s["frac_ratio_above_2"] == pytest.approx(float((ratio > 2).sum()) / 30)
    assert s["top1_agreement"] == pytest.approx(float(top1.sum()) / 30)
    sums = torch.stack([diff[:10].sum(), diff[10:15].sum(), diff[15:].sum()])
    assert s["sequence_log_ratio_mean"] == pytest.approx(float(sums.mean()))
    assert s["sequence_log_ratio_mean_abs"] == pytest.approx(float(sums.abs().mean()))
    assert s["sequence_log_ratio_max_abs"] == pytest.approx(float(sums.abs().max()))


def test_perplexity_equals_torch_cross_entropy():
    sequences = [[3, 7, 1, 0, 9], [4, 4, 2]]
    logits = [_logits(4, 10, seed=2), _logits(2, 10, seed=3)]
    nll = F.cross_entropy(torch.cat(logits), torch.tensor([7, 1, 0, 9, 4, 2]))
    assert mismatch.perplexity(logits, sequences) == pytest.approx(float(nll.exp()), rel=1e-6)


def test_compare_scores_exactly_the_generated_positions():
    """Fake scorers with logits that depend on the position: the figures equal a direct computation over the rows
    that predict the generated tokens (row j predicts token j + 1), not one row earlier or later."""
    sequences = [[5, 1, 2, 9, 9, 3, 4], [7, 8, 0, 1, 2]]
    prompt_lengths = [3, 2]  # generated: [9, 9, 3, 4] and [0, 1, 2]
    vocab = 12
    table = {name: [_logits(len(s) - 1, vocab, seed=10 * i + k) for i, s in enumerate(sequences)] for k, name in
             enumerate(("rollout", "reference"))}  # fmt: skip

    def scorer(name):
        return lambda group: [table[name][sequences.index(seq)] for seq in group]

    generated = []  # generate's logprobs: the rollout's teacher-forced ones plus a known offset
    for i, (seq, p) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        lp = F.log_softmax(table["rollout"][i][p - 1 : len(seq) - 1], -1)
        generated.append([float(lp[j, t]) + 1e-3 * (j + 1) for j, t in enumerate(seq[p:])])
    figures, log_r = mismatch.compare(
        scorer("rollout"), scorer("reference"), sequences, prompt_lengths, generated, batch=1
    )
    rows = [slice(p - 1, len(s) - 1) for s, p in zip(sequences, prompt_lengths, strict=True)]
    roll = torch.cat([table["rollout"][i][r] for i, r in enumerate(rows)])
    ref = torch.cat([table["reference"][i][r] for i, r in enumerate(rows)])
    tokens = torch.tensor([t for s, p in zip(sequences, prompt_lengths, strict=True) for t in s[p:]])
    direct_kl = F.kl_div(F.log_softmax(ref, -1), F.log_softmax(roll, -1), log_target=True, reduction="none").sum(-1)
    assert figures["mean_kl"] == pytest.approx(float(direct_kl.mean()), rel=1e-5)
    assert figures["top1_agreement"] == pytest.approx(float((roll.argmax(-1) == ref.argmax(-1)).double().mean()))
    ref_lp = F.log_softmax(ref, -1).gather(1, tokens[:, None])[:, 0]
    gen = torch.tensor([x for g in generated for x in g])
    assert torch.allclose(log_r, (ref_lp - gen).double(), atol=1e-5)
    assert figures["tokens"] == 7 and figures["rollout_logprob_consistency"] == pytest.approx(4e-3, abs=1e-5)


# ---- engines


def test_float32_engine_against_float32_reference_measures_nothing(result):
    row = _row(result, "none", "auto")
    assert row["tokens"] == 4 * 12
    assert row["mean_kl"] <= 1e-6
    for key in ("ratio_p1", "ratio_p50", "ratio_p99"):
        assert abs(row[key] - 1) <= 1e-4, (key, row[key])
    assert row["max_abs_logprob_diff"] <= 1e-4  # every ratio within 1e-4 of 1, not only the quantiles
    assert row["frac_ratio_above_2"] == 0 and row["top1_agreement"] == 1
    assert row["sequence_log_ratio_max_abs"] <= 1e-3 and row["rollout_logprob_consistency"] <= 1e-4
    assert row["perplexity"] == pytest.approx(row["reference_perplexity"], rel=1e-5)


def test_fp8_weights_and_fp8_kv_cache_measure_a_mismatch(result):
    floor = _row(result, "none", "auto")
    for scheme, kv in (("fp8-per-tensor", "auto"), ("none", "fp8"), ("fp8-per-tensor", "fp8")):
        row = _row(result, scheme, kv)
        assert row["mean_kl"] > 0 and row["mean_kl"] > 100 * max(floor["mean_kl"], 1e-12), (scheme, kv)
        assert row["max_abs_logprob_diff"] > 10 * floor["max_abs_logprob_diff"], (scheme, kv)
        # the decode path and the prefill path of the same FP8 engine agree: the mismatch is the quantization's
        assert row["rollout_logprob_consistency"] <= 1e-4


def test_result_json_keys_table_and_plot(result, tmp_path):
    keys = {
        "scheme", "kv_cache_dtype", "tokens", "model", "mean_kl", "mean_abs_logprob_diff", "max_abs_logprob_diff",
        "ratio_p1", "ratio_p50", "ratio_p99", "frac_ratio_above_2", "top1_agreement", "sequence_log_ratio_mean",
        "sequence_log_ratio_mean_abs", "sequence_log_ratio_max_abs", "rollout_logprob_consistency", "perplexity",
        "reference_perplexity",
    }  # fmt: skip
    assert [(r["scheme"], r["kv_cache_dtype"]) for r in result["results"]] == [
        ("none", "auto"),
        ("none", "fp8"),
        ("fp8-per-tensor", "auto"),
        ("fp8-per-tensor", "fp8"),
    ]
    for row in result["results"]:
        assert keys <= set(row) and row["model"] == result["model"] == "ckpt"
        clamped = row["kv_clamped_fraction"]  # the FP8 cache's own count; nothing with the model's dtype
        assert clamped is None if row["kv_cache_dtype"] == "auto" else 0 <= clamped < 0.01
    assert result["benchmark"] == "mismatch" and result["reference"] == {
        "kind": "ours",
        "dtype": "float32",
        "kv_cache_dtype": "auto",
    }
    json.dumps(result)  # JSON values only
    hist = result["log_ratio_histogram"]
    assert all(sum(c) == 48 for c in hist["counts"].values()) and len(hist["edges"]) == mismatch.HISTOGRAM_BINS + 1
    md = mismatch.table(result)
    assert md.count("\n") == 1 + len(result["results"]) and "| fp8-per-tensor | fp8 | 48 |" in md
    compact = mismatch.table(result, compact=True).splitlines()
    assert compact[0].count("|") == len(mismatch.COMPACT) + 1 and compact[-1].startswith("| fp8-per-tensor | fp8 | ")
    png = mismatch.plot(result, tmp_path / "m.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_transformers_reference_agrees_with_ours(ckpt):
    """transformers' float32 forward as the reference of an unquantized float32 engine: nothing measured either."""
    pytest.importorskip("transformers")
    result = mismatch.run(
        ckpt,
        schemes=["none"],
        kv_cache_dtypes=["auto"],
        num_prompts=2,
        max_tokens=6,
        reference="transformers",
        perplexity_tokens=64,
        log=lambda line: None,
        **FLOAT32,
    )
    (row,) = result["results"]
    assert result["reference"]["kind"] == "transformers" and result["reference"]["dtype"] == "float32"
    assert row["mean_kl"] <= 1e-6 and row["max_abs_logprob_diff"] <= 1e-4 and row["top1_agreement"] == 1
    assert row["perplexity"] == pytest.approx(row["reference_perplexity"], rel=1e-5)


def test_real_text_prompts_and_perplexity_with_a_tokenizer(tmp_path):
    """A checkpoint with a tokenizer: prompts are passages of layerwise.texts, perplexity is on its real text."""
    path = write_checkpoint(tmp_path / "text", {**TINY_F32, "vocab_size": 512}, tokenizer=True)
    result = mismatch.run(
        path,
        schemes=["none"],
        kv_cache_dtypes=["auto"],
        num_prompts=2,
        max_tokens=4,
        perplexity_tokens=64,
        log=lambda line: None,
        **FLOAT32,
    )
    p = result["problem"]
    assert (
        p["prompt_source"].startswith("layerwise.texts.prompts")
        and p["perplexity_text"] == "layerwise.texts.real_text()"
    )
    assert p["perplexity_tokens"] == 64 and p["prompt_tokens"][0] > 24  # 24 words: more than 24 byte-level tokens
    (row,) = result["results"]
    assert row["tokens"] == 8 and row["perplexity"] == pytest.approx(row["reference_perplexity"], rel=1e-5)


# ---- command line


def test_cli_runs_and_writes_json(ckpt, tmp_path, capsys):
    out = tmp_path / "m.json"
    argv = ["mismatch", str(ckpt), "--quantization", "FP8", "--kv-cache-dtype", "fp8", "--prompts", "2"]
    argv += ["--max-tokens", "4", "--dtype", "float32", "--reference-dtype", "float32", "--perplexity-tokens", "64"]
    assert cli.main([*argv, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    ((row,),) = [data["results"]]
    assert (row["scheme"], row["kv_cache_dtype"], row["tokens"]) == ("fp8-per-tensor", "fp8", 8)
    assert "| fp8-per-tensor | fp8 | 8 |" in printed and row["mean_kl"] > 0


def test_cli_usage_errors(ckpt, tmp_path, capsys):
    for argv, option in (
        (["--quantization", "fp8,int3"], "--quantization"),
        (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype"),
        (["--reference-dtype", "float8"], "--reference-dtype"),
    ):
        with pytest.raises(SystemExit) as e:
            cli.main(["mismatch", str(ckpt), *argv])
        assert e.value.code == 2 and option in capsys.readouterr().err
    assert cli.main(["mismatch", str(ckpt), "--json", str(tmp_path / "no" / "m.json")]) == 2
    assert "--json" in capsys.readouterr().err


def test_cli_missing_checkpoint_is_one_line_exit_2(tmp_path):
    proc = _run("mismatch", str(tmp_path / "nope"), "--quantization", "fp8")
    assert proc.returncode == 2 and str(tmp_path / "nope") in _error_lines(proc)[0]
