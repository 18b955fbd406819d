"""Row-chunked torchao quantization equals torchao's own ``quantize_`` of the whole nn.Linear, byte for byte."""

import pytest
import torch
from torch import nn

import layerwise.quant.torchao as quant_torchao
from layerwise.errors import NonFiniteWeightError
from layerwise.quant.torchao import ROW_ALIGN, TorchaoLinearMethod

tq = pytest.importorskip("torchao.quantization")

# every config quant/torchao.py chunks or the README lists that runs on CPU with torchao 0.18
CPU_CONFIGS = [
    "Float8WeightOnlyConfig",
    "Int8WeightOnlyConfig",
    "Int8DynamicActivationInt8WeightConfig",
    "IntxWeightOnlyConfig",
    "Int8DynamicActivationIntxWeightConfig",
]
K = 96
CHUNK_NUMEL = 2 * ROW_ALIGN * K  # 32-row chunks


def reference(weight: torch.Tensor, config) -> torch.Tensor:
    """torchao's quantize_ on an nn.Linear holding ``weight``, written here independently of the module."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight.clone(), requires_grad=False)
    tq.quantize_(linear, config)
    return linear.weight.data


def assert_same_bytes(got: torch.Tensor, want: torch.Tensor) -> None:
    assert type(got) is type(want)
    if not hasattr(want, "__tensor_flatten__"):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        return
    names, ctx = want.__tensor_flatten__()
    got_names, got_ctx = got.__tensor_flatten__()
    assert got_names == names and got_ctx == ctx and got.shape == want.shape
    for name in names:
        g, w = getattr(got, name), getattr(want, name)
        if hasattr(w, "__tensor_flatten__"):  # a nested subclass (torchao's AffineQuantizedTensor's tensor_impl)
            _assert_same_inner(g, w)
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), name
    # bytes: torchao turns an all-zero row into NaN (0 / a zero scale) in float8, the same in both
    assert torch.equal(got.dequantize().view(torch.uint8), want.dequantize().view(torch.uint8))


def _assert_same_inner(got, want) -> None:
    assert type(got) is type(want)
    names, ctx = want.__tensor_flatten__()
    assert got.__tensor_flatten__() == (names, ctx)
    for name in names:
        g, w = getattr(got, name), getattr(want, name)
        if hasattr(w, "__tensor_flatten__"):
            _assert_same_inner(g, w)
        else:
            assert g.dtype == w.dtype and g.shape == w.shape, name
            assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)), name


@pytest.fixture(autouse=True)
def nothing_verified(monkeypatch):
    """Each test starts with no chunk shape verified (Limitations 3 and 4), so the first chunk goes through
    torchao."""
    monkeypatch.setattr(quant_torchao, "_VERIFIED", {})
    monkeypatch.setattr(quant_torchao, "_VERIFIED_PER_TENSOR", {})


@pytest.fixture
def calls(monkeypatch):
    """The row count of every quantize_whole call the method makes."""
    seen = []
    real = quant_torchao.quantize_whole

    def spy(weight, config):
        seen.append(weight.shape[0])
        return real(weight, config)

    monkeypatch.setattr(quant_torchao, "quantize_whole", spy)
    return seen


def weight(n: int, seed: int = 0, k: int = K, zero_rows: bool = True) -> torch.Tensor:
    """zero_rows=False for a weight that process_weights_after_loading takes: its check refuses the NaN bytes that
    torchao's float8 makes of an all-zero row (Limitations 6; tests/test_zero_weights.py)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)  # rows of different scales
    if zero_rows:
        w[[3, 100 % n]] = 0  # all-zero rows, in the first chunk and in a later one
    w[50 % n, :7] = torch.tensor([448.0, -448.0, 0.0, -0.0, 1e-30, 3e38, -3e38])  # extremes (float32 range)
    return w.bfloat16()


