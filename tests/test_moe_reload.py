"""MoE reloads: in place and equal to a fresh load, partial (some experts only), scattered keys, and the
errors (missing, duplicate, unknown or non-finite expert tensors) that name the key and spare the model."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

import layerwise
from layerwise.api import model_digest
from layerwise.checkpoint import Checkpoint
from layerwise.engine import Engine
from tests.engine_helpers import greedy
from tests.hf_checkpoints import MOE_ARCHS
from tests.moe_helpers import MOE_NAMES, as_bytes, checkpoint_pair, load_from_stream, moe_block

KERNEL_NAMES = {
    None: ("w13_weight", "w2_weight"),
    "fp8-per-tensor": ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
    "fp8-per-block": ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"),
}


@pytest.fixture(scope="module", params=MOE_ARCHS)
def pair(request, tmp_path_factory):
    """(arch, A, B): two 3-layer checkpoints of the same MoE architecture with different weights."""
    return checkpoint_pair(tmp_path_factory, request.param, "moe-reload")


def _experts(model):
    return moe_block(model, 1).experts


def _expert_key(arch, layer, expert, which):
    """Checkpoint key of expert ``expert``'s projection ``which`` (0 gate, 1 up, 2 down)."""
    block, *projections = MOE_NAMES[arch]
    return f"model.layers.{layer}.{block}.experts.{expert}.{projections[which]}.weight"


def _assert_same_bytes(model, reference):
    sd, ref = model.state_dict(), reference.state_dict()
    assert sd.keys() == ref.keys()
    for name in sd:
        assert sd[name].dtype == ref[name].dtype, name
        assert torch.equal(as_bytes(sd[name]), as_bytes(ref[name])), name


def _snapshot(model):
    return {n: (t, t.data_ptr()) for n, t in list(model.named_parameters()) + list(model.named_buffers())}


def _assert_in_place(model, snap):
    now = _snapshot(model)
    assert now.keys() == snap.keys()
    for name, (t, ptr) in snap.items():
        assert now[name][0] is t and now[name][1] == ptr, name


@pytest.mark.parametrize("atomic", [False, True])
@pytest.mark.parametrize("quantization", list(KERNEL_NAMES))
def test_reload_equals_fresh_load_and_keeps_every_data_ptr(pair, quantization, atomic):
    arch, a, b = pair
    model = layerwise.load_model(a, quantization=quantization)
    experts = _experts(model)
    assert sorted(n for n, _ in experts.named_parameters()) == sorted(KERNEL_NAMES[quantization])
    ptrs = {n: getattr(experts, n).data_ptr() for n in KERNEL_NAMES[quantization]}
    snap = _snapshot(model)
    report = layerwise.reload_weights(model, b, atomic=atomic)
    _assert_in_place(model, snap)
    assert {n: getattr(experts, n).data_ptr() for n in ptrs} == ptrs
    _assert_same_bytes(model, layerwise.load_model(b, quantization=quantization))
    block = MOE_NAMES[arch][0]
    assert f"model.layers.1.{block}.experts" in report.updated_modules
    assert f"model.layers.1.{block}.gate" in report.updated_modules


@pytest.mark.parametrize("lazy", [False, True], ids=["tensors", "checkpoint-tensors"])
@pytest.mark.parametrize("atomic", [False, True])
def test_partial_reload_of_some_experts(pair, atomic, lazy):
    # checkpoint tensors (unread until processed) wait to be quantized with the layer's other experts: a partial
    # reload never completes the layer, so they are quantized at finalize
    arch, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    fresh_a = _experts(layerwise.load_model(a, quantization="fp8"))
    fresh_b = _experts(layerwise.load_model(b, quantization="fp8"))
    snap = _snapshot(model)
    changed = {2, 5}
    tensors = Checkpoint(b).iter_lazy() if lazy else Checkpoint(b)
    stream = [(k, t) for k, t in tensors if any(f".layers.1.{MOE_NAMES[arch][0]}.experts.{e}." in k for e in changed)]
    assert len(stream) == 6
    report = layerwise.reload_weights(model, stream, atomic=atomic)
    _assert_in_place(model, snap)
    assert report.updated_modules == [f"model.layers.1.{MOE_NAMES[arch][0]}.experts"]
    experts = _experts(model)
    for name in KERNEL_NAMES["fp8-per-tensor"]:
        for e in range(8):
            expected = (fresh_b if e in changed else fresh_a).get_parameter(name)[e]
            assert torch.equal(as_bytes(experts.get_parameter(name)[e]), as_bytes(expected)), (name, e)


