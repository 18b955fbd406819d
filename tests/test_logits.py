"""Logits against transformers' own forward on checkpoints that transformers wrote."""

import pytest
import torch

import layerwise
from tests.hf_checkpoints import hf_logits, sqnr_db


def test_unquantized_float32_matches_transformers(hf_checkpoint):
    arch, path = hf_checkpoint
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(path, ids)
    model = layerwise.load_model(path, quantization=None, dtype=torch.float32)
    with torch.no_grad():
        out = model(ids)
    assert out.shape == ref.shape
    err = (out - ref).abs().max().item()
    assert err <= 1e-4 * ref.abs().max().item(), f"{arch}: max |diff| {err}"


def test_bf16_forward_close_to_transformers(hf_checkpoint):
    arch, path = hf_checkpoint
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(path, ids)
    model = layerwise.load_model(path, quantization=None)
    assert model.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        out = model(ids).float()
    assert sqnr_db(ref, out) > 30


# W8A8 also quantizes every activation (per tensor, dynamic); measured ~2 dB below W8A16 here
@pytest.mark.parametrize("mode,min_db", [("w8a16", 18.0), ("w8a8", 15.0)])
def test_fp8_sqnr_on_8_layers(qwen3_8_layers, mode, min_db):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(3))
    ref = hf_logits(qwen3_8_layers, ids)
    model = layerwise.load_model(qwen3_8_layers, quantization="fp8", dtype=torch.float32, fp8_mode=mode)
    with torch.no_grad():
        out = model(ids)
    db = sqnr_db(ref, out)
    assert db >= min_db, f"SQNR {db:.1f} dB"
    # and quantization does change the result (the test would notice an unquantized model)
    unq = layerwise.load_model(qwen3_8_layers, quantization=None, dtype=torch.float32)
    with torch.no_grad():
        assert sqnr_db(ref, unq(ids)) > db + 10
