"""The CPU FP8 GEMM benchmark writes the JSON it promises (timings are recorded, not asserted)."""

import json

import pytest
import torch

from layerwise.benchmarks import cpu_gemm
from layerwise.kernels import cpu_native


@pytest.mark.skipif(not cpu_native.available(), reason="the _cpu_fp8 extension is not built")
def test_a_small_run_writes_every_shape_m_and_scheme(tmp_path, capsys):
    threads = torch.get_num_threads()
    args = ["--shapes", "a=40x72,130x200", "--ms", "1,3", "--repeats", "1", "--threads", "1"]
    assert cpu_gemm.main([*args, "--out-dir", str(tmp_path), "--name", "g"]) == 0
    assert torch.get_num_threads() == threads  # --threads is restored
    result = json.loads((tmp_path / "g.json").read_text())
    assert (
        result["benchmark"] == "cpu_gemm" and result["threads"] == 1 and result["gemm_path"] == cpu_native.gemm_path()
    )
    rows = result["results"]
    assert {(r["layer"], r["n"], r["k"], r["m"], r["scheme"]) for r in rows} == {
        (layer, n, k, m, f"fp8-per-{g}")
        for layer, n, k in (("a", 40, 72), ("130x200", 130, 200))
        for m in (1, 3)
        for g in ("tensor", "channel", "block")
    }
    for r in rows:
        assert r["bf16_seconds"] > 0 and r["dequantize_seconds"] > 0 and r["fused_seconds"] > 0
        assert r["speed_vs_bf16"] == pytest.approx(r["bf16_seconds"] / r["fused_seconds"])
    assert "| a (40x72) | 3 | fp8-per-block |" in capsys.readouterr().out


def test_bad_arguments_are_refused(capsys):
    for args in (["--shapes", "12"], ["--shapes", "a=0x8"], ["--ms", "0"], ["--ms", "x"]):
        with pytest.raises(SystemExit):
            cpu_gemm.main(args)
