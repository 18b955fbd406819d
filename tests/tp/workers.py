"""Functions the tensor-parallel workers run: ``fn(group, *args)``; results travel back by queue."""

from __future__ import annotations

import torch

import layerwise
from layerwise.api import load_model_with_report
from layerwise.engine import Engine
from tests.engine_helpers import greedy

STATE: dict = {}  # per worker process: objects kept between calls (an engine)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _tensors(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def load_and_forward(
    group, path, ids, quantization, dtype, global_scales=False, track_memory=False, device="cpu", expert_parallel=False
):
    """Load this rank's shard on ``device`` ("cuda": this rank's GPU); return its logits, kernel tensors and
    LoadReport (as a dict), on the CPU."""
    if device == "cuda":
        device = f"cuda:{torch.distributed.get_rank(group)}"
    model, report = load_model_with_report(
        path,
        device=device,
        quantization=quantization,
        dtype=dtype,
        tp_group=group,
        global_scales=global_scales,
        track_memory=track_memory,
        expert_parallel=expert_parallel,
    )
    assert model.tp_group is group
    with torch.no_grad():
        logits = model(ids.to(device)).cpu()
    tensors = {n: t.cpu() for n, t in _tensors(model).items()}
    load_numel = {prefix: info.load_numel_total for prefix, info in _infos(model)}
    return {"logits": logits, "tensors": tensors, "report": report.to_dict(), "load_numel_total": load_numel}


def _infos(model):
    from layerwise.reload.session import get_layerwise_info

    for prefix, module in model.named_modules():
        info = get_layerwise_info(module)
        if info is not None:
            yield prefix, info


def reload_keeps_pointers(group, path_a, path_b, quantization, expert_parallel=False):
    """Load A, reload B in place; return whether every data_ptr was kept and whether the result equals a
    fresh load of B bit for bit."""
    kw = dict(quantization=quantization, tp_group=group, global_scales=True, expert_parallel=expert_parallel)
    model = layerwise.load_model(path_a, **kw)
    ptrs = {n: t.data_ptr() for n, t in model.named_parameters()}
    report = layerwise.reload_weights(model, path_b)
    fresh = layerwise.load_model(path_b, **kw)
    ours, theirs = _tensors(model), _tensors(fresh)
    same = ours.keys() == theirs.keys() and all(torch.equal(_bytes(ours[n]), _bytes(theirs[n])) for n in ours)
    kept = ptrs == {n: t.data_ptr() for n, t in model.named_parameters()}
    return {"ptrs_kept": kept, "equal": same, "updated": len(report.updated_modules)}


def engine_join_transfer(group, path, init_info, expert_parallel=False):
    """Wrap this rank's shard of ``path`` in an Engine and join the trainer's transfer group."""
    model = layerwise.load_model(
        path, quantization="fp8", tp_group=group, global_scales=True, expert_parallel=expert_parallel
    )
    engine = Engine(model, max_batch_size=1, max_seq_len=32)
    engine.init_weight_transfer_engine("nccl", init_info)
    STATE["engine"] = engine
    return engine.transfer_engine.worker_rank


def engine_update_and_compare(group, update_info, expected_path, prompt, expert_parallel=False):
    """Receive one update; return whether it equals a fresh TP load of ``expected_path`` (data_ptrs kept),
    and the engine's greedy tokens."""
    engine = STATE["engine"]
    ptrs = {n: t.data_ptr() for n, t in engine.model.named_parameters()}
    engine.update_weights({"update_info": update_info})
    fresh = layerwise.load_model(
        expected_path, quantization="fp8", tp_group=group, global_scales=True, expert_parallel=expert_parallel
    )
    ours, theirs = _tensors(engine.model), _tensors(fresh)
    same = ours.keys() == theirs.keys() and all(torch.equal(_bytes(ours[n]), _bytes(theirs[n])) for n in ours)
    tokens = greedy(engine, [prompt], 4)
    engine.shutdown_weight_transfer()
    kept = ptrs == {n: t.data_ptr() for n, t in engine.model.named_parameters()}
    return {"equal": same, "ptrs_kept": kept, "tokens": tokens}


