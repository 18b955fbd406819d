"""load_model: a Hugging Face checkpoint into a (by default FP8) model, one layer at a time."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Optional

import torch
from torch import nn

from layerwise.kernels import resolve_kernel
from layerwise.checkpoint import Checkpoint, group_name
from layerwise.config import ModelConfig
from layerwise.errors import LayerwiseError, WeightShapeError
from layerwise.memory import DeviceMemoryTracker, tensor_bytes
from layerwise.registry import get_model_class
from layerwise.reload import (finalize_layerwise_reload, initialize_layerwise_reload,
                              record_metadata_for_reloading)
from layerwise.reload.session import abort_layerwise_reload
from layerwise.quant.config import QuantConfig
from layerwise.quant.parameters import WeightShapeError as _LoaderShapeError

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "float32": torch.float32, "fp32": torch.float32}


@dataclass
class LoadReport:
    """What a load did and cost. Bytes are bytes, seconds are wall-clock seconds.

    Attributes:
        peak_bytes: peak live tensor bytes on the device during the load (DeviceMemoryTracker).
        model_bytes: bytes of the loaded model's parameters and buffers on the device.
        largest_layer_checkpoint_bytes: checkpoint bytes of the largest load group (one decoder
            layer, or one top-level module such as embed_tokens or lm_head).
        overhead_per_layer: (peak_bytes - model_bytes) / largest_layer_checkpoint_bytes.
    """

    architecture: str
    num_layers: int
    device: str
    quantization: str
    kernel: str
    dtype: str
    checkpoint_bytes: int
    model_bytes: int
    largest_layer_checkpoint_bytes: int
    peak_bytes: int
    seconds: float
    memory_tracker: str
    peak_rss_anon_bytes: int = 0
    peak_buffered_bytes: int = 0
    timeline: list = field(default_factory=list, repr=False)

    @property
    def overhead_per_layer(self) -> float:
        return (self.peak_bytes - self.model_bytes) / max(1, self.largest_layer_checkpoint_bytes)

    def to_dict(self, with_timeline: bool = False) -> dict:
        d = asdict(self)
        if not with_timeline:
            d.pop("timeline")
        d["overhead_per_layer"] = self.overhead_per_layer
        return d


def parse_dtype(dtype) -> Optional[torch.dtype]:
    """torch.dtype from a dtype or a name ("bfloat16", "fp32", ...); None stays None.

    Raises:
        ValueError: an unknown name.
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def stream_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], session,
                   file_of: Optional[Callable[[str], Optional[str]]] = None,
                   on_tensor: Optional[Callable[[str], None]] = None) -> None:
    """Feed (key, tensor) pairs one at a time to ``model.load_weights`` inside a layerwise session.

    Raises:
        LayerwiseError subclasses, with ``key`` and ``file`` filled in from the pair that failed.
    """
    for key, tensor in weights:
        file = file_of(key) if file_of else None
        session.current_key = key
        try:
            model.load_weights([(key, tensor)])
        except LayerwiseError as e:
            raise e.add_context(key=key, file=file)
        except _LoaderShapeError as e:
            raise WeightShapeError(str(e), key=key, file=file) from e
        if on_tensor is not None:
            on_tensor(key)


