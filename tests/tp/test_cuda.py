"""Tensor parallelism over NCCL: two GPUs, one rank each (skipped with fewer than two GPUs)."""

import pytest
import torch

import layerwise
from tests.tp import workers
from tests.tp.pool import TPPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_nccl_tp2_logits_equal_tp1(hf_checkpoint, quantization):
    _, path = hf_checkpoint
    ids = torch.tensor([[1, 5, 9, 33, 70, 2, 127, 64]])
    reference = layerwise.load_model(path, quantization=quantization, dtype="float32", device="cuda:0")
    expected = reference(ids.cuda()).cpu()
    pool = TPPool(2, backend="nccl")
    try:
        results = pool.run(workers.load_and_forward, str(path), ids, quantization, "float32", True, False, "cuda")
    finally:
        pool.close()
    for out in results:
        err = (out["logits"].double() - expected.double()).abs().max() / expected.double().abs().max()
        assert err <= 1e-4