def load_error(group, path, quantization="fp8", expert_parallel=False):
    """The error a load raises (type name, message), or None."""
    try:
        layerwise.load_model(path, quantization=quantization, tp_group=group, expert_parallel=expert_parallel)
    except Exception as e:  # noqa: BLE001 -- returned to the test
        return type(e).__name__, str(e)
    return None


def load_without_group(group, path):
    """load_model with no tp_group inside an initialized world of several ranks: the model is not sharded."""
    model = layerwise.load_model(path, quantization=None)
    return model.tp_group, model.tp.size, tuple(model.model.layers[0].self_attn.qkv_proj.weight.shape)


def engine_sample(group, path, prompts, seed_rank_rng):
    """A TP engine samples unseeded and seeded requests; each rank's global RNG is seeded differently (its rank),
    so the ranks agree only if they take the group's first rank's tokens. Returns each request's token ids."""
    from layerwise.sampling_params import SamplingParams

    if seed_rank_rng:
        torch.manual_seed(1000 + torch.distributed.get_rank(group))
    model = layerwise.load_model(path, quantization=None, dtype="float32", tp_group=group)
    engine = Engine(model, max_batch_size=2, max_seq_len=32)
    params = [SamplingParams(temperature=1.0, max_tokens=8), SamplingParams(temperature=1.0, max_tokens=8, seed=5)]
    params += [SamplingParams(temperature=1.0, max_tokens=6)] * (len(prompts) - 2)
    return [out.outputs[0].token_ids for out in engine.generate(prompts, params)]


def engine_kv_scales(group, path, prompt):
    """A TP engine with an FP8 KV cache: this rank's calibrated scales and its greedy tokens."""
    from layerwise.sampling_params import SamplingParams

    model = layerwise.load_model(path, quantization=None, dtype="float32", tp_group=group)
    engine = Engine(model, max_batch_size=1, max_seq_len=32, kv_cache_dtype="fp8")
    (out,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return engine.kv_scales(), out.outputs[0].token_ids


def load_fp8_checkpoint(group, path, ids):
    """Load this rank's shard of a pre-quantized FP8 checkpoint; its kernel tensors and logits (fp32 activations)."""
    model = layerwise.load_model(path, quantization="fp8", dtype="float32", tp_group=group)
    with torch.no_grad():
        logits = model(ids)
    return {"logits": logits, "tensors": _tensors(model)}


def partial_expert_reload(group, path_a, stream, expert_parallel):
    """Load A (FP8 per tensor, global scales), reload ``stream`` (a few experts' tensors); per local expert of every
    MoE layer, whether its bytes changed, keyed (layer prefix, checkpoint expert id)."""
    model = layerwise.load_model(
        path_a, quantization="fp8", tp_group=group, global_scales=True, expert_parallel=expert_parallel
    )
    before = _tensors(model)
    layerwise.reload_weights(model, stream)
    changed = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "expert_start"):
            for e in range(module.num_experts):
                now = [getattr(module, p)[e] for p in ("w13_weight", "w2_weight")]
                was = [before[f"{prefix}.{p}"][e] for p in ("w13_weight", "w2_weight")]
                changed[(prefix, module.expert_start + e)] = any(
                    not torch.equal(_bytes(a), _bytes(b)) for a, b in zip(was, now, strict=True)
                )
    return changed


def reload_error(group, path_a, stream, quantization, expert_parallel, global_scales=True):
    """Load A, reload ``stream``; the error's type name and message on this rank (None: it succeeded)."""
    model = layerwise.load_model(
        path_a, quantization=quantization, tp_group=group, global_scales=global_scales, expert_parallel=expert_parallel
    )
    try:
        layerwise.reload_weights(model, stream)
    except Exception as e:  # noqa: BLE001 -- returned to the test
        cause = getattr(e, "cause", None)
        return type(cause or e).__name__, str(e)
    return None