def load_model_with_report(path: str | os.PathLike, quantization: Optional[str] = "fp8", device="cpu",
                           dtype=None, kernel: Optional[str] = None, fp8_mode: str = "auto",
                           progress: bool = False, track_memory: bool = True) -> tuple[nn.Module, LoadReport]:
    """Like :func:`load_model`, and also returns the :class:`LoadReport`.

    Args:
        progress: show a per-layer tqdm progress bar on stderr.
        track_memory: measure the peak with :class:`DeviceMemoryTracker` (on CPU its dispatch mode
            adds Python work to every tensor operation; with False, peak_bytes is reported as -1).
    """
    start = time.perf_counter()
    ckpt = Checkpoint(path)
    config = ModelConfig.from_dict(ckpt.config)
    arch, model_cls = get_model_class(config, os.path.join(ckpt.path, "config.json"))
    device = torch.device(device)
    params_dtype = parse_dtype(dtype) or config.dtype or torch.bfloat16
    quant_config = QuantConfig(quantization or "none", resolve_kernel(kernel, device), fp8_mode)
    groups = ckpt.group_bytes()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(groups), unit="layer", desc="loading", leave=False)
    last_group = [None]

    def on_tensor(key: str) -> None:
        g = group_name(key)
        if bar is not None and g != last_group[0]:
            if last_group[0] is not None:
                bar.update(1)
            bar.set_postfix_str(g)
        last_group[0] = g

    tracker = DeviceMemoryTracker(device) if track_memory else contextlib.nullcontext()
    with tracker:
        with torch.device("meta"):
            model = model_cls(config, quant_config, params_dtype, device)
        record_metadata_for_reloading(model)
        session = initialize_layerwise_reload(model, device=device)
        try:
            stream_weights(model, ckpt, session, ckpt.file_of, on_tensor)
            finalize_layerwise_reload(model)
        except BaseException:
            abort_layerwise_reload(model)
            raise
        finally:
            if bar is not None:
                bar.update(1)
                bar.close()
            ckpt.close()
    model.eval()
    report = LoadReport(
        architecture=arch, num_layers=config.num_hidden_layers, device=str(device),
        quantization=quant_config.scheme, kernel=quant_config.kernel, dtype=str(params_dtype).replace("torch.", ""),
        checkpoint_bytes=ckpt.total_bytes, model_bytes=tensor_bytes(model, device),
        largest_layer_checkpoint_bytes=max(groups.values()),
        peak_bytes=tracker.peak_bytes if track_memory else -1,
        seconds=time.perf_counter() - start, memory_tracker=tracker.method if track_memory else "none",
        peak_rss_anon_bytes=tracker.peak_rss_anon_bytes if track_memory else 0,
        peak_buffered_bytes=session.peak_buffered_bytes, timeline=tracker.timeline if track_memory else [])
    return model, report


def load_model(path: str | os.PathLike, quantization: Optional[str] = "fp8", device="cpu", dtype=None,
               kernel: Optional[str] = None, fp8_mode: str = "auto") -> nn.Module:
    """Load a Hugging Face checkpoint layer by layer, quantizing decoder Linear weights on the fly.

    Layers are built on the meta device; each layer is materialized on ``device`` only once all of
    its checkpoint tensors have arrived, then quantized, so the device holds the final model plus
    about one layer in the checkpoint dtype at any time.

    Args:
        path: directory with config.json and *.safetensors (model.safetensors or an index.json).
        quantization: "fp8" (= "fp8-per-tensor": float8_e4m3fn weights, float32 per-tensor
            ``weight_scale``) or None / "none" (checkpoint dtype, or ``dtype``).
        device: target device ("cpu", "cuda", "cuda:1", torch.device).
        dtype: dtype of unquantized parameters (embeddings, norms, lm_head, and all Linear weights
            with quantization none): torch.dtype or name; default: config.json's dtype, else bf16.
        kernel: "torch" or "triton" for the FP8 quantization kernels; None = triton on CUDA,
            torch on CPU. "triton" on CPU runs Triton's interpreter (slow; for testing).
        fp8_mode: forward of FP8 layers: "auto" (W8A8 via torch._scaled_mm on CUDA sm89+, W8A16
            elsewhere), "w8a8" (also on CPU, slowly), or "w8a16" (dequantize, then matmul).
    Returns:
        the model in eval mode; ``model(input_ids [B, T]) -> logits [B, T, vocab]``.
    Raises:
        CheckpointError: unusable directory (no config.json, missing shard, bad index).
        UnsupportedArchitectureError: config.json names no supported architecture.
        UnexpectedWeightError / WeightShapeError / NonFiniteWeightError / MissingWeightError /
        DuplicateWeightError: a bad tensor; the error names the tensor key and file.
    """
    return load_model_with_report(path, quantization, device, dtype, kernel, fp8_mode, track_memory=False)[0]