def test_only_the_down_projection_of_one_expert(pair):
    arch, a, b = pair
    model = layerwise.load_model(a, quantization="fp8-per-block")
    key = _expert_key(arch, 1, 6, 2)
    layerwise.reload_weights(model, [(key, Checkpoint(b).get_tensor(key))])
    fresh_a, fresh_b = (
        _experts(layerwise.load_model(a, quantization="fp8-per-block")),
        _experts(layerwise.load_model(b, quantization="fp8-per-block")),
    )
    experts = _experts(model)
    assert torch.equal(as_bytes(experts.w2_weight[6]), as_bytes(fresh_b.w2_weight[6]))
    assert torch.equal(as_bytes(experts.w2_weight[5]), as_bytes(fresh_a.w2_weight[5]))
    assert torch.equal(as_bytes(experts.w13_weight), as_bytes(fresh_a.w13_weight))


def test_scattered_keys_in_any_order_give_the_same_bytes(pair):
    arch, a, b = pair
    stream = list(Checkpoint(a))
    random.Random(0).shuffle(stream)  # every layer's experts interleaved with everything else
    fresh = layerwise.load_model(a, quantization="fp8")
    _assert_same_bytes(load_from_stream(a, stream, "fp8"), fresh)
    model = layerwise.load_model(b, quantization="fp8")
    report = layerwise.reload_weights(model, stream)
    _assert_same_bytes(model, fresh)
    assert report.peak_buffered_bytes > 0  # units waited for their other projection, on CPU


