"""Pre-quantized FP8 checkpoints (Hugging Face block / per-tensor, compressed-tensors per-channel): load, reload and
weight sync, against checkpoints the tests write with torch's own float8 cast (tests/fp8_checkpoints.py) and the
BF16 checkpoint of their dequantized weights."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import save_file

import layerwise
from layerwise.api import model_digest
from layerwise.checkpoint import Checkpoint
from layerwise.errors import ConfigError, MissingScaleError, ReloadError, WeightDtypeError
from tests.fp8_checkpoints import dequantize_blocks, write_fp8_checkpoint
from tests.hf_checkpoints import hf_logits, write_hf_checkpoint
from tests.test_fp8_load import _expected_fp8

ARCH = "Qwen2ForCausalLM"
SIZES = dict(hidden=256, intermediate=384, max_shard_size="1MB")  # q 256 rows, k and v 128: whole 128-blocks
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
MODULES = 2 * len(LINEARS) + 2 * 2 + 2  # per layer 4 linears and 2 norms; embed_tokens (tied head) and norm
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8ckpt")
    paths, files = {}, {}
    for seed in (0, 1):
        bf16 = write_hf_checkpoint(root / f"bf16_{seed}", ARCH, seed=seed, **SIZES)
        files[f"block{seed}"] = write_fp8_checkpoint(bf16, root / f"block{seed}", "block", root / f"deq{seed}")
        paths.update({f"bf16_{seed}": bf16, f"block{seed}": root / f"block{seed}", f"deq{seed}": root / f"deq{seed}"})
    files["tensor"] = write_fp8_checkpoint(paths["bf16_0"], root / "tensor", "tensor", root / "deq_tensor")
    files["channel"] = write_fp8_checkpoint(
        paths["bf16_0"], root / "channel", "channel", ignore=("layers.1.mlp.down_proj",)
    )
    unaligned = write_hf_checkpoint(root / "bf16_unaligned", ARCH, hidden=256, intermediate=320)
    files["unaligned"] = write_fp8_checkpoint(unaligned, root / "unaligned", "block")
    for name in ("tensor", "deq_tensor", "channel", "unaligned"):
        paths[name] = root / name
    return paths, files


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.detach()


def _file_tensors(path) -> list[tuple[str, torch.Tensor]]:
    ckpt = Checkpoint(path)
    try:
        return [(k, t.clone()) for k, t in ckpt]
    finally:
        ckpt.close()


def _linear(model, layer: int, name: str):
    module = model.model.layers[layer]
    for part in name.split("."):
        module = getattr(module, part)
    return module


def _file_pair(files: dict, layer: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 bytes and the scale of a linear as the file has them, fused shards stacked."""
    parent, short = name.split(".")
    parts = [files[f"model.layers.{layer}.{parent}.{p}.weight"] for p in FUSED.get(short, (short,))]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def _dequantized(files: dict, layer: int, name: str) -> torch.Tensor:
    """The linear's weight as the BF16 checkpoint of the dequantized weights holds it (float32 product, rounded)."""
    parent, short = name.split(".")
    parts = [files[f"model.layers.{layer}.{parent}.{p}.weight"] for p in FUSED.get(short, (short,))]
    exact = [dequantize_blocks(q, s) if s.dim() == 2 and s.shape[1] > 1 else q.float() * s for q, s in parts]
    return torch.cat(exact).to(torch.bfloat16)


@pytest.mark.parametrize("quantization", ["fp8", "fp8-per-block"])
def test_block_checkpoint_keeps_the_file_bytes_and_scales(ckpts, quantization):
    paths, files = ckpts
    model, report = layerwise.load_model_with_report(paths["block0"], quantization=quantization)
    assert report.quantization == "fp8-per-block"  # "fp8" means the checkpoint's own FP8 layout
    for layer in range(2):
        for name in LINEARS:
            module = _linear(model, layer, name)
            q, scale = _file_pair(files["block0"], layer, name)
            assert module.weight.dtype == torch.float8_e4m3fn
            assert torch.equal(_bytes(module.weight), _bytes(q)), name
            assert torch.equal(module.weight_scale_inv, scale), name
            assert not hasattr(module, "weight_scale")


def test_block_checkpoint_logits_equal_the_dequantized_model(ckpts):
    paths, _ = ckpts
    reference = hf_logits(paths["deq0"], IDS).float()
    logits = layerwise.load_model(paths["block0"])(IDS).float()
    # BF16 activations: the same rounding noise as our BF16 model of the dequantized checkpoint against transformers
    noise = (layerwise.load_model(paths["deq0"], quantization=None)(IDS).float() - reference).abs().max()
    assert (logits - reference).abs().max() <= 2 * noise + 1e-3
    assert noise < 0.05 * reference.abs().max()