@pytest.mark.parametrize("name", CPU_CONFIGS)
@pytest.mark.parametrize("n", [8 * 32, 8 * 32 + 24])  # whole chunks; a last chunk of 24 rows
def test_row_chunks_equal_quantize_of_the_whole_linear(name, n, calls):
    w = weight(n)
    method = TorchaoLinearMethod(name, chunk_numel=CHUNK_NUMEL)
    got = method.quantize_rows(w)
    assert_same_bytes(got, reference(w, getattr(tq, name)()))
    assert max(calls) <= 32 < n, calls  # it was chunked, and never quantized whole


@pytest.mark.parametrize("n", [8 * 32, 8 * 32 + 24])
@pytest.mark.parametrize(
    "name", ["Float8WeightOnlyConfig", "Int8WeightOnlyConfig", "Int8DynamicActivationInt8WeightConfig"]
)
def test_rows_after_the_first_chunk_are_quantized_without_quantize_(name, n, calls):
    """Limitations 3: torchao quantizes the first chunk (and a shorter last one), the local arithmetic the rest."""
    w = weight(n)
    got = TorchaoLinearMethod(name, chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, getattr(tq, name)()))
    assert calls == [32] + ([n % 32] if n % 32 else []), calls


@pytest.mark.parametrize("name", ["Float8WeightOnlyConfig", "Int8WeightOnlyConfig"])
def test_a_second_weight_of_a_verified_shape_needs_no_quantize_(name, calls):
    method = TorchaoLinearMethod(name, chunk_numel=CHUNK_NUMEL)
    method.quantize_rows(weight(8 * 32 + 24))
    calls.clear()
    w = weight(8 * 32 + 24, seed=1)
    got = TorchaoLinearMethod(name, chunk_numel=CHUNK_NUMEL).quantize_rows(w)  # a new method, as for each layer
    assert_same_bytes(got, reference(w, getattr(tq, name)()))
    assert calls == []
    assert got.block_size is not method.quantize_rows(w).block_size  # no list shared between weights
    w[100, 1] = float("nan")
    with pytest.raises(NonFiniteWeightError):
        method.quantize_rows(w)
    other = TorchaoLinearMethod(name, chunk_numel=CHUNK_NUMEL).quantize_rows(weight(8 * 32))  # another shape
    assert calls == [32] and other.shape == (8 * 32, K)


@pytest.mark.parametrize("name", ["Float8WeightOnlyConfig", "Int8WeightOnlyConfig"])
def test_float32_weights_take_the_local_path_too(name, calls):
    w = weight(8 * 32).float() * 1e-3  # float32 scales: amax / 448 in float32
    got = TorchaoLinearMethod(name, chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, getattr(tq, name)()))
    assert calls == [32]


def test_int8_reduce_range_takes_the_local_path(calls):
    config = tq.Int8DynamicActivationInt8WeightConfig(reduce_range=True)
    w = weight(8 * 32)
    got = TorchaoLinearMethod(config, chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Int8DynamicActivationInt8WeightConfig(reduce_range=True)))
    assert got.qdata.min() >= -64 and got.qdata.max() <= 63 and calls == [32]


def test_local_float8_bytes_that_differ_from_torchao_fall_back_to_quantize_(monkeypatch, calls, caplog):
    names, real = quant_torchao._LOCAL_ROWS["Float8Tensor"]

    def off_by_one_ulp(w, out, ctx, work):
        real(w, out, ctx, work)
        out["scale"].view(torch.int32).add_(1)

    monkeypatch.setattr(quant_torchao, "_LOCAL_ROWS", {"Float8Tensor": (names, off_by_one_ulp)})
    w = weight(8 * 32)
    got = TorchaoLinearMethod("Float8WeightOnlyConfig", chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Float8WeightOnlyConfig()))
    assert calls == [32] * 8 and "local scale differs from torchao" in caplog.text