def test_experts_scattered_across_shards(pair, tmp_path):
    """Each expert tensor in a random one of 5 shard files, the index listing keys in random order."""
    arch, a, _ = pair
    tensors = {k: t.clone() for k, t in Checkpoint(a)}
    keys = list(tensors)
    rng = random.Random(1)
    rng.shuffle(keys)
    shards = {k: f"model-{rng.randrange(5) + 1:05d}-of-00005.safetensors" for k in keys}
    for shard in set(shards.values()):
        save_file({k: tensors[k] for k in keys if shards[k] == shard}, str(tmp_path / shard), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    (tmp_path / "config.json").write_text((a / "config.json").read_text())
    _assert_same_bytes(layerwise.load_model(tmp_path, quantization="fp8"), layerwise.load_model(a, quantization="fp8"))


def test_missing_expert_on_first_load_names_its_key(pair, tmp_path):
    arch, a, _ = pair
    missing = _expert_key(arch, 2, 5, 1)  # expert 5's up projection (Mixtral: w3)
    stream = [(k, t) for k, t in Checkpoint(a) if k != missing]
    with pytest.raises(layerwise.MissingWeightError) as e:
        load_from_stream(a, stream, "fp8")
    assert missing in str(e.value) and "never written" in str(e.value)
    assert _expert_key(arch, 2, 5, 0) not in str(e.value)  # the gate projection did arrive


def test_a_whole_missing_moe_layer_is_named_briefly(pair):
    arch, a, _ = pair
    block = MOE_NAMES[arch][0]
    stream = [(k, t) for k, t in Checkpoint(a) if f"layers.2.{block}.experts." not in k]
    with pytest.raises(layerwise.MissingWeightError) as e:
        load_from_stream(a, stream)
    assert _expert_key(arch, 2, 0, 0) in str(e.value)
    assert f"and 16 more tensors of model.layers.2.{block}.experts" in str(e.value)  # 24 keys, 8 named


def test_kernel_format_reload_of_experts(pair):
    _, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    snap = _snapshot(model)
    fresh_b = layerwise.load_model(b, quantization="fp8")
    stream = [(k, t) for k, t in fresh_b.state_dict().items() if ".experts." in k]
    names = {k.rsplit(".", 1)[1] for k, _ in stream}
    assert names == {"w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"}
    layerwise.reload_weights(model, stream, is_checkpoint_format=False)
    _assert_in_place(model, snap)
    assert torch.equal(as_bytes(_experts(model).w13_weight), as_bytes(_experts(fresh_b).w13_weight))


def test_missing_expert_file_tensor_on_load(pair, tmp_path):
    arch, a, _ = pair
    missing = _expert_key(arch, 1, 7, 2)
    index = json.loads((a / "model.safetensors.index.json").read_text())
    shard = index["weight_map"].pop(missing)
    for f in a.iterdir():
        if f.name != shard:
            (tmp_path / f.name).write_bytes(f.read_bytes())
    kept = {k: t for k, t in load_file(str(a / shard)).items() if k != missing}
    save_file(kept, str(tmp_path / shard), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(layerwise.MissingWeightError, match=missing.replace(".", r"\.")):
        layerwise.load_model(tmp_path, quantization="fp8")


def test_half_an_expert_on_reload_is_an_error_and_spares_that_layer(pair):
    arch, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    before = model_digest(model)
    gate = _expert_key(arch, 1, 3, 0)
    with pytest.raises(layerwise.MissingWeightError) as e:
        layerwise.reload_weights(model, [(gate, Checkpoint(b).get_tensor(gate))], atomic=True)
    assert _expert_key(arch, 1, 3, 1) in str(e.value)  # the up projection never came
    assert isinstance(e.value, layerwise.ReloadError) and e.value.updated_modules == []
    assert model_digest(model) == before


@pytest.mark.parametrize("bad", ["expert 8", "projection", "shape"])
def test_unknown_or_misshapen_expert_tensor_names_the_key(pair, bad):
    arch, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    before = model_digest(model)
    key = _expert_key(arch, 1, 0, 0)
    tensor = Checkpoint(b).get_tensor(key)
    if bad == "expert 8":
        key, match = key.replace("experts.0.", "experts.8."), "expert 8 does not exist"
    elif bad == "projection":
        key, match = key.replace(".weight", "x.weight"), "unknown expert projection"
    else:
        tensor, match = tensor[:-1], "does not match expected"
    with pytest.raises(layerwise.ReloadError, match=match) as e:
        layerwise.reload_weights(model, [(key, tensor)])
    assert e.value.key == key
    assert model_digest(model) == before


def test_expert_written_twice_is_an_error(pair):
    arch, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    ckpt = Checkpoint(b)
    down = _expert_key(arch, 1, 4, 2)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, [(down, ckpt.get_tensor(down)), (down, ckpt.get_tensor(down))])
    assert isinstance(e.value.cause, layerwise.DuplicateWeightError) and e.value.key == down
    assert "w2_weight[4]" in str(e.value)


def _nan_stream(b, bad_key):
    for key, tensor in Checkpoint(b):
        yield key, (torch.full_like(tensor, float("nan")) if key == bad_key else tensor)


@pytest.mark.parametrize("atomic", [False, True])
def test_non_finite_expert_names_its_key_and_reports_what_changed(pair, atomic):
    arch, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    fresh_a, fresh_b = layerwise.load_model(a, quantization="fp8"), layerwise.load_model(b, quantization="fp8")
    bad = _expert_key(arch, 1, 6, 1)  # keys stream sorted: experts 0-5 of layer 1 come first
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _nan_stream(b, bad), atomic=atomic)
    assert isinstance(e.value.cause, layerwise.NonFiniteWeightError) and e.value.key == bad
    experts = _experts(model)
    if atomic:
        assert e.value.updated_modules == []
        _assert_same_bytes(model, fresh_a)
        return
    layer = f"model.layers.1.{MOE_NAMES[arch][0]}.experts"
    assert layer in e.value.updated_modules  # some experts were overwritten before the error
    assert torch.equal(as_bytes(experts.w13_weight[0]), as_bytes(_experts(fresh_b).w13_weight[0]))
    assert torch.equal(as_bytes(experts.w13_weight[6]), as_bytes(_experts(fresh_a).w13_weight[6]))
    assert torch.equal(
        as_bytes(moe_block(model, 2).experts.w2_weight), as_bytes(moe_block(fresh_a, 2).experts.w2_weight)
    )
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).float()).all()


def _nan_checkpoint(src, dst, bad_key):
    """A copy of checkpoint ``src`` in ``dst`` whose tensor ``bad_key`` is all NaN."""
    index = json.loads((src / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][bad_key]
    for f in src.iterdir():
        if f.name != shard:
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / shard))
    tensors[bad_key] = torch.full_like(tensors[bad_key], float("nan"))
    save_file(tensors, str(dst / shard), metadata={"format": "pt"})
    return dst


def test_a_nan_in_the_first_queued_projection_leaves_the_layer_untouched(pair, tmp_path):
    # expert 0's down projection completes first, so w2 is the layer's first batch: its NaN is found before any
    # expert of the layer is written, and the layer is not reported as updated
    arch, a, b = pair
    bad = _expert_key(arch, 1, 6, 2)
    model = layerwise.load_model(a, quantization="fp8")
    fresh_a = layerwise.load_model(a, quantization="fp8")
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _nan_checkpoint(b, tmp_path, bad))
    assert isinstance(e.value.cause, layerwise.NonFiniteWeightError) and e.value.key == bad
    assert f"model.layers.1.{MOE_NAMES[arch][0]}.experts" not in e.value.updated_modules
    for name in KERNEL_NAMES["fp8-per-tensor"]:
        assert torch.equal(
            as_bytes(_experts(model).get_parameter(name)), as_bytes(_experts(fresh_a).get_parameter(name))
        )