def test_quantization_none_dequantizes_to_the_bf16_model(ckpts):
    paths, _ = ckpts
    model = layerwise.load_model(paths["block0"], quantization=None)
    reference = layerwise.load_model(paths["deq0"], quantization=None)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype == torch.bfloat16, name
        assert torch.equal(ours[name], theirs[name]), name
    assert torch.equal(model(IDS), reference(IDS))


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_another_scheme_requantizes_the_dequantized_weights(ckpts, granularity):
    """As the BF16 checkpoint of the dequantized weights loads with that scheme: torch's own cast of its weights."""
    paths, files = ckpts
    model = layerwise.load_model(paths["block0"], quantization=f"fp8-per-{granularity}")
    for name in LINEARS:
        module = _linear(model, 1, name)
        q, scale = _expected_fp8(_dequantized(files["block0"], 1, name), granularity)
        assert torch.equal(_bytes(module.weight), _bytes(q)), name
        torch.testing.assert_close(module.weight_scale, scale, rtol=0, atol=0)
    assert torch.equal(model(IDS), layerwise.load_model(paths["deq0"], quantization=f"fp8-per-{granularity}")(IDS))


def test_unaligned_fused_shards_are_requantized_per_block(ckpts):
    """gate_proj's 320 rows end inside a block: the fused gate_up_proj's block grid cannot hold the file's scales, so
    it is dequantized and quantized again; every other linear keeps the file's bytes."""
    paths, files = ckpts
    model = layerwise.load_model(paths["unaligned"])
    for name in LINEARS:
        module = _linear(model, 0, name)
        if name == "mlp.gate_up_proj":
            q, scale = _expected_fp8(_dequantized(files["unaligned"], 0, name), "block")
        else:
            q, scale = _file_pair(files["unaligned"], 0, name)
        assert torch.equal(_bytes(module.weight), _bytes(q)), name
        assert torch.equal(module.weight_scale_inv, scale), name


def test_per_tensor_checkpoint(ckpts):
    """fp8: unfused linears keep their bytes; fused ones, whose shards have different scales, are re-quantized to
    one scale. fp8-per-channel keeps every byte, each shard's scale repeated over its rows."""
    paths, files = ckpts
    per_tensor = layerwise.load_model(paths["tensor"])
    per_channel = layerwise.load_model(paths["tensor"], quantization="fp8-per-channel")
    for name in LINEARS:
        q, scales = _file_pair(files["tensor"], 0, name)
        rows = torch.cat([s.expand(n, 1) for s, n in zip(scales, _row_counts(files["tensor"], name), strict=True)])
        module = _linear(per_channel, 0, name)
        assert torch.equal(_bytes(module.weight), _bytes(q)) and torch.equal(module.weight_scale, rows), name
        module = _linear(per_tensor, 0, name)
        if name.split(".")[1] in FUSED:
            q, scales = _expected_fp8(_dequantized(files["tensor"], 0, name), "tensor")
        assert torch.equal(_bytes(module.weight), _bytes(q)) and torch.equal(module.weight_scale, scales), name
    reference = hf_logits(paths["deq_tensor"], IDS).float()
    assert (per_channel(IDS).float() - reference).abs().max() < 0.05 * reference.abs().max()


def _row_counts(files: dict, name: str) -> list[int]:
    parent, short = name.split(".")
    return [files[f"model.layers.0.{parent}.{p}.weight"][0].shape[0] for p in FUSED.get(short, (short,))]


def test_compressed_tensors_per_channel_with_an_unquantized_module(ckpts):
    paths, files = ckpts
    model, report = layerwise.load_model_with_report(paths["channel"])
    assert report.quantization == "fp8-per-channel"
    module = _linear(model, 0, "mlp.down_proj")
    q, scale = files["channel"]["model.layers.0.mlp.down_proj.weight"]
    assert torch.equal(_bytes(module.weight), _bytes(q)) and torch.equal(module.weight_scale, scale)
    # listed in "ignore": stored in BF16, quantized on the fly as a BF16 checkpoint's weight is
    assert "model.layers.1.mlp.down_proj.weight" not in files["channel"]
    bf16 = dict(_file_tensors(paths["channel"]))["model.layers.1.mlp.down_proj.weight"]
    assert bf16.dtype == torch.bfloat16
    q, scale = _expected_fp8(bf16, "channel")
    module = _linear(model, 1, "mlp.down_proj")
    assert torch.equal(_bytes(module.weight), _bytes(q)) and torch.equal(module.weight_scale, scale)