@pytest.mark.parametrize("n", [8 * 32, 8 * 32 + 24])
def test_per_tensor_scales_are_computed_in_two_passes(n, calls):
    """Limitations 4: one amax over every row, then row chunks; torchao quantizes the first chunk (a check)."""
    config = tq.Float8WeightOnlyConfig(granularity=tq.PerTensor())
    w = weight(n)
    got = TorchaoLinearMethod(config, chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Float8WeightOnlyConfig(granularity=tq.PerTensor())))
    assert got.scale.numel() == 1 and calls == [32] + ([n % 32] if n % 32 else [])
    # a later weight of the shape: verified once per process, so torchao is not called again (no host read)
    calls.clear()
    w = weight(n, seed=1)
    got = TorchaoLinearMethod(config, chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Float8WeightOnlyConfig(granularity=tq.PerTensor())))
    assert calls == []
    w[n - 3, 5] = float("inf")
    with pytest.raises(NonFiniteWeightError):
        TorchaoLinearMethod(config, chunk_numel=CHUNK_NUMEL).quantize_rows(w)


def test_per_tensor_local_bytes_that_differ_send_the_weight_to_quantize_whole(monkeypatch, calls):
    real = quant_torchao._float8_per_tensor

    def off_by_one_ulp(w, qdata, scale, work):
        real(w, qdata, scale, work)
        scale.view(torch.int32).add_(1)

    monkeypatch.setattr(quant_torchao, "_float8_per_tensor", off_by_one_ulp)
    config = tq.Float8WeightOnlyConfig(granularity=tq.PerTensor())
    w = weight(8 * 32)
    got = TorchaoLinearMethod(config, chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Float8WeightOnlyConfig(granularity=tq.PerTensor())))
    assert calls == [32, 8 * 32]


def test_group_scales_are_chunked(calls):
    config = tq.Int8WeightOnlyConfig(granularity=tq.PerGroup(32))
    w = weight(8 * 32)
    got = TorchaoLinearMethod(config, chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Int8WeightOnlyConfig(granularity=tq.PerGroup(32))))
    assert got.scale.shape == (8 * 32, K // 32) and max(calls) == 32


def test_a_weight_of_one_chunk_is_quantized_whole(calls):
    w = weight(ROW_ALIGN)
    got = TorchaoLinearMethod("Float8WeightOnlyConfig", chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Float8WeightOnlyConfig()))
    assert calls == [ROW_ALIGN]


def skips_rows_not_multiple_of_16(real):
    """Like torchao's float8 dynamic-activation configs (torchao.quantization.utils._fp8_mm_compat): a weight
    whose dimensions are not multiples of 16 is returned unquantized."""

    def quantize(weight, config):
        return weight if weight.shape[0] % 16 or weight.shape[1] % 16 else real(weight, config)

    return quantize


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("n", [8 * 32, 8 * 32 + 16, 8 * 32 + 8, 18 * 8])
def test_plain_and_mixed_chunk_results_give_torchaos_whole_result(monkeypatch, n, granularity):
    """The crash of issue 14: torchao returned a plain tensor for a chunk (first, later or last)."""
    fake = skips_rows_not_multiple_of_16(quant_torchao.quantize_whole)
    monkeypatch.setattr(quant_torchao, "quantize_whole", fake)
    w = weight(n)

    # 18 rows per chunk asked for: chunks are rounded to 16 rows, so no chunk is skipped where the whole
    # weight is not (before the fix a first chunk of 18 rows came back plain and crashed)
    def config():
        return tq.Float8WeightOnlyConfig(granularity=tq.PerRow() if granularity == "row" else tq.PerTensor())

    got = TorchaoLinearMethod(config(), chunk_numel=18 * K).quantize_rows(w)
    want = w if n % 16 else reference(w, config())
    assert_same_bytes(got, want)


