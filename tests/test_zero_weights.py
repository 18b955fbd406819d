"""All-zero rows, an all-zero 128 x 128 block and an all-zero tensor: finite outputs, or an error naming the module
and the scheme, for every scheme that runs on the CPU, in a first load and in a reload (atomic: nothing written).

Layerwise's own FP8 schemes give an all-zero group the scale 1 (kernels/reference.py ``scale_from_amax``), so its
bytes are zeros and its outputs exactly zero; torchao's float8 gives it the scale 0 and NaN bytes, which layerwise
refuses (quant/torchao.py Limitations 6); torchao's int8 / intx configs clamp their scales and stay finite.
Checkpoints are written with safetensors directly (no transformers import: the file runs in seconds).
"""

import functools
import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

import layerwise
import layerwise.api as api
import layerwise.quant.torchao as quant_torchao
from layerwise.errors import NonFiniteWeightError, ReloadError
from layerwise.kernels import cpu_native, fp8_quantize, fp8_scale, reference

tq = pytest.importorskip("torchao.quantization")

FP8_SCHEMES = ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"]
GRANULARITY = {"fp8-per-tensor": "tensor", "fp8-per-channel": "channel", "fp8-per-block": "block"}
# every torchao config that quantize_ runs on the CPU with torchao 0.18, default arguments (as quant/config.py makes
# them); Float8DynamicActivationFloat8WeightConfig needs CUDA sm89+, Int4WeightOnlyConfig mslk
TORCHAO = [
    "torchao:Float8WeightOnlyConfig",
    "torchao:Int8WeightOnlyConfig",
    "torchao:Int8DynamicActivationInt8WeightConfig",
    "torchao:IntxWeightOnlyConfig",
    "torchao:Int8DynamicActivationIntxWeightConfig",
]
SCHEMES = ["none", *FP8_SCHEMES, *TORCHAO]
CASES = ["rows", "block", "tensor"]
# torchao's per-row float8: an all-zero row (and so an all-zero tensor) gets the scale 0 and NaN bytes
REFUSED = {("torchao:Float8WeightOnlyConfig", "rows"), ("torchao:Float8WeightOnlyConfig", "tensor")}

H, INTER, V, HEADS, KV, HEAD_DIM = 256, 384, 64, 4, 2, 64
MODULE = "model.layers.0.mlp.down_proj"  # [H, INTER] = [256, 384]: 2 x 3 blocks of 128 x 128, not fused
KEY = MODULE + ".weight"
ZERO_ROWS = [3, 130]
ZERO_BLOCK = (slice(128, 256), slice(128, 256))


def _config(moe: bool) -> dict:
    config = {
        "architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if moe else "qwen3",
        "hidden_size": H,
        "intermediate_size": INTER,
        "num_hidden_layers": 1,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV,
        "head_dim": HEAD_DIM,
        "vocab_size": V,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    if moe:  # layer 0 is an MoE layer of 4 experts [128, H]
        config |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "mlp_only_layers": []}
        config |= {"decoder_sparse_step": 1, "norm_topk_prob": True}
    return config


