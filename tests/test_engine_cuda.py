"""The rollout engine's CUDA paths: a CUDA graph per captured batch size, padded steps, graphs that survive weight
reloads. Skipped without a GPU (run: python -m pytest -m gpu tests/test_engine_cuda.py)."""

import pytest
import torch

from layerwise.engine import Engine
from layerwise.model_runner import default_capture_sizes
from layerwise.sampling_params import SamplingParams
from tests.hf_checkpoints import write_hf_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 1, 4, 4, 6, 9, 10, 2, 3, 11, 7], [12, 13, 14], [6, 2], [9, 9, 9, 9, 9]] * 3
MAX_TOKENS = [6, 3, 9, 1, 7, 4] * 3  # sequences finish at different steps: the running batch shrinks and regrows


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_cuda")
    return (
        write_hf_checkpoint(root / "a", "Qwen3ForCausalLM", seed=0),
        write_hf_checkpoint(root / "b", "Qwen3ForCausalLM", seed=1),
    )


def _outputs(engine, params):
    result = []
    for out in engine.generate(PROMPTS, params):
        for c in out.outputs:
            result.append((c.token_ids, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids, strict=True)]))
    return result


# log-probability tolerance, graph vs eager: the same rows, but a graph step runs padded to its captured size
# (other GEMM shapes) and its padding rows are dummy tokens. Per-token activation scales (per-channel) see only
# their own row; a per-tensor activation scale spans the whole step, padding included: 0.034 measured on an
# H200 (2026-11-27), tokens equal.
LOGPROB_ATOL = {"none": 2e-2, "fp8-per-channel": 2e-2, "fp8-per-tensor": 5e-2}


@pytest.mark.parametrize("scheme", list(LOGPROB_ATOL))
def test_graphs_per_batch_size_equal_eager_and_survive_reload(pair, scheme):
    a, b = pair
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, logprobs=1) for i, n in enumerate(MAX_TOKENS)]
    graph = Engine.from_pretrained(a, max_batch_size=12, max_seq_len=48, device="cuda", quantization=scheme)
    eager = Engine(graph.model, max_batch_size=12, max_seq_len=48, use_cuda_graph=False)
    ours, theirs = _outputs(graph, params), _outputs(eager, params)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, lp_graph), (_, lp_eager) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(lp_graph), torch.tensor(lp_eager), rtol=0, atol=LOGPROB_ATOL[scheme])
    assert set(graph.graphs) <= set(default_capture_sizes(12)) and len(graph.graphs) >= 3  # several sizes used
    captured = dict(graph.graphs)
    graph.reload_weights(b)
    after = _outputs(graph, params)
    assert graph.graphs == captured and graph.captures == len(captured)  # replayed, never recaptured
    fresh = Engine.from_pretrained(b, max_batch_size=12, max_seq_len=48, device="cuda", quantization=scheme)
    assert [t for t, _ in after] == [t for t, _ in _outputs(fresh, params)]
    assert [t for t, _ in after] != [t for t, _ in ours]


def test_a_step_pads_to_the_next_captured_size(pair):
    a, _ = pair
    engine = Engine.from_pretrained(a, max_batch_size=8, max_seq_len=32, device="cuda", cuda_graph_sizes=[2, 8])
    assert engine.runner.capture_sizes == [2, 8]
    engine.generate([[1, 2, 3]] * 3, SamplingParams(temperature=0, max_tokens=3))  # 3 running rows -> the size-8 graph
    assert set(engine.graphs) == {8}


def test_fp8_kv_cache_graphs_equal_eager_and_recalibrate_in_place(pair):
    """kv_cache_dtype="fp8" under CUDA graphs: the graph steps quantize into the same cache and read the same scale
    tensors as eager steps; a reload recalibrates them in place (no recapture) and then equals a fresh FP8 engine;
    the clamp counts are kept inside the graphs too."""
    a, b = pair
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, logprobs=1) for i, n in enumerate(MAX_TOKENS)]
    kw = dict(max_batch_size=12, max_seq_len=48, device="cuda", quantization=None, kv_cache_dtype="fp8")
    graph = Engine.from_pretrained(a, **kw)
    eager = Engine(graph.model, max_batch_size=12, max_seq_len=48, use_cuda_graph=False, kv_cache_dtype="fp8")
    torch.testing.assert_close(graph.kv_scales(), eager.kv_scales(), rtol=0, atol=0)
    ours, theirs = _outputs(graph, params), _outputs(eager, params)
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    for (_, lp_graph), (_, lp_eager) in zip(ours, theirs, strict=True):
        torch.testing.assert_close(torch.tensor(lp_graph), torch.tensor(lp_eager), rtol=0, atol=2e-2)
    ptrs = [t.data_ptr() for c in graph.kv_caches for t in (c.k, c.v, c.k_scale, c.v_scale)]
    captured, before = dict(graph.graphs), graph.kv_scales()
    report = graph.reload_weights(b)
    assert report.kv_scales_recalibrated and not torch.equal(graph.kv_scales(), before)
    after = _outputs(graph, params)
    assert (
        graph.graphs == captured
        and [t.data_ptr() for c in graph.kv_caches for t in (c.k, c.v, c.k_scale, c.v_scale)] == ptrs
    )
    fresh = Engine.from_pretrained(b, **kw)
    torch.testing.assert_close(graph.kv_scales(), fresh.kv_scales(), rtol=0, atol=0)
    assert [t for t, _ in after] == [t for t, _ in _outputs(fresh, params)]
    graph.runner.set_kv_scales(graph.runner.kv_scales / 64, requantize=False)
    _outputs(graph, params)
    assert 0 < graph.kv_clamped_fraction < 1
    for cache in graph.kv_caches:
        assert all(torch.isfinite(t.float()).all() for t in cache)
