"""benchmarks/rollout.py: the run writes the fields it promises on a tiny problem (timings are not asserted), the
ratios and targets follow the rows, and the suite and the generated pages show them."""

import json
from dataclasses import asdict

import pytest

from layerwise.benchmarks import readme, rollout, suite
from layerwise.benchmarks.checkpoints import make_checkpoint
from tests.test_benchmarks import _check_provenance

TINY = ["--size", "small", "--prompts", "3", "--prompt-len", "4,9", "--max-tokens", "3", "--batches", "2"]


def test_rollout_small_end_to_end(tmp_path):
    out, cache = tmp_path / "out", tmp_path / "cache"
    args = [*TINY, "--configs", "none,fp8-per-tensor", "--out-dir", str(out), "--cache-dir", str(cache)]
    assert rollout.main(args) == 0
    result = json.loads((out / "rollout_cpu_small.json").read_text())
    _check_provenance(result, "cpu", "small")
    assert result["benchmark"] == "rollout" and result["device"] == "cpu"
    problem = rollout.Problem(**result["problem"])
    assert problem == rollout.Problem("small", 3, 4, 9, 3, seed=0, warmup_prompt_len=16)  # exactly what ran
    assert result["max_seq_len"] == 9 + 3 and result["batches"] == [2] and result["budget_seconds"] == 900
    assert result["repeats"] == 3  # the CPU default: the fastest of three timed calls
    rows = {r["config"]: r for r in result["results"]}
    assert set(rows) == {"none", "fp8-per-tensor"}
    prompts = rollout.make_prompts(problem, vocab_size=2048)
    assert all(4 <= len(p) <= 9 for p in prompts)
    for r in rows.values():
        assert "error" not in r, r
        assert (r["engine"], r["batch"], r["fp8_mode"], r["cuda_graph"]) == ("layerwise", 2, "auto", False)
        assert r["prompts_sha1"] == rollout.prompts_digest(prompts)  # the same prompts in every process
        assert r["tokens"] == 3 * 3 and r["all_max_tokens"] and r["prompts"] == 3
        assert r["prompt_tokens"] == sum(map(len, prompts))
        assert r["tokens_per_second"] == r["tokens"] / r["seconds"] and r["seconds"] == min(r["seconds_each"])
        assert len(r["seconds_each"]) == len(r["load_average_each"]) == 3 and r["load_average"] >= 0
        assert 0 < r["ttft_seconds"] <= r["seconds"] and r["prefill_seconds"] + r["decode_seconds"] <= r["seconds"]
        # 3 prompts through 2 slots: two prefills (2 prompts, then the third when a slot frees), 2 tokens each by decode
        assert r["prefill_steps"] == 2 and r["decode_steps"] >= 2 and r["mean_decode_batch"] <= 2
        assert r["process_seconds"] >= sum(r["seconds_each"])
    ratio = rows["fp8-per-tensor"]["tokens_per_second"] / rows["none"]["tokens_per_second"]
    assert result["fp8_over_bf16"] == {"fp8-per-tensor batch 2": ratio}
    assert result["targets"] == {"fp8_over_bf16": 0.8, "batches": "every batch"}
    assert result["met"] == {"rollout fp8-per-tensor batch 2": ratio >= 0.8}
    assert result["over_transformers"] == {}  # not run
    table = readme.rollout_table(result)
    assert table.count("\n") == 3 and "| fp8-per-tensor | 2 |" in table and ">= 0.8 |" in table

    # transformers' generate on the same prompts and checkpoint (in this process: one import of transformers less)
    path = make_checkpoint("small", cache)
    (hf,) = rollout.transformers_rollout(str(path), "cpu", 2, asdict(problem))
    assert "error" not in hf, hf
    assert hf["prompts_sha1"] == rows["none"]["prompts_sha1"] and hf["tokens"] == 9 and hf["all_max_tokens"]
    assert hf["generate_calls"] == 2 and hf["padded_prompt_tokens"] >= hf["prompt_tokens"]
    assert hf["seconds_each"] == [hf["seconds"]] and hf["tokens_per_second"] == 9 / hf["seconds"]
    both = rollout.ratios([*result["results"], hf], "cpu")
    assert both["over_transformers"] == {
        f"{c} batch 2": rows[c]["tokens_per_second"] / hf["tokens_per_second"] for c in ("none", "fp8-per-tensor")
    }


