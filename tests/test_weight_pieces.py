"""A weight quantized from the loaded tensors themselves (its verbatim loads) equals the assembled weight's."""

import pytest
import torch

import layerwise
from layerwise.errors import NonFiniteWeightError
from layerwise.kernels import (
    GRANULARITIES,
    cpu_native,
    fp8_quantize_pieces,
    fp8_quantize_pieces_batch,
    fp8_scale_pieces_batch,
    pieces_fit,
)
from layerwise.quant.parameters import ModelWeightParameter, default_weight_loader
from layerwise.reload.counting import record_loader
from tests.hf_checkpoints import write_hf_checkpoint
from tests.moe_helpers import torch_fp8_reference

FP8 = torch.float8_e4m3fn


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


# rows per piece, with different magnitudes so the amax lies in one piece: block-aligned cuts with a ragged last
# block; and cuts inside 128-row blocks (rows 128-255 are shared by three pieces), as an expert's gate and up
# share one when the intermediate size is not a multiple of 128
ROW_SPLITS = {"aligned": [256, 384, 133], "inside-blocks": [200, 30, 410, 133]}


def _pieces(sizes, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    scales = [0.5, 3.0, 0.01, 1.0]
    parts = [(torch.randn(n, k, generator=g) * s).to(dtype) for n, s in zip(sizes, scales, strict=False)]
    offsets = [sum(sizes[:i]) * k for i in range(len(sizes))]
    return torch.cat(parts), list(zip(offsets, parts, strict=True))


@pytest.mark.parametrize("split", ROW_SPLITS)
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("out_fresh", [False, True], ids=["live-out", "fresh-out"])
def test_pieces_quantize_as_the_assembled_weight(split, granularity, dtype, out_fresh, monkeypatch):
    whole, pieces = _pieces(ROW_SPLITS[split], 300, dtype)
    assert pieces_fit(whole.shape, [(o, t.numel()) for o, t in pieces], granularity)
    one_pass = []
    if cpu_native.available():
        fused = cpu_native.scale_quantize
        monkeypatch.setattr(cpu_native, "scale_quantize", lambda *a: one_pass.append(1) or fused(*a))
    out = torch.zeros(whole.shape, dtype=FP8)
    scale = fp8_quantize_pieces(pieces, whole.shape, granularity, out, "torch", out_fresh=out_fresh)
    q, want = torch_fp8_reference(whole, granularity)  # torch's own cast, scales computed in the test helper
    assert torch.equal(scale.reshape(want.shape), want) and torch.equal(_bits(out), _bits(q))
    # a fresh output per channel: each piece in one native pass with its amax; never into a live output
    taken = out_fresh and granularity == "channel" and cpu_native.available()
    assert len(one_pass) == (len(pieces) if taken else 0)


@pytest.mark.parametrize("native", [True, False], ids=["native", "weight-by-weight"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_batch_of_weights_quantizes_as_each_assembled_weight(native, granularity, dtype, monkeypatch):
    if native and not cpu_native.available():
        pytest.skip("the _cpu_fp8 extension is not built")
    if not native:
        monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    weights = [_pieces(sizes, 300, dtype, seed) for seed, sizes in enumerate([*ROW_SPLITS.values(), [773]])]
    outs = [torch.zeros(773, 300, dtype=FP8) for _ in weights]
    scales = fp8_scale_pieces_batch([p for _, p in weights], (773, 300), granularity, "torch")
    fp8_quantize_pieces_batch([p for _, p in weights], scales, (773, 300), granularity, outs, "torch")
    for (whole, _), out, scale in zip(weights, outs, scales, strict=True):
        q, want = torch_fp8_reference(whole, granularity)
        assert torch.equal(scale.reshape(want.shape), want) and torch.equal(_bits(out), _bits(q))


@pytest.mark.parametrize("native", [True, False], ids=["native", "weight-by-weight"])
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_a_non_finite_weight_in_a_batch_is_named_by_its_scales(native, granularity, monkeypatch):
    if native and not cpu_native.available():
        pytest.skip("the _cpu_fp8 extension is not built")
    if not native:
        monkeypatch.setattr(cpu_native, "_cpu_fp8", None)
    weights = [_pieces(ROW_SPLITS["inside-blocks"], 64, torch.bfloat16, seed)[1] for seed in range(3)]
    weights[2][1][1][7, 3] = float("inf")
    with pytest.raises(NonFiniteWeightError, match="weight 2 of the batch" if native else "NaN or Inf"):
        fp8_scale_pieces_batch(weights, (773, 64), granularity, "torch")


def test_the_native_batch_refuses_a_piece_outside_its_weight():
    if not cpu_native.available():
        pytest.skip("the _cpu_fp8 extension is not built")
    out, one = torch.zeros(8, 4, dtype=FP8), torch.ones(1)
    with pytest.raises(ValueError, match="not whole rows"):
        cpu_native.amax_batch([[(0, torch.ones(4, 4)), (20, torch.ones(4, 4))]], (8, 4), "channel")
    with pytest.raises(ValueError, match="not whole rows"):
        cpu_native.quantize_batch([[(2, torch.ones(8, 4))]], one, (8, 4), "tensor", [out])
    # the kernels read and write raw pointers: one dtype for every piece, contiguous float8 outputs, scales that fit
    mixed = [[(0, torch.ones(8, 4))], [(0, torch.ones(8, 4, dtype=torch.bfloat16))]]
    with pytest.raises(ValueError, match="one bfloat16 or float32 dtype"):
        cpu_native.amax_batch(mixed, (8, 4), "tensor")
    strided = torch.zeros(8, 8, dtype=FP8)[:, :4]
    with pytest.raises(ValueError, match="contiguous float8"):
        cpu_native.quantize_batch([[(0, torch.ones(8, 4))]], one, (8, 4), "tensor", [strided])
    with pytest.raises(ValueError, match="scales"):
        cpu_native.quantize_batch([[(0, torch.ones(8, 4))]], torch.ones(8, 1), (8, 4), "tensor", [out])
    assert not _bits(out).any() and not _bits(strided.contiguous()).any()


def test_pieces_fit_whole_rows_only():
    shape, k = (640, 300), 300
    assert pieces_fit(shape, [(0, 7), (7, 640 * 300 - 7)], "tensor")
    assert not pieces_fit(shape, [(0, 7), (7, 640 * 300 - 7)], "channel")
    assert not pieces_fit(shape, [(0, 7), (7, 640 * 300 - 7)], "block")
    assert pieces_fit(shape, [(0, 64 * k), (64 * k, 576 * k)], "channel")
    assert pieces_fit(shape, [(0, 64 * k), (64 * k, 576 * k)], "block")  # 64 rows: half a block, shared


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("out_fresh", [False, True], ids=["live-out", "fresh-out"])
def test_a_non_finite_piece_raises_before_any_write(granularity, out_fresh):
    parts = [torch.ones(128, 64), torch.ones(128, 64)]
    parts[1][100, 3] = float("nan")
    out = torch.zeros(256, 64, dtype=FP8)
    with pytest.raises(NonFiniteWeightError):
        pieces = [(0, parts[0]), (128 * 64, parts[1])]
        fp8_quantize_pieces(pieces, (256, 64), granularity, out, "torch", out_fresh=out_fresh)
    if not out_fresh:  # a fresh output may hold a partial result: the load that made it fails
        assert not _bits(out).any()


def test_record_loader_finds_verbatim_copies_only():
    meta = ModelWeightParameter(torch.empty(8, 4, device="meta"), default_weight_loader, output_dim=0, input_dim=1)

    def shard(param, loaded, shard_id):  # rows [4, 8): a verbatim copy into a contiguous region
        param.load_shard(loaded, shard_offset=4, shard_size=4)

    def tp_rank1(param, loaded, shard_id):  # rank 1 of 2: narrows the loaded tensor first
        param.load_shard(loaded, shard_offset=0, shard_size=8, tp_rank=1, tp_size=2)

    def columns(param, loaded, shard_id):  # columns [0, 2) of every row: not one contiguous region
        param.data.narrow(1, 0, 2).copy_(loaded)

    assert record_loader(default_weight_loader, meta, torch.ones(8, 4), None)[1] == 0
    assert record_loader(shard, meta, torch.ones(4, 4), None)[1] == 16
    assert record_loader(default_weight_loader, meta, torch.ones(8, 4, dtype=torch.bfloat16), None)[1] is None  # cast
    assert record_loader(tp_rank1, meta, torch.ones(16, 4), None)[1] is None
    assert record_loader(columns, meta, torch.ones(8, 2), None)[1] is None
    assert record_loader(default_weight_loader, meta, torch.ones(4, 8).t(), None)[1] is None  # not contiguous


@pytest.mark.parametrize("scheme", ["fp8-per-tensor", "fp8-per-channel", "fp8-per-block"])
def test_float32_checkpoint_is_cast_through_staging(tmp_path, scheme):
    # a float32 checkpoint whose values are not bfloat16 values: its loads cast to the model's bf16, so they are
    # not verbatim and are staged; the bytes equal a load of the same weights rounded to bf16 and stored so
    from safetensors.torch import load_file, save_file

    src = write_hf_checkpoint(tmp_path / "src", "Qwen3ForCausalLM", seed=3, num_layers=2, hidden=128, intermediate=256)
    f32, bf16 = tmp_path / "f32", tmp_path / "bf16"
    g = torch.Generator().manual_seed(4)
    for folder in (f32, bf16):
        folder.mkdir()
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            for folder in (f32, bf16):
                (folder / path.name).write_bytes(path.read_bytes())
            continue
        wide = {k: v.float() * (1 + torch.rand(v.shape, generator=g) * 2**-9) for k, v in load_file(path).items()}
        save_file(wide, f32 / path.name, metadata={"format": "pt"})
        save_file({k: v.bfloat16() for k, v in wide.items()}, bf16 / path.name, metadata={"format": "pt"})
    a = layerwise.load_model(bf16, quantization=scheme, dtype=torch.bfloat16).state_dict()
    b = layerwise.load_model(f32, quantization=scheme, dtype=torch.bfloat16).state_dict()
    for name, t in a.items():
        assert torch.equal(_bits(t), _bits(b[name])), name


def test_a_loader_that_also_scales_in_place_is_not_verbatim():
    meta = ModelWeightParameter(torch.empty(8, 4, device="meta"), default_weight_loader, output_dim=0, input_dim=1)

    def copy_then_scale(param, loaded, shard_id):  # the copy is whole, but the loader changes the values after
        param.data.copy_(loaded)
        param.data.mul_(2)

    assert record_loader(copy_then_scale, meta, torch.ones(8, 4), None)[1] is None


def test_native_kernels_refuse_fake_parameters():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from layerwise.kernels import cpu_native, has_non_finite

    with FakeTensorMode():
        p = torch.nn.Parameter(torch.empty(4, 4, dtype=torch.bfloat16))
        assert not cpu_native.supports(p)  # its data_ptr is 0: the C kernel would read address 0
        with pytest.raises(Exception):  # noqa: B017 - whatever the reference raises, not a crash
            has_non_finite(p)


def test_a_failure_after_writing_into_the_live_weight_reports_the_module(tmp_path, monkeypatch):
    import layerwise.quant.fp8 as fp8

    a = write_hf_checkpoint(tmp_path / "a", "Qwen3ForCausalLM", seed=0, num_layers=2)
    b = write_hf_checkpoint(tmp_path / "b", "Qwen3ForCausalLM", seed=1, num_layers=2)
    model = layerwise.load_model(a, quantization="fp8")
    original = fp8.Fp8LinearMethod.process_weights_after_loading

    def fails_midway(self, layer, into=None, weight_pieces=None):
        if into is not None and layer is model.model.layers[1].mlp.gate_up_proj:
            into["weight"].data.view(torch.uint8).fill_(0x11)  # half of a two-piece quantization written
            raise MemoryError("out of host memory")
        return original(self, layer, into=into, weight_pieces=weight_pieces)

    monkeypatch.setattr(fp8.Fp8LinearMethod, "process_weights_after_loading", fails_midway)
    with pytest.raises(layerwise.ReloadError) as e:
        layerwise.reload_weights(model, b)
    assert "model.layers.1.mlp.gate_up_proj" in e.value.updated_modules
    assert isinstance(e.value.cause, MemoryError)


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_pieces_inside_blocks_on_the_triton_kernels(granularity):
    # the path a CUDA stream takes (its tensors on the session's device), here under the interpreter: rows
    # 128-255 shared by three pieces, a ragged last block
    pytest.importorskip("triton")
    whole, pieces = _pieces([200, 30, 40], 64, torch.bfloat16)
    out = torch.zeros(whole.shape, dtype=FP8)
    scale = fp8_quantize_pieces(pieces, whole.shape, granularity, out, "triton")
    q, want = torch_fp8_reference(whole, granularity)
    assert torch.equal(scale.reshape(want.shape), want) and torch.equal(_bits(out), _bits(q))
