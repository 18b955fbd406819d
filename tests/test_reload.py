"""Hot reload: in place, byte-equal to a fresh load, partial/interleaved/tied, exact coverage, rollback."""

import random

import pytest
import torch

import layerwise
from layerwise.api import model_digest
from layerwise.checkpoint import Checkpoint
from layerwise.engine import Engine
from layerwise.memory import DeviceMemoryTracker
from layerwise.reload import release_staging, staging_bytes
from tests.engine_helpers import greedy
from tests.hf_checkpoints import write_hf_checkpoint

ARCHS = ["Qwen2ForCausalLM", "Qwen3ForCausalLM"]  # Qwen2 here is tied, Qwen3 untied


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(A, B): two checkpoints of the same architecture and shape with different weights."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"reload-{arch}")
    return (
        write_hf_checkpoint(root / "a", arch, seed=0, num_layers=3),
        write_hf_checkpoint(root / "b", arch, seed=1, num_layers=3),
    )


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _assert_same_bytes(model, reference):
    sd, ref = model.state_dict(), reference.state_dict()
    assert sd.keys() == ref.keys()
    for name in sd:
        assert sd[name].dtype == ref[name].dtype, name
        assert torch.equal(_bytes(sd[name]), _bytes(ref[name])), name


def _snapshot(model):
    return {
        n: (t, t.data_ptr(), t.dtype, t.shape, t.stride())
        for n, t in list(model.named_parameters()) + list(model.named_buffers())
    }


def _assert_in_place(model, snap):
    now = _snapshot(model)
    assert now.keys() == snap.keys()
    for name, (t, ptr, dtype, shape, stride) in snap.items():
        t2, ptr2, dtype2, shape2, stride2 = now[name]
        assert t2 is t, f"{name}: a new tensor object"
        assert (ptr2, dtype2, shape2, stride2) == (ptr, dtype, shape, stride), name


@pytest.mark.parametrize("quantization", ["fp8", None])
def test_reload_equals_fresh_load_and_stays_in_place(pair, quantization):
    a, b = pair
    model = layerwise.load_model(a, quantization=quantization)
    snap = _snapshot(model)
    before = model_digest(model)
    report = layerwise.reload_weights(model, b)
    _assert_in_place(model, snap)
    _assert_same_bytes(model, layerwise.load_model(b, quantization=quantization))
    assert model_digest(model) != before
    assert "model.layers.2.self_attn.qkv_proj" in report.updated_modules


def test_reload_from_an_in_memory_stream_on_any_device_order(pair):
    a, b = pair
    model = layerwise.load_model(a)
    stream = [(k, t.clone()) for k, t in Checkpoint(b)]
    random.Random(0).shuffle(stream)  # tensors of all layers interleaved
    report = layerwise.reload_weights(model, stream)
    _assert_same_bytes(model, layerwise.load_model(b))
    assert report.peak_buffered_bytes > 0  # layers waited for their remaining shards, on CPU


def test_partial_update_changes_only_named_layers(pair):
    a, b = pair
    model = layerwise.load_model(a)
    reference_a = layerwise.load_model(a)
    reference_b = layerwise.load_model(b)
    stream = [(k, t) for k, t in Checkpoint(b) if k.startswith("model.layers.1.self_attn.")]
    report = layerwise.reload_weights(model, stream)
    assert set(report.updated_modules) == {"model.layers.1.self_attn.qkv_proj", "model.layers.1.self_attn.o_proj"} | (
        {"model.layers.1.self_attn.q_norm", "model.layers.1.self_attn.k_norm"}
        if model.config.architectures == ["Qwen3ForCausalLM"]
        else set()
    )
    sd, sa, sb = model.state_dict(), reference_a.state_dict(), reference_b.state_dict()
    for name in sd:
        expected = sb if name.startswith("model.layers.1.self_attn.") and "rotary" not in name else sa
        assert torch.equal(_bytes(sd[name]), _bytes(expected[name])), name


def test_tied_embedding_reload_is_what_lm_head_uses(tmp_path):
    a = write_hf_checkpoint(tmp_path / "a", "Qwen2ForCausalLM", seed=0, tie=True)
    b = write_hf_checkpoint(tmp_path / "b", "Qwen2ForCausalLM", seed=1, tie=True)
    model = layerwise.load_model(a)
    layerwise.reload_weights(model, [(k, t) for k, t in Checkpoint(b) if "embed_tokens" in k])
    embed_b = Checkpoint(b).get_tensor("model.embed_tokens.weight")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embed_b)
    ids = torch.tensor([[1, 2, 3]])
    hidden = model.model(ids, torch.arange(3)[None])
    assert torch.equal(model(ids), torch.nn.functional.linear(hidden, embed_b))