def test_prompts_are_drawn_from_the_seed_alone():
    problem = rollout.Problem("small", prompts=16, min_prompt_len=3, max_prompt_len=7, max_tokens=1)
    prompts = rollout.make_prompts(problem, vocab_size=50)
    assert prompts == rollout.make_prompts(problem, vocab_size=50)
    assert prompts != rollout.make_prompts(rollout.Problem(**dict(asdict(problem), seed=1)), vocab_size=50)
    assert len(prompts) == 16 and {len(p) for p in prompts} <= set(range(3, 8)) and len({len(p) for p in prompts}) > 1
    assert all(0 <= t < 50 for p in prompts for t in p)


@pytest.mark.parametrize("batch", [1, 3, 8, 64])
def test_the_warmup_steps_through_every_capture_size(batch):
    from layerwise.model_runner import default_capture_sizes

    sizes = default_capture_sizes(batch)
    lengths = rollout.warmup_max_tokens(batch, sizes)
    # the first token comes from the prefill; decode step k runs the sequences that still want more than k tokens
    running = [sum(n > k for n in lengths) for k in range(1, max(lengths))]
    assert running == sorted(sizes, reverse=True)


def _rows(tps: dict) -> list[dict]:
    return [{"config": c, "batch": b, "tokens_per_second": v} for (c, b), v in tps.items()]


def test_the_gpu_target_is_judged_at_batch_64_only_and_the_cpu_target_at_every_batch():
    tps = {("none", 8): 100.0, ("fp8-per-tensor", 8): 90.0, ("none", 64): 400.0, ("fp8-per-tensor", 64): 560.0}
    tps[("transformers", 64)] = 200.0
    rows = [*_rows(tps), {"config": "fp8-per-block", "batch": 64, "error": "RuntimeError: x"}]
    gpu = rollout.ratios(rows, "cuda")
    assert gpu["fp8_over_bf16"] == {"fp8-per-tensor batch 8": 0.9, "fp8-per-tensor batch 64": 1.4}
    assert gpu["met"] == {"rollout fp8-per-tensor batch 64": True}  # 1.4 >= 1.3; batch 8 has no target
    assert gpu["over_transformers"] == {"none batch 64": 2.0, "fp8-per-tensor batch 64": 2.8}
    cpu = rollout.ratios(rows, "cpu")
    assert cpu["met"] == {"rollout fp8-per-tensor batch 8": True, "rollout fp8-per-tensor batch 64": True}
    assert rollout.ratios(_rows({("none", 8): 10.0, ("fp8-per-block", 8): 7.0}), "cpu")["met"] == {
        "rollout fp8-per-block batch 8": False
    }


def test_the_suite_summary_and_the_pages_show_the_rollout():
    tps = {("none", 64): 400.0, ("fp8-per-tensor", 64): 300.0, ("transformers", 64): 200.0}
    rows = [dict(r, seconds=1.0, tokens=1) for r in _rows(tps)]
    ro = {
        "benchmark": "rollout",
        "size": "small",
        "date": "2026-11-27T00:00:00Z",
        "commit": "abc1234",
        "results": rows,
        **rollout.ratios(rows, "cpu"),
    }
    summary = dict(suite.targets("cpu", None, None, None, ro), device="cpu")
    assert summary["rollout_fp8_over_bf16"] == {"fp8-per-tensor batch 64": 0.75}
    assert summary["rollout_over_transformers"] == {"none batch 64": 2.0, "fp8-per-tensor batch 64": 1.5}
    assert summary["met"] == {"rollout fp8-per-tensor batch 64": False}
    assert summary["targets"]["rollout_fp8_over_bf16"] == 0.8
    table = readme.targets_table(summary)
    row = next(line for line in table.splitlines() if line.startswith("| rollout tokens/s, FP8 / BF16"))
    assert row.endswith("| fp8-per-tensor batch 64 | 0.75 | 0.8 | **no** |"), row
    assert readme._rollout_cell(ro, "0.9b") == (
        "0.75x at batch 64 (BF16 engine / transformers: 2.00x); small checkpoint, 2026-11-27, commit abc1234"
    )
    assert readme._rollout_cell(ro, "small") == "0.75x at batch 64 (BF16 engine / transformers: 2.00x)"
    assert readme._rollout_cell({}, "small") == "not measured"
