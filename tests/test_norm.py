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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_equals_the_float32_computation_on_cpu(dtype):
    # on the CPU torch's rms_norm upcasts bf16/fp16 itself: the same bytes as normalizing x.float() and casting,
    # for hidden-size rows and for Qwen3's per-head norms over strided head views of the qkv output
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(1)
    for hidden, x in [
        (4096, torch.randn(8, 1, 4096, generator=g)),
        (128, torch.randn(3, 5, 48 * 128, generator=g)[..., : 32 * 128].view(3, 5, 32, 128)),  # strided heads
        (64, 1e-3 * torch.randn(2, 7, 64, generator=g)),
    ]:
        x = x.to(dtype)
        norm = RMSNorm(hidden, 1e-6, params_dtype=dtype)
        with torch.no_grad():
            norm.weight.copy_((1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype))
            expected = norm.weight * F.rms_norm(x.float(), (hidden,), eps=1e-6).to(dtype)
            assert torch.equal(norm(x), expected)