def test_double_write_within_a_layer_is_an_error(pair):
    a, b = pair
    model = layerwise.load_model(a)
    ckpt = Checkpoint(b)
    q = "model.layers.0.self_attn.q_proj.weight"
    k = "model.layers.0.self_attn.k_proj.weight"
    # q twice and no v: the element count reaches the total, but the regions tell the truth
    stream = [(q, ckpt.get_tensor(q)), (k, ckpt.get_tensor(k)), (q, ckpt.get_tensor(q))]
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, stream)
    assert isinstance(e.value.cause, layerwise.DuplicateWeightError)
    assert "qkv_proj.weight" in str(e.value) and "more than once" in str(e.value)
    _assert_same_bytes(model, layerwise.load_model(a))


def test_double_write_after_a_layer_completed_is_an_error(pair):
    a, b = pair
    model = layerwise.load_model(a)
    key = "model.layers.0.mlp.down_proj.weight"
    tensor = Checkpoint(b).get_tensor(key)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, [(key, tensor), (key, tensor)])
    assert isinstance(e.value.cause, layerwise.DuplicateWeightError) and e.value.key == key
    assert e.value.updated_modules == ["model.layers.0.mlp.down_proj"]


def test_missing_region_is_an_error_at_finalize(pair):
    a, b = pair
    model = layerwise.load_model(a)
    stream = [(k, t) for k, t in Checkpoint(b) if k != "model.layers.2.self_attn.v_proj.weight"]
    with pytest.raises(layerwise.MissingWeightError) as e:
        layerwise.reload_weights(model, stream)
    assert "model.layers.2.self_attn.qkv_proj.weight" in str(e.value) and "never written" in str(e.value)
    assert isinstance(e.value, layerwise.ReloadError)
    assert "model.layers.0.self_attn.qkv_proj" in e.value.updated_modules
    assert "model.layers.2.self_attn.qkv_proj" not in e.value.updated_modules
    # the incomplete layer kept its old values and the model still runs
    ref_a = layerwise.load_model(a)
    qkv = model.model.layers[2].self_attn.qkv_proj
    assert torch.equal(_bytes(qkv.weight), _bytes(ref_a.model.layers[2].self_attn.qkv_proj.weight))
    model(torch.tensor([[1, 2, 3]]))


def _failing_stream(b, bad):
    """B's tensors in order, with layer 2's up_proj replaced by ``bad(tensor)`` (or an unknown key)."""
    for key, tensor in Checkpoint(b):
        if key == "model.layers.2.mlp.up_proj.weight":
            yield bad(key, tensor)
        else:
            yield key, tensor


def _read_error(key, tensor):
    raise OSError(f"truncated read of {key}")  # what a damaged file or a dropped network mount raises


BAD = {
    "stream raises": _read_error,
    "unknown name": lambda k, t: ("model.layers.2.mlp.up_projj.weight", t),
    "wrong shape": lambda k, t: (k, t[:-1]),
    "non-finite": lambda k, t: (k, torch.where(torch.arange(t.numel()).view(t.shape) == 5, float("nan"), t)),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_atomic_reload_that_fails_halfway_changes_nothing(pair, kind):
    a, b = pair
    model = layerwise.load_model(a)
    snap = _snapshot(model)
    before = model_digest(model)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _failing_stream(b, BAD[kind]), atomic=True)
    assert e.value.updated_modules == []
    assert model_digest(model) == before
    _assert_in_place(model, snap)


@pytest.mark.parametrize("kind", list(BAD))
def test_non_atomic_failure_lists_updated_modules_and_spares_the_rest(pair, kind):
    a, b = pair
    model = layerwise.load_model(a)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _failing_stream(b, BAD[kind]))
    updated = e.value.updated_modules
    assert "model.layers.1.mlp.gate_up_proj" in updated and "model.layers.0.self_attn.qkv_proj" in updated
    assert "model.layers.2.mlp.gate_up_proj" not in updated
    assert "modules already updated" in str(e.value) and "model.layers.2.mlp.up_proj" in str(e.value)
    if kind == "stream raises":  # not a LayerwiseError: still a ReloadError, the OSError kept as its cause
        assert isinstance(e.value.cause, OSError) and e.value.__cause__ is e.value.cause
    ref_a, ref_b = layerwise.load_model(a).state_dict(), layerwise.load_model(b).state_dict()
    for name, t in model.named_parameters():  # deduplicated: a tied lm_head is embed_tokens
        layer = name.rsplit(".", 1)[0]
        expected = ref_b if layer in updated else ref_a
        assert torch.equal(_bytes(t), _bytes(expected[name])), name