def test_queued_experts_hold_no_buffer(pair):
    # a unit waiting for the layer's others holds only unread checkpoint tensors: not counted as buffered
    _, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    from_tensors = layerwise.reload_weights(model, list(Checkpoint(b))).peak_buffered_bytes
    from_dir = layerwise.reload_weights(model, b).peak_buffered_bytes
    assert 0 < from_dir <= from_tensors  # what waits for its other projection, the same either way


def test_queued_experts_are_quantized_once_the_last_unit_is_processed_alone(pair):
    # expert 7's tensors arrive read (they cannot wait): once it is processed, the layer's queued experts are
    # quantized right away, not at finalize
    arch, a, b = pair
    from layerwise.reload import get_layerwise_info

    model = layerwise.load_model(a, quantization="fp8")
    experts = _experts(model)
    block = MOE_NAMES[arch][0]
    lazy = [(k, t) for k, t in Checkpoint(b).iter_lazy() if f".layers.1.{block}.experts." in k]
    seen = {}

    def stream():
        for key, t in lazy:
            yield key, (t.materialize() if ".experts.7." in key else t)
        seen["done before finalize"] = get_layerwise_info(experts).done

    layerwise.reload_weights(model, stream())
    assert seen == {"done before finalize": True}
    fresh_b = _experts(layerwise.load_model(b, quantization="fp8"))
    for name in KERNEL_NAMES["fp8-per-tensor"]:
        assert torch.equal(as_bytes(experts.get_parameter(name)), as_bytes(fresh_b.get_parameter(name))), name


def test_non_finite_expert_in_a_checkpoint_directory_names_its_key(pair, tmp_path):
    # from a directory the layer's experts are quantized together: the error still names the tensor and file
    arch, a, b = pair
    bad = _expert_key(arch, 1, 6, 1)
    nan_dir = _nan_checkpoint(b, tmp_path, bad)
    shard = json.loads((b / "model.safetensors.index.json").read_text())["weight_map"][bad]
    with pytest.raises(layerwise.NonFiniteWeightError) as e:
        layerwise.load_model(nan_dir, quantization="fp8")
    assert e.value.key == bad and e.value.file.endswith(shard) and "[6]" in str(e.value)
    model = layerwise.load_model(a, quantization="fp8")
    fresh_a = layerwise.load_model(a, quantization="fp8")
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, nan_dir, atomic=True)
    assert isinstance(e.value.cause, layerwise.NonFiniteWeightError) and e.value.key == bad
    assert e.value.updated_modules == []
    _assert_same_bytes(model, fresh_a)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, nan_dir)
    # w13 (gate + up) holds the NaN: every queued expert's scales come before any write, so neither w13 nor the
    # layer's w2 (whose batch alone is finite) is written, and the layer is not reported
    experts, before = _experts(model), _experts(fresh_a)
    for name in KERNEL_NAMES["fp8-per-tensor"]:
        assert torch.equal(as_bytes(experts.get_parameter(name)), as_bytes(before.get_parameter(name))), name
    assert f"model.layers.1.{MOE_NAMES[arch][0]}.experts" not in e.value.updated_modules


def test_a_checkpoint_load_quantizes_each_layers_experts_together(pair, monkeypatch):
    # every expert of a layer from the checkpoint's own tensors: one process_experts call per MoE layer (both
    # projections), no expert quantized alone
    arch, a, _ = pair
    from layerwise.quant.fp8_moe import Fp8MoEMethod

    calls = []
    batch, alone = Fp8MoEMethod.process_experts, Fp8MoEMethod.process_expert

    def counted(self, layer, batches, kernel_tensors):
        calls.append({name: sorted(ids) for name, (ids, _) in batches.items()})
        return batch(self, layer, batches, kernel_tensors)

    def refused(*args, **kwargs):
        raise AssertionError("an expert was quantized alone")

    monkeypatch.setattr(Fp8MoEMethod, "process_experts", counted)
    monkeypatch.setattr(Fp8MoEMethod, "process_expert", refused)
    model = layerwise.load_model(a, quantization="fp8")
    monkeypatch.setattr(Fp8MoEMethod, "process_expert", alone)
    moe_layers = sum(1 for m in model.modules() if type(m).__name__ == "FusedMoE")
    assert moe_layers >= 2 and calls == [{"w13_weight": list(range(8)), "w2_weight": list(range(8))}] * moe_layers
    _assert_same_bytes(model, load_from_stream(a, list(Checkpoint(a)), "fp8"))  # expert by expert


