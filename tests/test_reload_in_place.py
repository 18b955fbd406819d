"""A non-atomic reload writes the live tensors directly: loads replayed into unquantized modules' kernel
tensors, FP8 bytes quantized into the live weight; what that overwrote is reported when a check then fails."""

import pytest
import torch

import layerwise
from layerwise.api import model_digest
from layerwise.kernels import cpu_native
from layerwise.reload import staging_bytes


@pytest.fixture
def pair(qwen3_pair):
    return qwen3_pair


def _bytes(t):
    return t.detach().reshape(-1).view(torch.uint8)


def _with_nan(name):
    def stream(path):
        for key, t in layerwise.checkpoint.Checkpoint(path):
            yield (
                key,
                (
                    t.clone().view(-1).index_fill_(0, torch.tensor([5]), float("nan")).view(t.shape)
                    if key == name
                    else t
                ),
            )

    return stream


@pytest.fixture(params=[True, False], ids=["copied-and-checked-natively", "replayed-then-checked"])
def native_copies(request, monkeypatch):
    """Whether a BF16 module's verbatim loads are copied by the native kernel that also checks them (one pass),
    or replayed by its loaders and checked after (no extension); counts the native copies."""
    copies = []
    if not request.param:
        monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    elif not cpu_native.available():
        pytest.skip("the _cpu_fp8 extension is not built")
    real = cpu_native.copy_checked
    monkeypatch.setattr(cpu_native, "copy_checked", lambda src, dst: copies.append(src.numel()) or real(src, dst))
    return copies


def test_unquantized_reload_replays_loads_into_the_live_tensors(pair, native_copies):
    a, b = pair
    model = layerwise.load_model(a, quantization=None)
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    layerwise.reload_weights(model, b)
    # natively: every checkpoint tensor, each copied once (tied embeddings: one module, one tensor)
    assert sum(native_copies) == (sum(p.numel() for p in model.parameters()) if cpu_native.available() else 0)
    assert staging_bytes(model) == 0  # nothing was staged: every module's loads went straight into its tensors
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    fresh = layerwise.load_model(b, quantization=None).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_bytes(t), _bytes(fresh[name])), name


def test_nan_in_an_unquantized_module_is_reported_as_written(pair, native_copies):
    a, b = pair
    key = "model.layers.2.mlp.up_proj.weight"
    model = layerwise.load_model(a, quantization=None)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _with_nan(key)(b))
    # the module's loads were written into the live tensor before its finiteness check: it is reported updated
    assert "model.layers.2.mlp.gate_up_proj" in e.value.updated_modules
    assert isinstance(e.value.cause, layerwise.NonFiniteWeightError) and e.value.key == key
    assert torch.isnan(model.model.layers[2].mlp.gate_up_proj.weight).any()
    # atomic: staged, so nothing is written
    model = layerwise.load_model(a, quantization=None)
    before = model_digest(model)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _with_nan(key)(b), atomic=True)
    assert e.value.updated_modules == [] and model_digest(model) == before


@pytest.mark.parametrize("scheme", ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"])
def test_fp8_reload_quantizes_into_the_live_weight(pair, scheme, monkeypatch):
    import layerwise.kernels as kernels
    import layerwise.quant.fp8 as fp8

    a, b = pair
    model = layerwise.load_model(a, quantization=scheme)
    live = {p.data_ptr(): p.numel() for n, p in model.named_parameters() if p.dtype == torch.float8_e4m3fn}
    targets = []
    quantize = kernels.fp8_quantize

    def recording(w, scale, kernel="torch", **kwargs):
        q = quantize(w, scale, kernel, **kwargs)
        targets.append((q.data_ptr(), q.numel()))
        return q

    monkeypatch.setattr(kernels, "fp8_quantize", recording)  # the pieces' quantize
    monkeypatch.setattr(fp8, "fp8_quantize", recording)  # a materialized weight's
    layerwise.reload_weights(model, b)
    # every FP8 weight written where it lives, none into a new tensor: each write lies inside one live weight,
    # and together they cover every live weight
    written = dict.fromkeys(live, 0)
    for ptr, numel in targets:
        base = next(p for p, n in live.items() if p <= ptr and ptr + numel <= p + n)
        written[base] += numel
    assert written == live
    fresh = layerwise.load_model(b, quantization=scheme).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_bytes(t), _bytes(fresh[name])), name
    # a NaN is found by the amax, before the live weight is written (not even its other rows, which a first load
    # may quantize in the amax's pass): not reported as updated, every byte as it was
    gate_up = model.model.layers[2].mlp.gate_up_proj
    before = {n: _bytes(t).clone() for n, t in gate_up.state_dict().items()}
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, _with_nan("model.layers.2.mlp.up_proj.weight")(a))
    assert "model.layers.2.mlp.gate_up_proj" not in e.value.updated_modules
    assert all(torch.equal(_bytes(t), before[n]) for n, t in gate_up.state_dict().items())


def test_loader_writes_are_recorded_once_per_distinct_call(pair, monkeypatch):
    import layerwise.reload.buffering as buffering

    a, b = pair
    model = layerwise.load_model(a)
    calls = []
    record = buffering.record_loader
    monkeypatch.setattr(buffering, "record_loader", lambda *args: calls.append(1) or record(*args))
    layerwise.reload_weights(model, b)
    assert calls == []  # the load recorded every (parameter, shape, dtype, shard) the reload brings
    # a double write is still caught: coverage is computed from the recorded writes each time. (A stream's
    # tensors have strides where the directory's lazy ones had none: a new key, recorded once, then reused.)
    twice = [(k, t) for k, t in layerwise.checkpoint.Checkpoint(b) if k.endswith("layers.1.mlp.up_proj.weight")] * 2
    with pytest.raises(layerwise.ReloadError, match="written again|double write"):
        layerwise.reload_weights(model, twice)
    assert calls == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("scheme", [None, "fp8-per-tensor", "fp8-per-channel", "fp8-per-block"])
@pytest.mark.parametrize("source", ["dir", "cpu stream", "cuda stream"])
def test_cuda_reload_in_place_equals_fresh_load(pair, scheme, source):
    # the CUDA side of this file: BF16 modules loaded into their live tensors, FP8 written into the live weight
    # (Triton, then a copy), pieces where the loaded tensors are on the session's device; byte-equal to a fresh
    # CUDA load of the same weights, every data_ptr kept
    a, b = pair
    model = layerwise.load_model(a, quantization=scheme, device="cuda")
    ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    if source == "dir":
        weights = b
    else:
        device = "cpu" if source == "cpu stream" else "cuda"
        weights = [(k, t.to(device)) for k, t in layerwise.checkpoint.Checkpoint(b)]
    layerwise.reload_weights(model, weights)
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == ptrs
    fresh = layerwise.load_model(b, quantization=scheme, device="cuda").state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(_bytes(t), _bytes(fresh[name])), name