def test_kernel_format_reload_copies_fp8_directly(pair):
    a, b = pair
    model = layerwise.load_model(a)
    snap = _snapshot(model)
    fresh_b = layerwise.load_model(b)
    layerwise.reload_weights(model, list(fresh_b.state_dict().items()), is_checkpoint_format=False)
    _assert_in_place(model, snap)
    _assert_same_bytes(model, fresh_b)
    with pytest.raises(layerwise.ReloadError):
        layerwise.reload_weights(
            model, [("model.layers.0.mlp.down_proj.weight", torch.zeros(3))], is_checkpoint_format=False
        )


def test_reload_peak_is_bounded_by_one_module_transient(qwen3_8_layers, tmp_path):
    b = write_hf_checkpoint(
        tmp_path / "b",
        "Qwen3ForCausalLM",
        seed=5,
        num_layers=8,
        hidden=128,
        intermediate=384,
        vocab=256,
        max_shard_size="200KB",
    )
    model, report = layerwise.load_model_with_report(qwen3_8_layers)  # fp8 per tensor
    assert staging_bytes(model) == 0  # a first load keeps no buffer
    with DeviceMemoryTracker("cpu") as tracker:  # counts only what the reload allocates
        layerwise.reload_weights(model, b)
    # every FP8 weight is quantized from the checkpoint's own (memory-mapped) tensors straight into the live
    # weight, and BF16 modules are loaded into their live tensors: only the new scales are allocated
    # (measured 24 bytes; before, 1.75 x the largest layer: the BF16 module, a float32 buffer, new FP8 values)
    assert tracker.peak_bytes <= 24 and tracker.final_bytes == 0 and staging_bytes(model) == 0
    _assert_same_bytes(model, layerwise.load_model(b))

    # per block too, although this shape's k and v (64 rows) are not whole 128-row blocks: the block of rows
    # they share takes its scale from both pieces (measured 60 bytes: the new scales)
    model = layerwise.load_model(qwen3_8_layers, quantization="fp8-per-block")
    with DeviceMemoryTracker("cpu") as tracker:
        layerwise.reload_weights(model, b)
    assert tracker.peak_bytes <= 60 and tracker.final_bytes == 0 and staging_bytes(model) == 0
    _assert_same_bytes(model, layerwise.load_model(b, quantization="fp8-per-block"))

    # a float32 stream is cast by the loaders (no verbatim copy): every FP8 module is staged in the buffer
    stream = [(k, t.float()) for k, t in Checkpoint(qwen3_8_layers)]
    with DeviceMemoryTracker("cpu") as tracker:
        layerwise.reload_weights(model, stream)
    kept = staging_bytes(model)  # kept for the next reload: the largest staged module in BF16 (gate_up_proj)
    assert tracker.final_bytes == kept == 2 * 384 * 128 * 2
    assert tracker.peak_bytes <= kept + 24  # measured: the buffer and the scales
    stream = [(k, t.float()) for k, t in Checkpoint(b)]
    with DeviceMemoryTracker("cpu") as again:
        layerwise.reload_weights(model, stream)
    # the second reload reuses it: its peak is the first one's less the buffer, and it leaves nothing behind
    assert again.peak_bytes <= tracker.peak_bytes - kept and again.final_bytes == 0
    _assert_same_bytes(model, layerwise.load_model(b, quantization="fp8-per-block"))
    assert release_staging(model) == kept and staging_bytes(model) == 0


