"""The errors a new user meets in the first hour say what to do: a device this torch cannot use, ids the model
cannot embed, a checkpoint in another format, a hub id, a scheme name from another tool, a missing extra."""

import re
import sys

import pytest
import torch

import layerwise
from layerwise import optional
from layerwise.api import resolve_device
from layerwise.benchmarks.options import require
from layerwise.demo import write_checkpoint
from layerwise.engine import Engine
from tests.test_errors import TINY


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("first_hour") / "ckpt", TINY)


@pytest.fixture(scope="module")
def model(ckpt):
    return layerwise.load_model(ckpt)


@pytest.fixture
def cpu_only_torch(monkeypatch):
    """torch as a CPU-only build sees it, on any machine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", None)


# ---- 1. a device this torch build cannot use: checked before anything is read


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda")])
def test_cuda_on_a_cpu_only_torch_names_the_build(cpu_only_torch, tmp_path, device):
    with pytest.raises(layerwise.DeviceError) as e:
        layerwise.load_model(tmp_path / "not-even-there", device=device)  # the device is checked first
    assert str(e.value) == (
        f"device {str(device)!r}: no CUDA GPU is visible to torch (torch {torch.__version__}, a CPU-only build "
        f"without CUDA); use cpu, or a CUDA build of torch on a machine with a GPU"
    )
    assert isinstance(e.value, ValueError) and isinstance(e.value, layerwise.LayerwiseError)


def test_cuda_build_without_a_visible_gpu_says_where_to_look(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(layerwise.DeviceError, match="built for CUDA 13.0: check nvidia-smi and CUDA_VISIBLE_DEVICES"):
        resolve_device("cuda")


def test_gpu_index_past_the_visible_ones(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(layerwise.DeviceError) as e:
        resolve_device("cuda:2")
    assert str(e.value) == "device 'cuda:2': only 2 CUDA device(s) visible: cuda:0 to cuda:1"


@pytest.mark.parametrize(
    "device,words",
    [("tpu:7", "not a device name (use cpu, cuda or cuda:N)"), ("meta", "layerwise runs on cpu and cuda devices")],
)
def test_other_devices_are_refused_up_front(ckpt, device, words):
    with pytest.raises(layerwise.DeviceError, match=re.escape(f"device {device!r}: {words}")):
        layerwise.load_model(ckpt, device=device)


def test_engine_from_pretrained_checks_the_device(cpu_only_torch, ckpt):
    with pytest.raises(layerwise.DeviceError, match="no CUDA GPU is visible to torch"):
        Engine.from_pretrained(ckpt, device="cuda")


# ---- 2. the forward checks its input ids


@pytest.mark.parametrize(
    "ids,message",
    [
        (
            torch.tensor([1, 2, 3]),
            "input_ids must be a 2-D integer tensor [batch, seq] (int64 or int32), got torch.int64 of shape (3,); "
            "for one sequence pass input_ids[None]",
        ),
        (
            torch.ones(1, 3),
            "input_ids must be a 2-D integer tensor [batch, seq] (int64 or int32), got torch.float32 of shape (1, 3)",
        ),
        (
            torch.tensor([[1, 64]]),
            "input_ids holds token id 64, outside the vocabulary [0, 64) (vocab_size of config.json)",
        ),
        (
            torch.tensor([[-1, 3]]),
            "input_ids holds token id -1, outside the vocabulary [0, 64) (vocab_size of config.json)",
        ),
        ([[1, 2]], "input_ids must be a 2-D integer tensor [batch, seq], got a list"),
    ],
)
def test_forward_refuses_bad_ids_with_what_it_expects(model, ids, message):
    with pytest.raises(ValueError) as e:
        model(ids)
    assert str(e.value) == message


def test_forward_takes_int32_and_the_vocabulary_edges(model):
    ids = torch.tensor([[0, 63]])
    torch.testing.assert_close(model(ids.int()), model(ids), rtol=0, atol=0)


# ---- 3. a checkpoint in another format names the files and the conversion


def _config_only(path):
    path.mkdir()
    (path / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    return path


def test_pytorch_bin_checkpoint_names_the_file_and_the_conversion(tmp_path):
    path = _config_only(tmp_path / "bin")
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, path / "pytorch_model.bin")
    with pytest.raises(layerwise.CheckpointError) as e:
        layerwise.load_model(path)
    assert e.value.file == str(path)
    assert str(e.value) == (
        f"no model.safetensors or model.safetensors.index.json in {path}; it holds pytorch_model.bin: PyTorch "
        f"pickle weights, which layerwise does not read (safetensors only). Convert them once: "
        f"transformers.AutoModelForCausalLM.from_pretrained({str(path)!r}, torch_dtype='auto').save_pretrained(OUT, "
        f"safe_serialization=True), or for a plain state dict safetensors.torch.save_file(torch.load("
        f"{str(path / 'pytorch_model.bin')!r}, weights_only=True), 'OUT/model.safetensors') next to a copy of "
        f"config.json; then pass OUT (file {path})"
    )


def test_pt_and_pth_files_are_named_together(tmp_path):
    path = _config_only(tmp_path / "pt")
    for name in ("consolidated.00.pth", "model.pt"):
        (path / name).write_bytes(b"")
    with pytest.raises(layerwise.CheckpointError, match=r"it holds consolidated\.00\.pth, model\.pt: PyTorch pickle"):
        layerwise.load_model(path)


def test_gguf_without_config_names_the_gguf_conversion(tmp_path):
    path = tmp_path / "gguf"
    path.mkdir()
    (path / "qwen3-8b-q4_k_m.gguf").write_bytes(b"GGUF")
    with pytest.raises(layerwise.CheckpointError) as e:
        layerwise.load_model(path)
    assert str(e.value) == (
        f"config.json is missing in {path}; it holds qwen3-8b-q4_k_m.gguf: GGUF weights, which layerwise does not "
        f"read (safetensors only). transformers reads GGUF: transformers.AutoModelForCausalLM.from_pretrained("
        f"{str(path)!r}, gguf_file='qwen3-8b-q4_k_m.gguf', torch_dtype=torch.bfloat16).save_pretrained(OUT, "
        f"safe_serialization=True) writes config.json and safetensors (a quantized GGUF is dequantized); then pass "
        f"OUT (file {path / 'config.json'})"
    )


def test_safetensors_under_another_name_says_what_is_read(tmp_path):
    path = _config_only(tmp_path / "renamed")
    (path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(layerwise.CheckpointError) as e:
        layerwise.load_model(path)
    assert (
        "it holds weights.safetensors: layerwise reads model.safetensors, or the shards that "
        "model.safetensors.index.json lists; rename a single file to model.safetensors" in str(e.value)
    )


def test_empty_directory_says_it_holds_no_weights(tmp_path):
    path = _config_only(tmp_path / "empty")
    with pytest.raises(layerwise.CheckpointError) as e:
        layerwise.load_model(path)
    assert str(e.value) == f"no model.safetensors or model.safetensors.index.json in {path}; no weights (file {path})"


# ---- 4. a hub id is not downloaded: say how to get a directory


def test_hub_id_says_how_to_download_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(layerwise.CheckpointError) as e:
        layerwise.load_model("Qwen/Qwen3-8B")
    assert str(e.value) == (
        "checkpoint directory Qwen/Qwen3-8B: no such directory; if Qwen/Qwen3-8B is a Hugging Face hub id: "
        "layerwise reads local directories and downloads nothing. Download it first (huggingface-cli download "
        "Qwen/Qwen3-8B --local-dir DIR, or huggingface_hub.snapshot_download('Qwen/Qwen3-8B', local_dir=DIR)), then "
        "pass DIR (file Qwen/Qwen3-8B)"
    )


def test_a_missing_absolute_path_is_no_hub_id(tmp_path):
    with pytest.raises(layerwise.CheckpointError) as e:
        layerwise.load_model(tmp_path / "a" / "b")
    assert "hub id" not in str(e.value)
    assert f"checkpoint directory {tmp_path / 'a' / 'b'}: no such directory; give a directory with config.json" in str(
        e.value
    )


def test_reload_from_a_hub_id_says_the_same(model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(layerwise.ReloadError, match="huggingface-cli download Qwen/Qwen3-8B --local-dir DIR"):
        layerwise.reload_weights(model, "Qwen/Qwen3-8B")


# ---- 5. an unknown scheme suggests the nearest one


@pytest.mark.parametrize(
    "scheme,message",
    [
        (
            "int8",
            "unknown quantization 'int8'; did you mean 'torchao:Int8WeightOnlyConfig'? choose one of: "
            "fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block, torchao:<Config>, none",
        ),
        (
            "fp8_per_block",
            "unknown quantization 'fp8_per_block'; did you mean 'fp8-per-block'? choose one of: "
            "fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block, torchao:<Config>, none",
        ),
        (
            "torchoa:Float8WeightOnlyConfig",
            "unknown quantization 'torchoa:Float8WeightOnlyConfig'; did you mean 'torchao:Float8WeightOnlyConfig'? "
            "choose one of: fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block, torchao:<Config>, none",
        ),
        (
            "fp8_e5m2",
            "unknown quantization 'fp8_e5m2': FP8 weights here are float8_e4m3fn (e4m3), the only FP8 format; "
            "use one of fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block",
        ),
        (
            "E5M2",
            "unknown quantization 'E5M2': FP8 weights here are float8_e4m3fn (e4m3), the only FP8 format; "
            "use one of fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block",
        ),
        (
            "gptq",
            "unknown quantization 'gptq'; choose one of: "
            "fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block, torchao:<Config>, none",
        ),
        (  # another format, not a typo of int8 or fp8: no suggestion
            "int4",
            "unknown quantization 'int4'; choose one of: "
            "fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block, torchao:<Config>, none",
        ),
        (
            "fp4",
            "unknown quantization 'fp4'; choose one of: "
            "fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block, torchao:<Config>, none",
        ),
        (
            "float8",
            "unknown quantization 'float8'; did you mean 'fp8'? "
            "choose one of: fp8-per-tensor, fp8, fp8-per-channel, fp8-per-block, torchao:<Config>, none",
        ),
    ],
)
def test_unknown_scheme_suggests_the_nearest(ckpt, scheme, message):
    with pytest.raises(ValueError) as e:
        layerwise.load_model(ckpt, quantization=scheme)
    assert str(e.value) == message


def test_the_int8_suggestion_loads(ckpt):
    model = layerwise.load_model(ckpt, quantization="torchao:Int8WeightOnlyConfig")
    assert model(torch.tensor([[1, 2]])).shape == (1, 2, 64)


# ---- 6. a missing extra names only what is missing


def test_missing_extra_names_only_the_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError, as if not installed
    with pytest.raises(layerwise.MissingDependencyError) as e:
        require(["transformers", "matplotlib", "torchao"])
    assert str(e.value) == (
        "layerwise bench needs matplotlib, which is not installed. Install it: pip install 'matplotlib>=3.7'; "
        "from a source checkout, the whole extra: pip install -e '.[bench]'"
    )


def test_two_missing_packages_are_named_together(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "accelerate", None)
    with pytest.raises(layerwise.MissingDependencyError) as e:
        optional.require(["transformers", "matplotlib", "accelerate.utils"], extra="bench", purpose="the plot")
    assert str(e.value) == (
        "the plot needs matplotlib and accelerate, which are not installed. Install them: pip install "
        "'matplotlib>=3.7' 'accelerate>=1.0'; from a source checkout, the whole extra: pip install -e '.[bench]'"
    )


def test_import_optional_names_its_package(monkeypatch):
    for name in ("torchao", "torchao.quantization"):  # an earlier test may have imported them
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(layerwise.MissingDependencyError) as e:
        optional.import_optional("torchao.quantization", extra="torchao", purpose="quantization='torchao:...'")
    assert str(e.value).startswith("quantization='torchao:...' needs torchao, which is not installed. Install it: ")
    assert "pip install 'torchao>=0.10';" in str(e.value)


def test_the_triton_kernel_without_triton_names_the_gpu_extra(tmp_path, monkeypatch):
    """A CPU-only install has no Triton (it is the [gpu] extra): asking for kernel="triton" names what to install,
    instead of an ImportError from inside the kernels; the default kernel is the torch one."""
    import layerwise.kernels as kernels

    monkeypatch.setattr(kernels, "triton_importable", lambda: False)
    monkeypatch.setitem(sys.modules, "triton", None)  # find_spec("triton") -> None: not installed
    assert kernels.resolve_kernel(None, "cpu") == "torch"
    with pytest.raises(layerwise.MissingDependencyError) as err:
        layerwise.load_model(write_checkpoint(tmp_path / "ckpt", TINY), quantization="fp8", kernel="triton")
    assert str(err.value).startswith("kernel='triton' needs triton, which is not installed.")
    assert re.search(r"pip install 'triton(<3.10,>=3.4|>=3.4,<3.10)'", str(err.value)) and "'.[gpu]'" in str(err.value)


def test_a_triton_that_does_not_import_is_named_and_cuda_falls_back_to_torch(monkeypatch):
    """Installed but broken (a wheel for another CUDA, say): the default kernel on CUDA is the torch one, and
    kernel="triton" says that triton fails to import rather than picking it and failing inside the kernels."""
    import layerwise.kernels as kernels
    import layerwise.kernels.triton_common as triton_common

    monkeypatch.setattr(triton_common, "HAS_TRITON", False)  # the import in triton_common failed
    monkeypatch.setattr(kernels, "HAS_TRITON", True)  # find_spec finds it
    kernels.triton_importable.cache_clear()
    try:
        assert kernels.resolve_kernel(None, "cuda") == "torch"
        monkeypatch.setitem(sys.modules, "triton", None)  # importing it fails
        with pytest.raises(layerwise.MissingDependencyError, match="triton"):
            kernels.resolve_kernel("triton", "cpu")
    finally:
        kernels.triton_importable.cache_clear()


def test_a_device_error_crosses_processes():
    """Errors travel between spawned workers by pickle; DeviceError's two required arguments must survive it."""
    import pickle

    err = layerwise.DeviceError("cuda:3", "only 1 GPU is visible")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is layerwise.DeviceError and str(again) == str(err)
    assert (again.device, again.reason) == ("cuda:3", "only 1 GPU is visible")


def test_an_installed_package_that_fails_to_import_is_not_called_missing(tmp_path, monkeypatch):
    """find_spec finds it, its import raises: the message says so and keeps the cause, not 'not installed'."""
    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("raise ImportError('libfoo.so: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(layerwise.MissingDependencyError) as err:
        optional.require(["brokenpkg"], extra="bench", purpose="layerwise bench")
    assert str(err.value).startswith(
        "layerwise bench needs brokenpkg, which is installed but fails to import "
        "(ImportError: libfoo.so: cannot open shared object); reinstall it: "
    )
