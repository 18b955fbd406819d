"""The MoE benchmark's generated checkpoint (128 experts, top-8) is a valid Qwen3-MoE checkpoint: transformers
and layerwise load it and agree, and the benchmark's row fields are what the README quotes."""

import torch

import layerwise
from layerwise.benchmarks.moe_load import NUM_EXPERTS, make_checkpoint, table, unit_report
from tests.hf_checkpoints import hf_logits, sqnr_db


def test_benchmark_checkpoint_loads_in_transformers_and_layerwise(tmp_path):
    path = make_checkpoint("test", tmp_path)
    assert make_checkpoint("test", tmp_path) == path  # cached
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    model = layerwise.load_model(path, quantization=None, dtype=torch.float32)
    assert model.model.layers[0].mlp.experts.w13_weight.shape == (NUM_EXPERTS, 64, 64)
    with torch.no_grad():
        assert sqnr_db(hf_logits(path, ids), model(ids)) > 60
    row = next(unit_report(str(path), "fp8-per-tensor", "cpu"))
    assert row["largest_unit_bytes"] == 128 * 64 * 2  # embed_tokens / lm_head, above one expert's 64 x 64 w13


def test_table_lists_every_row():
    result = {
        "results": [
            {
                "method": "floor-read-copy",
                "peak_bytes": 2**20,
                "final_bytes": 2**20,
                "peak_over_final": 1.0,
                "seconds": 1.0,
                "time_over_floor": 1.0,
            },
            {"method": "layerwise-fp8-per-tensor", "error": "timed out after 5 s"},
        ]
    }
    lines = table(result).splitlines()
    assert len(lines) == 4 and "timed out" in lines[3] and "| 1.0 |" in lines[2]
