"""RMSNorm against transformers' LlamaRMSNorm (float32 arithmetic, one rounding to the input dtype)."""

import pytest
import torch

from layerwise.layers.norm import RMSNorm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    g = torch.Generator().manual_seed(0)
    hidden = 2048
    weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    ours, theirs = RMSNorm(hidden, 1e-6, params_dtype=dtype), LlamaRMSNorm(hidden, eps=1e-6).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        theirs.weight.copy_(weight)
    for shape in [(8, 1, hidden), (3, 17, hidden)]:
        x = (3 * torch.randn(shape, generator=g)).to(dtype)
        with torch.no_grad():
            y, ref = ours(x), theirs(x)
        assert y.dtype == ref.dtype == dtype
        # float32 in both, fused here and spelled out there: the normalized value may differ by one rounding of
        # x's dtype before the weight multiplies it, so by at most 2 ulps of the output
        ulp = torch.finfo(dtype).eps * ref.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((y.float() - ref.float()).abs() <= 2 * ulp).all())
        assert (y != ref).float().mean() < 0.01  # nearly every element equal