def test_engine_output_after_reload_equals_fresh_engine(pair):
    a, b = pair
    prompts = [[1, 2, 3, 4], [9, 8, 7], [5]]
    engine = Engine.from_pretrained(a, max_batch_size=4, max_seq_len=32)
    before = greedy(engine, prompts, 6)
    snap = _snapshot(engine.model)
    engine.reload_weights(b)
    _assert_in_place(engine.model, snap)
    after = greedy(engine, prompts, 6)
    assert after == greedy(Engine.from_pretrained(b, max_batch_size=4, max_seq_len=32), prompts, 6)
    assert after != before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_cuda_graph_survives_reload(pair):
    a, b = pair
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    engine = Engine.from_pretrained(a, max_batch_size=2, max_seq_len=32, device="cuda")
    before = greedy(engine, prompts, 6)
    graphs, snap = dict(engine.graphs), _snapshot(engine.model)
    engine.reload_weights(b)
    _assert_in_place(engine.model, snap)
    after = greedy(engine, prompts, 6)
    assert engine.graphs == graphs and engine.captures == 1  # the same graph objects, none recaptured
    fresh = Engine.from_pretrained(b, max_batch_size=2, max_seq_len=32, device="cuda")
    assert after == greedy(fresh, prompts, 6) and after != before


def test_engine_kv_cache_matches_full_recompute(pair):
    from layerwise.demo import greedy_tokens

    a, _ = pair
    engine = Engine.from_pretrained(a, max_batch_size=2, max_seq_len=32)
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    assert greedy(engine, prompts, 5) == [greedy_tokens(engine.model, p, 5) for p in prompts]


@pytest.mark.parametrize("name", ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"])
def test_kernel_format_reload_rejects_non_finite_and_changes_nothing(pair, name):
    a, _ = pair
    model = layerwise.load_model(a)
    before = model_digest(model)
    t = model.state_dict()[name].clone()
    if t.dtype == torch.float8_e4m3fn:  # e4m3fn has NaN only: bits S.1111.111
        t.view(torch.uint8)[0, 3] = 0x7F
    else:
        t.view(-1)[2] = float("inf")
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, [(name, t)], is_checkpoint_format=False)
    assert isinstance(e.value.cause, layerwise.NonFiniteWeightError) and e.value.key == name
    assert model_digest(model) == before


@pytest.mark.parametrize("atomic", [True, False])
def test_kernel_format_reload_rejects_a_tensor_sent_twice(pair, atomic):
    """The same name twice in one kernel-format reload is an error (as in a weight update), not two writes: atomic,
    nothing changes; otherwise only the first copy was written, and the error lists it."""
    a, b = pair
    model = layerwise.load_model(a)
    before = model_digest(model)
    name = "model.layers.0.mlp.down_proj.weight"
    new = layerwise.load_model(b).state_dict()[name]
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, [(name, new), (name, new)], is_checkpoint_format=False, atomic=atomic)
    assert isinstance(e.value.cause, layerwise.DuplicateWeightError) and e.value.key == name
    assert e.value.updated_modules == ([] if atomic else [name])
    if atomic:
        assert model_digest(model) == before
    else:
        assert torch.equal(_bytes(model.state_dict()[name]), _bytes(new))


@pytest.mark.parametrize("atomic", [True, False])
def test_a_failure_inside_finalize_names_what_it_wrote_and_closes_the_session(pair, atomic, monkeypatch):
    """finalize commits staged modules (atomic) one by one; if that fails midway (a device error in copy_), the
    error names every module written so far, the rest keep A's values, nothing stays on meta, and the model
    takes the next reload."""
    import layerwise.reload.session as session_module

    a, b = pair
    model = layerwise.load_model(a)
    close, calls = session_module._close, []

    def failing_close(info):  # finalize's third module fails; the abort that follows closes the rest normally
        if len(calls) < 3:
            calls.append(info.prefix)
            if len(calls) == 3:
                raise RuntimeError("device lost")
        close(info)

    monkeypatch.setattr(session_module, "_close", failing_close)
    with pytest.raises(layerwise.ReloadError, match="RuntimeError: device lost") as e:
        layerwise.reload_weights(model, b, atomic=atomic)
    monkeypatch.undo()
    updated = e.value.updated_modules
    assert calls[:2] == updated[:2] and calls[2] in updated  # the third was committed, then its close failed
    if atomic:
        assert updated == calls  # nothing but what finalize reached
    assert all(t.device.type != "meta" for t in model.parameters())
    ref_a, ref_b = layerwise.load_model(a).state_dict(), layerwise.load_model(b).state_dict()
    for name, t in model.named_parameters():  # deduplicated: a tied lm_head is embed_tokens
        expected = ref_b if name.rsplit(".", 1)[0] in updated else ref_a
        assert torch.equal(_bytes(t), _bytes(expected[name])), name
    layerwise.reload_weights(model, b)  # the session was closed
    _assert_same_bytes(model, layerwise.load_model(b))