@pytest.mark.parametrize("atomic", [True, False])
@pytest.mark.parametrize("source", ["directory", "stream"])
def test_reload_equals_a_fresh_load(ckpts, atomic, source):
    paths, _ = ckpts
    model = layerwise.load_model(paths["block0"])
    pointers = {n: t.data_ptr() for n, t in model.state_dict().items()}
    weights = paths["block1"] if source == "directory" else _file_tensors(paths["block1"])
    report = layerwise.reload_weights(model, weights, atomic=atomic)
    assert len(report.updated_modules) == MODULES
    fresh = layerwise.load_model(paths["block1"])
    for name, t in fresh.state_dict().items():
        assert torch.equal(_bytes(model.state_dict()[name]), _bytes(t)), name
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == pointers


@pytest.mark.parametrize("atomic", [True, False])
def test_a_weight_without_its_scale_writes_nothing(ckpts, atomic):
    paths, _ = ckpts
    model = layerwise.load_model(paths["block0"])
    before = model_digest(model)
    key = "model.layers.1.mlp.down_proj.weight"
    weight = dict(_file_tensors(paths["block1"]))[key]
    with pytest.raises(ReloadError) as info:
        layerwise.reload_weights(model, [(key, weight)], atomic=atomic)
    assert isinstance(info.value, MissingScaleError)
    assert info.value.key == key + "_scale_inv"
    assert "float8_e4m3fn" in str(info.value) and key + "_scale_inv" in str(info.value)
    assert info.value.updated_modules == []
    assert model_digest(model) == before
    # the whole stream but one scale: the other modules are written (non-atomic), that one is not
    stream = [(k, t) for k, t in _file_tensors(paths["block1"]) if k != key + "_scale_inv"]
    with pytest.raises(MissingScaleError) as info:
        layerwise.reload_weights(model, stream, atomic=atomic)
    assert info.value.key == key + "_scale_inv"
    assert len(info.value.updated_modules) == (0 if atomic else MODULES - 1)
    assert "model.layers.1.mlp.down_proj" not in info.value.updated_modules
    fresh = layerwise.load_model(paths["block0"])
    down = _linear(model, 1, "mlp.down_proj")
    assert torch.equal(_bytes(down.weight), _bytes(_linear(fresh, 1, "mlp.down_proj").weight))


def test_a_checkpoint_without_a_scale_fails_to_load(ckpts, tmp_path):
    paths, _ = ckpts
    tensors = dict(_file_tensors(paths["block0"]))
    del tensors["model.layers.0.self_attn.k_proj.weight_scale_inv"]
    (tmp_path / "config.json").write_text((paths["block0"] / "config.json").read_text())
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(MissingScaleError) as info:
        layerwise.load_model(tmp_path)
    assert info.value.key == "model.layers.0.self_attn.k_proj.weight_scale_inv"


def test_float8_tensor_into_a_bf16_model_is_refused(ckpts):
    paths, _ = ckpts
    model = layerwise.load_model(paths["bf16_0"])
    before = model_digest(model)
    key = "model.layers.0.mlp.down_proj.weight"
    weight = dict(_file_tensors(paths["block1"]))[key]
    with pytest.raises(ReloadError) as info:
        layerwise.reload_weights(model, [(key, weight)])
    assert isinstance(info.value.cause, WeightDtypeError)
    assert info.value.key == key and "float8_e4m3fn" in str(info.value) and "bfloat16" in str(info.value)
    with pytest.raises(ReloadError) as info:  # from the directory: refused before a tensor is read
        layerwise.reload_weights(model, paths["block1"])
    assert isinstance(info.value.cause, WeightDtypeError) and "config.json" in str(info.value)
    assert model_digest(model) == before


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8, torch.float8_e5m2])
def test_fp8_model_refuses_other_dtypes_for_its_weights(ckpts, dtype):
    paths, _ = ckpts
    model = layerwise.load_model(paths["block0"])
    before = model_digest(model)
    key = "model.layers.0.mlp.down_proj.weight"
    weight = torch.ones(256, 384).to(dtype)
    with pytest.raises(ReloadError) as info:
        layerwise.reload_weights(model, [(key, weight)])
    assert isinstance(info.value.cause, WeightDtypeError), info.value
    assert info.value.key == key and str(dtype).removeprefix("torch.") in str(info.value)
    assert model_digest(model) == before