def test_a_plain_first_chunk_gives_the_plain_weight(monkeypatch):
    monkeypatch.setattr(quant_torchao, "quantize_whole", skips_rows_not_multiple_of_16(quant_torchao.quantize_whole))
    w = weight(8 * 32, k=100)
    got = TorchaoLinearMethod("Float8WeightOnlyConfig", chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert got is w


def test_a_later_plain_chunk_sends_the_weight_back_whole(monkeypatch):
    real = quant_torchao.quantize_whole

    def third_chunk_plain(weight, config):
        return weight.clone() if weight.data_ptr() == w[64:].data_ptr() else real(weight, config)

    monkeypatch.setattr(quant_torchao, "quantize_whole", third_chunk_plain)
    w = weight(8 * 32)
    got = TorchaoLinearMethod("Int8WeightOnlyConfig", chunk_numel=CHUNK_NUMEL).quantize_rows(w)
    assert_same_bytes(got, reference(w, tq.Int8WeightOnlyConfig()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (float8 dynamic activation: sm89+)")
@pytest.mark.parametrize(
    "granularity", [None, "row"], ids=["default-per-tensor", "per-row"]
)  # Float8DynamicActivationFloat8WeightConfig's default is PerTensor
@pytest.mark.parametrize("shape", [(6144, 4096), (4096, 14336), (28672, 4096), (4100, 4096)])
def test_float8_dynamic_activation_on_llama_8b_shapes(granularity, shape):
    def config():
        if granularity is None:
            return tq.Float8DynamicActivationFloat8WeightConfig()
        return tq.Float8DynamicActivationFloat8WeightConfig(granularity=tq.PerRow())

    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(shape, generator=g, device="cuda") * 0.02).bfloat16()
    got = TorchaoLinearMethod(config()).quantize_rows(w)
    assert_same_bytes(got, reference(w, config()))
    assert hasattr(got, "__tensor_flatten__") == (shape[0] % 16 == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["Float8WeightOnlyConfig", "Int8WeightOnlyConfig"])
def test_row_chunks_on_cuda_llama_8b_down_proj(name):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(4096, 14336, generator=g, device="cuda") * 0.02).bfloat16()
    assert_same_bytes(TorchaoLinearMethod(name).quantize_rows(w), reference(w, getattr(tq, name)()))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", ["Float8WeightOnlyConfig", "Int8WeightOnlyConfig", "IntxWeightOnlyConfig"])
@pytest.mark.parametrize("n", [8 * 32, ROW_ALIGN])  # chunked (local or quantize_ per chunk); whole
def test_a_non_finite_weight_is_a_clear_error(name, n, bad):
    w = weight(n)
    w[n - 5, 7] = bad  # in a later chunk, computed locally for Float8 and Int8
    with pytest.raises(NonFiniteWeightError, match="'weight'"):
        TorchaoLinearMethod(name, chunk_numel=CHUNK_NUMEL).quantize_rows(w)


def test_a_non_finite_bias_is_a_clear_error():
    layer = nn.Linear(K, 8 * 32).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(weight(8 * 32))
        layer.bias[3] = float("nan")
    with pytest.raises(NonFiniteWeightError, match="'bias'"):
        TorchaoLinearMethod("Float8WeightOnlyConfig").process_weights_after_loading(layer)


def test_float8_e5m2_rows_equal_torchao_whole_tensor():
    # e5m2 has no native kernel: its rows take the chunked path and its float32 work buffer, one chunk at a time
    pytest.importorskip("torchao")
    from torchao.quantization import Float8WeightOnlyConfig

    from layerwise.quant.torchao import TorchaoLinearMethod, quantize_whole

    config = Float8WeightOnlyConfig(weight_dtype=torch.float8_e5m2)
    w = torch.randn(1024, 256, generator=torch.Generator().manual_seed(9)).bfloat16()
    q = TorchaoLinearMethod(config, chunk_numel=64 * 256).quantize_rows(w)
    ref = quantize_whole(w, config)
    assert q.qdata.dtype == torch.float8_e5m2
    assert torch.equal(q.qdata.view(torch.uint8), ref.qdata.view(torch.uint8)) and torch.equal(q.scale, ref.scale)


def _meta_layer(shape, dtype):
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=False)
    return layer