def test_engine_generates_and_reloads(pair):
    arch, a, b = pair
    if arch != "Qwen3MoeForCausalLM":
        pytest.skip("one architecture is enough for the engine (the forward of both is tested against transformers)")
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    engine = Engine.from_pretrained(a, max_batch_size=2, max_seq_len=32, quantization="fp8")
    before = greedy(engine, prompts, 6)
    snap = _snapshot(engine.model)
    engine.reload_weights(b)
    _assert_in_place(engine.model, snap)
    after = greedy(engine, prompts, 6)
    assert after == greedy(Engine.from_pretrained(b, max_batch_size=2, max_seq_len=32, quantization="fp8"), prompts, 6)
    assert after != before


def test_a_failure_inside_the_first_expert_reports_the_layer(pair, monkeypatch):
    # the first expert unit of the layer fails after writing part of its FP8 slice: nothing counts as done,
    # but the live tensors changed, so a non-atomic reload must report the layer
    arch, a, b = pair
    model = layerwise.load_model(a, quantization="fp8")
    from layerwise.errors import LayerwiseError
    from layerwise.quant.fp8_moe import Fp8MoEMethod

    def half_written(self, layer, param_name, expert_id, weight, kernel_tensors):
        kernel_tensors[param_name].data[expert_id, :1].zero_()
        raise LayerwiseError("failed mid-expert")

    monkeypatch.setattr(Fp8MoEMethod, "process_expert", half_written)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, [(k, t) for k, t in Checkpoint(b) if ".experts." in k])
    first_moe_layer = 1 if arch == "Qwen3MoeForCausalLM" else 0  # the Qwen3-MoE checkpoint's layer 0 is dense
    assert e.value.updated_modules == [f"model.layers.{first_moe_layer}.{MOE_NAMES[arch][0]}.experts"]


def test_expert_loads_are_recorded_once_per_projection(pair, monkeypatch):
    # FusedMoE declares its loader translation-invariant (unit_shard_origin): expert e's loads are expert 0's
    # recordings moved by e experts, so each MoE layer makes 3 meta runs (gate, up, down) instead of 3 per expert
    import layerwise.reload.buffering as buffering

    arch, a, _ = pair
    calls = []
    record = buffering.record_loader
    monkeypatch.setattr(
        buffering, "record_loader", lambda loader, meta, w, shard: calls.append(shard) or record(loader, meta, w, shard)
    )
    model = layerwise.load_model(a)
    expert_shards = [s for s in calls if isinstance(s, tuple) and len(s) == 2 and isinstance(s[0], int)]
    n_moe = sum(1 for _, m in model.named_modules() if type(m).__name__ == "FusedMoE")
    assert len(expert_shards) == 3 * n_moe and {s[0] for s in expert_shards} == {0}


def test_a_loader_writing_outside_its_expert_is_refused(pair, monkeypatch):
    from layerwise.errors import LayerwiseError
    from layerwise.layers.fused_moe import FusedMoE

    arch, a, _ = pair
    original = FusedMoE.weight_loader

    def off_by_one(self, param, loaded_weight, shard_id):  # expert e's tensor written into expert e + 1
        expert_id, shard = shard_id
        return original(self, param, loaded_weight, ((expert_id + 1) % self.num_experts, shard))

    monkeypatch.setattr(FusedMoE, "weight_loader", off_by_one)
    with pytest.raises(LayerwiseError, match="writes outside"):
        layerwise.load_model(a)


def test_a_nan_found_at_finalize_names_its_key_and_file(pair, tmp_path):
    # a partial reload from a directory that holds two experts of one layer: they are quantized at finalize, after
    # the stream ended, and the error still names the tensor and the file it came from
    arch, a, b = pair
    bad = _expert_key(arch, 1, 6, 1)
    keys = [_expert_key(arch, 1, e, which) for e in (2, 6) for which in range(3)]
    tensors = {}
    for k, t in Checkpoint(b):
        if k in keys:
            tensors[k] = torch.full_like(t, float("nan")) if k == bad else t.clone()
    (tmp_path / "config.json").write_bytes((b / "config.json").read_bytes())
    save_file(tensors, str(tmp_path / "experts.safetensors"), metadata={"format": "pt"})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": dict.fromkeys(tensors, "experts.safetensors")})
    )
    model = layerwise.load_model(a, quantization="fp8")
    before = model_digest(model)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, tmp_path)
    assert isinstance(e.value.cause, layerwise.NonFiniteWeightError) and "[6]" in str(e.value)
    assert e.value.key == bad and e.value.file.endswith("experts.safetensors"), str(e.value)
    assert e.value.updated_modules == [] and model_digest(model) == before  # every scale before any write