@functools.cache
def _tensors(seed: int, moe: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's random BF16 tensors by name (cached: copy before changing one)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, mean=0.0, std=0.05):
        return (torch.randn(shape, generator=g) * std + mean).bfloat16()

    p = "model.layers.0."
    t = {"model.embed_tokens.weight": rand(V, H, std=1.0), "lm_head.weight": rand(V, H), "model.norm.weight": rand(H)}
    for name, n in (("q_proj", HEADS * HEAD_DIM), ("k_proj", KV * HEAD_DIM), ("v_proj", KV * HEAD_DIM)):
        t[f"{p}self_attn.{name}.weight"] = rand(n, H)
    t[f"{p}self_attn.o_proj.weight"] = rand(H, HEADS * HEAD_DIM)
    for name in ("self_attn.q_norm", "self_attn.k_norm"):
        t[f"{p}{name}.weight"] = rand(HEAD_DIM, mean=1.0, std=0.2)
    for name in ("input_layernorm", "post_attention_layernorm"):
        t[f"{p}{name}.weight"] = rand(H, mean=1.0, std=0.2)
    if not moe:
        t[f"{p}mlp.gate_proj.weight"], t[f"{p}mlp.up_proj.weight"] = rand(INTER, H), rand(INTER, H)
        t[KEY] = rand(H, INTER)
        return t
    t[f"{p}mlp.gate.weight"] = rand(4, H, std=1.0)
    for e in range(4):
        for name, shape in (("gate_proj", (128, H)), ("up_proj", (128, H)), ("down_proj", (H, 128))):
            t[f"{p}mlp.experts.{e}.{name}.weight"] = rand(*shape)
    return t


def _zeroed(w: torch.Tensor, case: str) -> torch.Tensor:
    w = w.clone()
    if case == "rows":
        w[ZERO_ROWS] = 0
    elif case == "block":
        w[ZERO_BLOCK] = 0
    else:
        w.zero_()
    return w


def _write(path, tensors: dict, moe: bool = False):
    path.mkdir()
    (path / "config.json").write_text(json.dumps(_config(moe)))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"clean": A, case: A's seed-1 sibling whose down_proj has the case's zeros} (dense, one decoder layer)."""
    root = tmp_path_factory.mktemp("zero-weights")
    out = {"clean": _write(root / "clean", _tensors(0))}
    for case in CASES:
        t = dict(_tensors(1))
        t[KEY] = _zeroed(t[KEY], case)
        out[case] = _write(root / case, t)
    return out


def _module(model: nn.Module, prefix: str = MODULE) -> nn.Module:
    return model.get_submodule(prefix)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if is_traceable_wrapper_subclass(t):
        return torch.cat([_bytes(getattr(t, n)) for n in t.__tensor_flatten__()[0]])
    return t.detach().reshape(-1).view(torch.uint8).clone()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: _bytes(t) for name, t in model.state_dict().items()}


def _finite(t: torch.Tensor) -> bool:
    if is_traceable_wrapper_subclass(t):
        return all(_finite(getattr(t, n)) for n in t.__tensor_flatten__()[0])
    return not reference.has_non_finite(t)


def _expand(scale: torch.Tensor, granularity: str, shape) -> torch.Tensor:
    if granularity == "tensor":
        return scale.reshape(())
    if granularity == "channel":
        return scale
    return scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]


def _torch_fp8(w: torch.Tensor, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's own float8 cast of w [N, K], independent of layerwise's kernels: amax / 448 per tensor / row / 128 x
    128 block, the scale 1 where a group is all zero; q = clamp(w.float() / scale, -448, 448) cast."""
    w = w.float()
    n, k = w.shape
    if granularity == "tensor":
        amax = w.abs().amax()
    elif granularity == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    else:
        padded = torch.zeros(-(-n // 128) * 128, -(-k // 128) * 128)
        padded[:n, :k] = w.abs()
        amax = padded.view(padded.shape[0] // 128, 128, -1, 128).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (w / _expand(scale, granularity, w.shape)).clamp(-448, 448).to(torch.float8_e4m3fn), scale


@functools.cache
def _torchao_reference(scheme: str, case: str) -> torch.Tensor:
    """torchao's own quantize_ of the case's weight on an nn.Linear (cached: each costs ~0.1 s)."""
    w = _zeroed(_tensors(1)[KEY], case)
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight = nn.Parameter(w.clone(), requires_grad=False)
    tq.quantize_(linear, getattr(tq, scheme.partition(":")[2])())
    return linear.weight.data


def _check_finite_and_exact(module: nn.Module, w: torch.Tensor, scheme: str, case: str) -> None:
    """The module's tensors are finite and equal the reference quantization of ``w`` (bf16 [N, K]); its forward is
    finite, equals the reference's, and is exactly zero in the outputs of all-zero rows."""
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(7)).bfloat16()
    for name, p in module.named_parameters(recurse=False):
        assert _finite(p), f"{scheme} {case}: {name} holds NaN"
    if scheme in FP8_SCHEMES:
        granularity = GRANULARITY[scheme]
        q, scale = _torch_fp8(w, granularity)
        got_scale = getattr(module, "weight_scale_inv" if granularity == "block" else "weight_scale")
        assert torch.equal(module.weight.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(got_scale.reshape(scale.shape), scale)
        want = x.float() @ (q.float() * _expand(scale, granularity, w.shape)).t()
    elif scheme == "none":
        assert torch.equal(module.weight, w)
        want = x.float() @ w.float().t()
    else:
        ref = _torchao_reference(scheme, case)
        assert torch.equal(_bytes(module.weight), _bytes(ref))
        want = nn.functional.linear(x, ref).float()
    with torch.no_grad():
        y = module(x).float()
    assert bool(torch.isfinite(y).all())
    torch.testing.assert_close(y, want, rtol=2e-2, atol=2e-2)
    if case == "rows":
        assert not y[:, ZERO_ROWS].any()
    if case == "tensor":
        assert not y.any()


def _refused(error: Exception, scheme: str) -> None:
    assert isinstance(error, NonFiniteWeightError) or isinstance(error.cause, NonFiniteWeightError)
    assert MODULE in str(error) and scheme in str(error), str(error)
    assert "scales are 0" in str(error)


@pytest.fixture(autouse=True)
def nothing_verified(monkeypatch):
    """Each test starts with no torchao chunk shape verified (quant/torchao.py Limitations 3), so that the first weight
    of a shape goes through quantize_, whatever ran before; a test that loads a model verifies its shapes."""
    monkeypatch.setattr(quant_torchao, "_VERIFIED", {})
    monkeypatch.setattr(quant_torchao, "_VERIFIED_PER_TENSOR", {})


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_first_load(checkpoints, scheme, case):
    w = _zeroed(_tensors(1)[KEY], case)
    if (scheme, case) in REFUSED:
        with pytest.raises(NonFiniteWeightError) as e:
            layerwise.load_model(checkpoints[case], quantization=scheme)
        _refused(e.value, scheme)
        return
    model = layerwise.load_model(checkpoints[case], quantization=scheme)
    _check_finite_and_exact(_module(model), w, scheme, case)


@pytest.mark.parametrize("case", ["rows", "tensor"])
def test_first_load_of_a_verified_shape_is_refused_too(checkpoints, case):
    """A per-row float8 weight of a shape already checked against torchao's bytes is quantized from its loaded tensors
    (quant/torchao.py Limitations 5): its zero scales are refused before its bytes are written."""
    scheme = "torchao:Float8WeightOnlyConfig"
    layerwise.load_model(checkpoints["clean"], quantization=scheme)  # verifies the shapes
    assert quant_torchao._VERIFIED
    with pytest.raises(NonFiniteWeightError) as e:
        layerwise.load_model(checkpoints[case], quantization=scheme)
    _refused(e.value, scheme)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    """(model, the torchao shapes its load verified) per scheme, loaded from the clean checkpoint; the reload tests of
    a scheme share the model."""
    cache = {}

    def get(scheme):
        if scheme not in cache:
            model = layerwise.load_model(checkpoints["clean"], quantization=scheme)
            cache[scheme] = model, dict(quant_torchao._VERIFIED)
        return cache[scheme]

    return get


# a list of the module's tensor (a partial reload: its loads are pieces, quantized where they lie, and without
# atomic written straight into the live tensors, quant/torchao.py Limitations 5), or the whole directory (every
# module: atomic changes none of them). torchao's int8 / intx configs take no pieces, so for them a directory
# processes the module as a list does, at four quantize_ calls (~0.5 s) more: left out. "unverified": a list after
# the per-row float8 shapes were forgotten, so the weight is assembled and quantized whole, not taken as pieces.
RELOADS = [
    pytest.param(scheme, case, source, atomic, id=f"{scheme}-{case}-{source}-{'atomic' if atomic else 'in-place'}")
    for scheme in SCHEMES
    for case in CASES
    for source, atomic in (("list", False), ("list", True), ("directory", True), ("unverified", False))
    if source == "list" or (source == "directory" and scheme not in TORCHAO[1:]) or scheme == TORCHAO[0]
]


@pytest.mark.parametrize(("scheme", "case", "source", "atomic"), RELOADS)
def test_reload(checkpoints, loaded, scheme, case, source, atomic, monkeypatch):
    model, verified = loaded(scheme)
    w = _zeroed(_tensors(1)[KEY], case)
    before = _state(model)
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    weights = checkpoints[case] if source == "directory" else [(KEY, w)]
    monkeypatch.setattr(quant_torchao, "_VERIFIED", {} if source == "unverified" else dict(verified))
    as_pieces = []  # whether torchao's per-row float8 took the weight as pieces (Limitations 5)
    real = quant_torchao.TorchaoLinearMethod._quantize_pieces
    monkeypatch.setattr(
        quant_torchao.TorchaoLinearMethod, "_quantize_pieces", lambda *a: as_pieces.append(1) or real(*a)
    )
    if (scheme, case) in REFUSED:
        with pytest.raises(ReloadError) as e:
            layerwise.reload_weights(model, weights, atomic=atomic)
        _refused(e.value, scheme)
        assert MODULE not in e.value.updated_modules and MODULE not in e.value.non_finite_modules
        after = _state(model)
        changed = {name for name in before if not torch.equal(before[name], after[name])}
        assert not any(name.startswith(MODULE + ".") for name in changed)  # nothing of it written
        if atomic:
            assert not changed and not e.value.updated_modules
        assert bool(as_pieces) == (source != "unverified")
        return
    layerwise.reload_weights(model, weights, atomic=atomic)
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == ptrs
    _check_finite_and_exact(_module(model), w, scheme, case)


def test_deferred_checks_name_the_module_and_scheme_and_write_nothing_when_atomic(checkpoints, monkeypatch):
    """A reload that checks on the device and reads the flags at finalize (Limitations 12, forced here on the CPU with
    the torch code instead of the native kernels) records torchao's NaN bytes and refuses them there."""
    monkeypatch.setattr(api, "_defers_checks", lambda model, stream: isinstance(stream, (list, tuple)))
    monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    scheme = "torchao:Float8WeightOnlyConfig"
    model = layerwise.load_model(checkpoints["clean"], quantization=scheme)
    before = _state(model)
    with pytest.raises(ReloadError) as e:
        layerwise.reload_weights(model, [(KEY, _zeroed(_tensors(1)[KEY], "rows"))], atomic=True)
    assert isinstance(e.value, NonFiniteWeightError) and not e.value.updated_modules
    assert f"{MODULE} ({scheme}) are finite: the quantization made the NaN or Inf" in str(e.value)
    after = _state(model)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_fp8_kernels_agree_bit_for_bit_on_zeros(granularity, case, native, monkeypatch):
    """The torch reference, the native C kernels and the Triton kernels (interpreted on the CPU) give an all-zero group
    the scale 1 and zero bytes, byte for byte the same."""
    if not native:
        monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    elif not cpu_native.available():
        pytest.skip("the _cpu_fp8 extension is not built")
    w = _zeroed(_tensors(1)[KEY], case)
    scale = fp8_scale(w, granularity, "torch")
    q = fp8_quantize(w, scale, "torch", within_range=True)
    want_q, want_scale = _torch_fp8(w, granularity)
    assert torch.equal(scale.reshape(want_scale.shape), want_scale)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    if native and cpu_native.available():  # the reference itself, not through the dispatch
        assert torch.equal(reference.scale_from_amax(reference.amax(w, granularity)), scale)
        assert torch.equal(reference.quantize(w, scale).view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("granularity", ["tensor", "channel", "block"])
def test_triton_kernels_agree_on_zeros(granularity):
    pytest.importorskip("triton")
    w = torch.zeros(256, 384, dtype=torch.bfloat16)
    w[:128, :128] = _tensors(1)[KEY][:128, :128]  # one block with values; zero rows, zero blocks, zero row blocks
    scale = fp8_scale(w, granularity, "triton")
    assert torch.equal(scale, fp8_scale(w, granularity, "torch"))
    assert torch.equal(
        fp8_quantize(w, scale, "triton").view(torch.uint8), fp8_quantize(w, scale, "torch").view(torch.uint8)
    )


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    """(clean, zeros) MoE checkpoints; in ``zeros`` expert 0's down_proj has all-zero rows, expert 1's an all-zero
    block, expert 2 is all zero (w13 and w2), expert 3 is untouched."""
    root = tmp_path_factory.mktemp("zero-experts")
    t = dict(_tensors(1, moe=True))
    p = "model.layers.0.mlp.experts."
    t[f"{p}0.down_proj.weight"] = _zeroed(t[f"{p}0.down_proj.weight"], "rows")
    t[f"{p}1.down_proj.weight"] = _zeroed(t[f"{p}1.down_proj.weight"], "block")
    for name in ("gate_proj", "up_proj", "down_proj"):
        t[f"{p}2.{name}.weight"] = _zeroed(t[f"{p}2.{name}.weight"], "tensor")
    return _write(root / "clean", _tensors(0, moe=True), moe=True), _write(root / "zeros", t, moe=True), t


@pytest.mark.parametrize("how", ["load", "reload-atomic", "reload-list"])
@pytest.mark.parametrize("scheme", FP8_SCHEMES)
def test_moe_experts(moe_checkpoints, scheme, how):
    clean, zeros, tensors = moe_checkpoints
    if how == "load":
        model = layerwise.load_model(zeros, quantization=scheme)
    else:
        model = layerwise.load_model(clean, quantization=scheme)
        stream = list(tensors.items()) if how == "reload-list" else zeros
        layerwise.reload_weights(model, stream, atomic=how == "reload-atomic")
    experts = _module(model, "model.layers.0.mlp.experts")
    granularity = GRANULARITY[scheme]
    suffix = "_weight_scale_inv" if granularity == "block" else "_weight_scale"
    for e in range(4):
        for param, names in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
            w = torch.cat([tensors[f"model.layers.0.mlp.experts.{e}.{n}.weight"] for n in names])
            q, scale = _torch_fp8(w, granularity)
            got_q, got_scale = getattr(experts, f"{param}_weight")[e], getattr(experts, param + suffix)[e]
            assert torch.equal(got_q.view(torch.uint8), q.view(torch.uint8)), (param, e)
            assert torch.equal(got_scale.reshape(scale.shape), scale), (param, e)
    with torch.no_grad():
        assert bool(torch.isfinite(model(torch.arange(12).reshape(1, 12))).all())


def test_torchao_per_tensor_float8_refuses_an_all_zero_weight():
    """A config instance outside the scheme strings (per-tensor float8): its all-zero weight is refused too; its
    all-zero rows are finite (the one scale is not 0)."""
    from layerwise.quant.torchao import TorchaoLinearMethod

    method = TorchaoLinearMethod(tq.Float8WeightOnlyConfig(granularity=tq.PerTensor()))
    for case in CASES:
        layer = nn.Module()
        layer.weight = nn.Parameter(_zeroed(_tensors(1)[KEY], case), requires_grad=False)
        if case != "tensor":
            method.process_weights_after_loading(layer)
            assert _finite(layer.weight)
            continue
        with pytest.raises(NonFiniteWeightError, match="torchao:Float8WeightOnlyConfig .* 1 of its 1 scales are 0"):
            method.process_weights_after_loading(layer)


def test_the_float8_nan_test_finds_both_nan_bytes():
    """float8_e4m3fn's NaNs are 0x7F and 0xFF (S.1111.111), found by ``non_finite_flag`` (two max reductions: the
    largest int8 and the largest uint8) alone, among other bytes, and in a strided view."""
    for byte in range(256):
        t = torch.tensor([0, 0x7E, byte, 0xFE, 1], dtype=torch.uint8).view(torch.float8_e4m3fn)
        want = byte in (0x7F, 0xFF)
        assert bool(reference.non_finite_flag(t)) == want == bool(reference.non_finite_flag(t[2:3])), byte
    grid = torch.zeros(4, 6, dtype=torch.uint8)
    grid[1, 5] = 0xFF
    f8 = grid.view(torch.float8_e4m3fn)
    assert bool(reference.non_finite_flag(f8.t())) and not bool(reference.non_finite_flag(f8[:, :5]))
    assert not bool(reference.non_finite_flag(f8[:0]))