def _row_pieces(w: torch.Tensor, cuts: list[int]) -> list[tuple[int, torch.Tensor]]:
    """``w`` as separate tensors of whole rows, split at row ``cuts`` (as qkv_proj's q, k and v loads)."""
    k, bounds = w.shape[1], [0, *cuts, w.shape[0]]
    return [(r0 * k, w[r0:r1].clone()) for r0, r1 in zip(bounds, bounds[1:], strict=False)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pieces_of_a_verified_float8_shape_give_torchaos_bytes_written_in_place(dtype, calls):
    # Limitations 5: the weight's loads quantized where they lie, and on a reload into the live weight's own tensors
    method = TorchaoLinearMethod("Float8WeightOnlyConfig", chunk_numel=CHUNK_NUMEL)
    config, n, cuts = tq.Float8WeightOnlyConfig(), 8 * 32 + 24, [40, 200]
    spans = [(0, 40 * K), (40 * K, 160 * K), (200 * K, 80 * K)]
    assert not method.accepts_weight_pieces((n, K), spans)  # not verified yet: the first weight is assembled
    method.quantize_rows(weight(n, seed=7).to(dtype))
    assert method.accepts_weight_pieces((n, K), spans)
    assert not method.accepts_weight_pieces((n, K), [(0, 40 * K + 5), (40 * K + 5, (n - 40) * K - 5)])  # not rows
    calls.clear()

    first = _meta_layer((n, K), dtype)
    method.process_weights_after_loading(
        first, weight_pieces=_row_pieces(weight(n, seed=1, zero_rows=False).to(dtype), cuts)
    )
    assert calls == []  # no quantize_ at all
    assert_same_bytes(first.weight.data, reference(weight(n, seed=1, zero_rows=False).to(dtype), config))

    live = first.weight
    qdata, scale = live.qdata.data_ptr(), live.scale.data_ptr()
    again = _meta_layer((n, K), dtype)
    method.process_weights_after_loading(
        again, into={"weight": live}, weight_pieces=_row_pieces(weight(n, seed=2, zero_rows=False).to(dtype), cuts)
    )
    assert again.weight is live and (live.qdata.data_ptr(), live.scale.data_ptr()) == (qdata, scale)
    assert_same_bytes(live.data, reference(weight(n, seed=2, zero_rows=False).to(dtype), config))

    bad = weight(n, seed=3, zero_rows=False).to(dtype)
    bad[230, 5] = float("nan")  # in the last piece: every piece's scale is checked before any write
    with pytest.raises(NonFiniteWeightError):
        method.process_weights_after_loading(
            _meta_layer((n, K), dtype), into={"weight": live}, weight_pieces=_row_pieces(bad, cuts)
        )
    assert_same_bytes(live.data, reference(weight(n, seed=2, zero_rows=False).to(dtype), config))


def test_pieces_of_a_layout_not_verified_for_their_dtype_are_assembled(calls):
    method = TorchaoLinearMethod("Float8WeightOnlyConfig", chunk_numel=CHUNK_NUMEL)
    n = 8 * 32
    method.quantize_rows(weight(n, seed=7))  # bfloat16 verified; the pieces below are float32
    calls.clear()
    layer = _meta_layer((n, K), torch.float32)
    method.process_weights_after_loading(
        layer, weight_pieces=_row_pieces(weight(n, seed=1, zero_rows=False).float(), [100])
    )
    assert calls == [32]  # verified now, through quantize_'s first chunk
    assert_same_bytes(
        layer.weight.data, reference(weight(n, seed=1, zero_rows=False).float(), tq.Float8WeightOnlyConfig())
    )


def test_chunk_rows_default_per_device():
    """64-row chunks on the CPU (1 MiB of float32 temporaries); on a GPU, where each chunk costs launches and
    Python, the N / 8 rows bound decides: 8 chunks for Llama-3-8B's gate_up_proj [28672, 4096], not 448."""
    method = TorchaoLinearMethod("Float8WeightOnlyConfig")
    assert method._chunk_rows(28672, 4096, torch.device("cpu")) == 64
    assert method._chunk_rows(28672, 4096, torch.device("cuda")) == 28672 // 8
    assert method._chunk_rows(6144, 4096, torch.device("cuda")) == 6144 // 8
    explicit = TorchaoLinearMethod("Float8WeightOnlyConfig", chunk_numel=CHUNK_NUMEL)
    assert explicit._chunk_rows(28672, K, torch.device("cuda")) == explicit._chunk_rows(28672, K, torch.device("cpu"))
    assert explicit._chunk_rows(28672, K, torch.device("cpu")) == 32