@pytest.mark.parametrize(
    "base, change, field",
    [
        ("block0", {"quant_method": "gptq"}, "quant_method='gptq'"),
        ("block0", {"activation_scheme": "static"}, "activation_scheme"),
        ("block0", {"weight_block_size": [64, 64]}, "weight_block_size=[64, 64]"),
        ("block0", {"fmt": "e5m2"}, "fmt='e5m2'"),
        ("channel", {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
        ("channel", {"format": "pack-quantized"}, "format='pack-quantized'"),
    ],
)
def test_unreadable_quantization_configs_are_refused_by_name(ckpts, tmp_path, base, change, field):
    paths, _ = ckpts
    config = json.loads((paths[base] / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({}, tmp_path / "model.safetensors")  # refused before a tensor is read (this file has none)
    with pytest.raises(ConfigError) as info:
        layerwise.load_model(tmp_path)
    assert field in str(info.value) and "config.json" in str(info.value)


def test_fp8_experts_are_refused_while_building(tmp_path):
    from tests.hf_checkpoints import hf_config

    config = hf_config("Qwen3MoeForCausalLM").to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({}, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="FP8 experts"):
        layerwise.load_model(tmp_path)


def test_weight_sync_takes_fp8_and_scale_pairs_from_a_trainer(ckpts):
    """A trainer that quantizes on its side sends FP8 weights with their scales (checkpoint format) over the nccl
    backend (gloo here): the engine's model then equals a fresh load of the FP8 checkpoint they came from."""
    from layerwise.transfer import tensor_metadata, update_weights
    from layerwise.transfer.nccl import NCCLWeightTransferEngine
    from tests.transfer.harness import free_port, group_in_threads

    paths, _ = ckpts
    info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    info["timeout_seconds"] = 30.0
    group, engine = group_in_threads(info)
    try:
        model = layerwise.load_model(paths["block0"])
        sent = _file_tensors(paths["block1"])
        args = {"group": group, "packed": True, "packed_buffer_size_bytes": 1 << 20}
        errors = []

        def trainer():
            try:
                NCCLWeightTransferEngine.trainer_send_weights(iter(sent), args)
            except Exception as e:  # noqa: BLE001 -- reported below
                errors.append(e)

        thread = threading.Thread(target=trainer)
        thread.start()
        update_info = dict(tensor_metadata(sent), is_checkpoint_format=True, packed=True)
        update_info["packed_buffer_size_bytes"] = 1 << 20
        update_weights(model, engine, {"update_info": update_info})
        thread.join(30)
        assert not thread.is_alive() and not errors, errors
    finally:
        engine.shutdown()
    fresh = layerwise.load_model(paths["block1"])
    for name, t in fresh.state_dict().items():
        assert torch.equal(_bytes(model.state_dict()[name]), _bytes(t)), name


def test_torchao_scheme_on_an_fp8_checkpoint_equals_the_dequantized_checkpoint(ckpts):
    pytest.importorskip("torchao")
    paths, _ = ckpts
    scheme = "torchao:Int8WeightOnlyConfig"
    assert torch.equal(
        layerwise.load_model(paths["block0"], quantization=scheme)(IDS),
        layerwise.load_model(paths["deq0"], quantization=scheme)(IDS),
    )


@pytest.mark.parametrize(
    "ignore", ["model.layers.1", "layers.0.self_attn.qkv_proj", "re:.*layers\\.0\\.mlp\\.gate_up_proj"]
)
def test_phi3_fused_checkpoint_with_unquantized_modules(tmp_path, ignore):
    """Phi-3 stores qkv_proj and gate_up_proj fused: FP8 with block scales, except the modules its list names (a
    fused module by its own name, a regex, or a prefix covering a whole layer), stored in BF16. Every linear equals
    the BF16 checkpoint of the same weights loaded as fp8-per-block, whichever way each was stored."""
    bf16 = write_hf_checkpoint(tmp_path / "bf16", "Phi3ForCausalLM", hidden=256, intermediate=384)
    listed = ignore.removeprefix("re:").replace("\\", "").replace(".*", "")
    files = write_fp8_checkpoint(bf16, tmp_path / "fp8", "block", tmp_path / "deq", ignore=(listed,))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    config["quantization_config"]["modules_to_not_convert"] = [ignore]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    assert 0 < len(files) < 8  # some linears in FP8, some not
    ours = dict(layerwise.load_model(tmp_path / "fp8").named_parameters())
    theirs = dict(layerwise.load_model(tmp_path / "deq", quantization="fp8-per-block").named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(_bytes(ours[name]), _bytes(theirs[name])), name
