"""The public calls: load a checkpoint layer by layer (``load_model``) and reload it in place
(``reload_weights``), with the reports they return."""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from layerwise.checkpoint import Checkpoint, group_name
from layerwise.config import ModelConfig
from layerwise.distributed import TPContext
from layerwise.dtypes import parse_dtype
from layerwise.errors import ConfigError, DeviceError, LayerwiseError, ReloadError, WeightDtypeError, WeightShapeError
from layerwise.kernels import resolve_kernel
from layerwise.memory import DeviceMemoryTracker, tensor_bytes
from layerwise.quant.checkpoint_fp8 import Fp8CheckpointFormat, Fp8CheckpointLinearMethod, resolve_scheme
from layerwise.quant.config import QuantConfig
from layerwise.registry import get_model_class
from layerwise.reload.deferred import model_defers_checks
from layerwise.reload.kernel_format import KernelTensorWriter, named_kernel_tensors
from layerwise.reload.session import layerwise_session, record_metadata_for_reloading
from layerwise.reload.types import ReloadReport
from layerwise.routing import stream_weights
from layerwise.transfer.packed_tensor import flat_bytes

Weights = str | os.PathLike | Iterable[tuple[str, torch.Tensor]]


@dataclass
class LoadReport:
    """What a load did and cost. Bytes are bytes, seconds are wall-clock seconds.

    Attributes:
        num_layers: decoder layers of the model.
        peak_bytes: peak live tensor bytes on the device during the load (DeviceMemoryTracker).
        model_bytes: bytes of the loaded model's parameters and buffers on the device.
        largest_layer_checkpoint_bytes: checkpoint bytes of the largest load group (one decoder
            layer, or one top-level module such as embed_tokens or lm_head).
        overhead_per_layer: (peak_bytes - model_bytes) / largest_layer_checkpoint_bytes.
        bytes_read: checkpoint payload bytes this process read (under tensor parallelism: its slices of
            the sharded tensors plus the whole replicated ones, about checkpoint_bytes / tp_size).
        tp_rank / tp_size: this process's place in the tensor-parallel group (0 / 1 without one).
        largest_unit_bytes: the most checkpoint-dtype bytes the load materialized on the device at once:
            one whole module (qkv_proj, gate_up_proj, ...) or, in a mixture-of-experts layer, one
            processing unit (one expert's fused gate+up, or its down). With FP8, peak_bytes - model_bytes
            is about this plus the quantization's float32 work buffer (at most 1 MiB; for an expert, a
            quarter of the unit's BF16 bytes).
        unit_bytes_by_layer: the same figure per load group ("layers.3", "embed_tokens", "lm_head", ...).
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
    bytes_read: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    largest_unit_bytes: int = 0
    unit_bytes_by_layer: dict = field(default_factory=dict)
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


class _Progress:
    """A tqdm bar over the checkpoint's load groups (decoder layers, embeddings, norm, head)."""

    def __init__(self, groups: dict[str, int], enabled: bool):
        self.bar, self.current = None, None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=len(groups), unit="group", desc="loading")

    def on_tensor(self, key: str) -> None:
        group = group_name(key)
        if self.bar is not None and group != self.current:
            if self.current is not None:
                self.bar.update(1)
            self.bar.set_postfix_str(group)
        self.current = group

    def close(self, completed: bool) -> None:
        if self.bar is not None:
            if completed:
                self.bar.update(1)
            self.bar.close()


def resolve_device(device: str | torch.device | int) -> torch.device:
    """``device`` as a torch.device that layerwise can run on with this torch build and machine: cpu, or a CUDA
    GPU that torch sees. Checked before anything is built or read (``load_model`` and the CLI's ``--device``).

    Raises:
        DeviceError: not a device name; a device type other than cpu and cuda; cuda with no CUDA GPU visible to
            torch (the message names the torch version and whether the build has CUDA at all); a GPU index past
            the visible ones.
    """
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise DeviceError(device, f"not a device name (use cpu, cuda or cuda:N): {e}") from e
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise DeviceError(device, "layerwise runs on cpu and cuda devices")
    if not torch.cuda.is_available():
        if torch.version.cuda:
            build = f"built for CUDA {torch.version.cuda}: check nvidia-smi and CUDA_VISIBLE_DEVICES"
        else:
            build = "a CPU-only build without CUDA"
        raise DeviceError(
            device,
            f"no CUDA GPU is visible to torch (torch {torch.__version__}, {build}); use cpu, or a CUDA build of "
            f"torch on a machine with a GPU",
        )
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise DeviceError(device, f"only {count} CUDA device(s) visible: cuda:0 to cuda:{count - 1}")
    return resolved


def load_model_with_report(
    path: str | os.PathLike,
    quantization: str | None = "fp8",
    device="cpu",
    dtype=None,
    kernel: str | None = None,
    fp8_mode: str = "auto",
    progress: bool = False,
    track_memory: bool = True,
    tp_group=None,
    global_scales: bool = False,
    mmap: bool = True,
    expert_parallel: bool = False,
) -> tuple[nn.Module, LoadReport]:
    """Like :func:`load_model`, and also returns the :class:`LoadReport`.

    Args:
        progress: show a tqdm progress bar over the load groups on stderr.
        track_memory: measure the peak with :class:`DeviceMemoryTracker` (on CPU its dispatch mode
            adds Python work to every tensor operation; with False, peak_bytes is reported as -1).
    """
    start = time.perf_counter()
    device = resolve_device(device)
    tp = TPContext.of(tp_group, expert_parallel)
    ckpt = Checkpoint(path, mmap=mmap)
    config = ModelConfig.from_dict(ckpt.config, ckpt.config_path)
    arch, model_cls = get_model_class(config, ckpt.config_path)
    fp8_format = Fp8CheckpointFormat.from_config(ckpt.config, ckpt.config_path)
    params_dtype = parse_dtype(dtype) or config.dtype or torch.bfloat16
    amax_reduce = (lambda a: tp.all_reduce(a, "max")) if global_scales and tp.size > 1 else None
    quantization = resolve_scheme(quantization, fp8_format)
    quant_config = QuantConfig(quantization, resolve_kernel(kernel, device), fp8_mode, amax_reduce, fp8_format)
    groups = ckpt.group_bytes()
    tracker = DeviceMemoryTracker(device) if track_memory else contextlib.nullcontext()
    completed = False
    with tracker:
        try:
            with torch.device("meta"):
                model = model_cls(config, quant_config, params_dtype, device, tp=tp)  # checks the TP sizes
        except ConfigError as e:  # a config value the layers refuse (rope_type, sliding_window, layer_types)
            e.add_context(file=ckpt.config_path)
            raise
        record_metadata_for_reloading(model)
        bar = _Progress(groups, progress)  # after the build: a config error then prints on a line of its own
        try:
            with layerwise_session(model, device=device) as session:
                stream_weights(model, ckpt.iter_lazy(), ckpt.file_of, bar.on_tensor)
            completed = True
        finally:
            bar.close(completed)
            ckpt.close()
    model.eval()
    report = LoadReport(
        architecture=arch,
        num_layers=config.num_hidden_layers,
        device=str(device),
        quantization=quant_config.scheme,
        kernel=quant_config.kernel,
        dtype=str(params_dtype).replace("torch.", ""),
        checkpoint_bytes=ckpt.total_bytes,
        model_bytes=tensor_bytes(model, device),
        largest_layer_checkpoint_bytes=max(groups.values()),
        peak_bytes=tracker.peak_bytes if track_memory else -1,
        seconds=time.perf_counter() - start,
        memory_tracker=tracker.method if track_memory else "none",
        peak_rss_anon_bytes=tracker.peak_rss_anon_bytes if track_memory else 0,
        peak_buffered_bytes=session.peak_buffered_bytes,
        bytes_read=ckpt.bytes_read,
        tp_rank=tp.rank,
        tp_size=tp.size,
        largest_unit_bytes=max(session.unit_bytes.values(), default=0),
        unit_bytes_by_layer=_unit_bytes_by_layer(session.unit_bytes),
        timeline=tracker.timeline if track_memory else [],
    )
    return model, report


def _unit_bytes_by_layer(unit_bytes: dict[str, int]) -> dict[str, int]:
    by_layer: dict[str, int] = {}
    for prefix, nbytes in unit_bytes.items():
        group = group_name(prefix + ".weight")
        by_layer[group] = max(by_layer.get(group, 0), nbytes)
    return by_layer


def load_model(
    path: str | os.PathLike,
    quantization: str | None = "fp8",
    device="cpu",
    dtype=None,
    kernel: str | None = None,
    fp8_mode: str = "auto",
    tp_group=None,
    global_scales: bool = False,
    mmap: bool = True,
    expert_parallel: bool = False,
) -> nn.Module:
    """Load a Hugging Face checkpoint layer by layer, quantizing decoder Linear weights on the fly.

    Modules are built on the meta device; each is materialized on ``device`` only once all of
    its checkpoint tensors have arrived, then quantized, so the device holds the final model plus
    about one module in the checkpoint dtype at any time.

    Args:
        path: directory with config.json and *.safetensors (model.safetensors or an index.json).
        quantization: a scheme (case-insensitive): "fp8" (= "fp8-per-tensor": float8_e4m3fn
            weights, float32 per-tensor ``weight_scale``), "fp8-per-channel", "fp8-per-block",
            "torchao:<Config>", or None / "none" (checkpoint dtype, or ``dtype``). A pre-quantized FP8
            checkpoint (config.json ``quantization_config``, ``layerwise.quant.checkpoint_fp8``): "fp8" keeps
            its own layout, the file's bytes and scales; another scheme re-quantizes its dequantized weights;
            None dequantizes them into ``dtype``.
        device: target device ("cpu", "cuda", "cuda:1", torch.device).
        dtype: dtype of unquantized parameters (embeddings, norms, lm_head, and all Linear weights
            with quantization none): torch.dtype or name; default: config.json's dtype, else bf16.
        kernel: "torch" or "triton" for the FP8 quantization kernels; None = triton on CUDA,
            torch on CPU. "triton" on CPU runs Triton's interpreter (slow; for testing).
        fp8_mode: forward of FP8 layers: "auto" (W8A8 via torch._scaled_mm on CUDA sm89+, W8A16
            elsewhere), "w8a8" (also on CPU, slowly), or "w8a16" (dequantize, then matmul).
        tp_group: a torch.distributed ProcessGroup to shard the model over (tensor parallelism, as vLLM:
            see layerwise/layers/linear.py and embedding.py); every rank of the group calls load_model
            with the same arguments, reads only its slices of the checkpoint and holds only its shard.
            None: no tensor parallelism, whatever torch.distributed's default group is. Kept on the model
            as ``model.tp_group``; forward, reload and weight sync use it.
        global_scales: with tp_group and FP8, reduce (max) over the group every amax that spans the ranks'
            shards (per tensor; per channel, a row-parallel row or an expert's down row) so that every rank's
            FP8 shard equals the matching slice of the unsharded model byte for byte; False (vLLM's behaviour):
            each rank's scale comes from its own shard.
        expert_parallel: with tp_group, how mixture-of-experts layers are sharded (vLLM's two layouts,
            ``layerwise/layers/fused_moe.py``): False, every rank holds every expert with its intermediate
            dimension split (w13_weight [E, 2I/N, H], w2_weight [E, H, I/N]); True, rank r holds experts
            [r*E/N, (r+1)*E/N) whole and reads no other expert. Either way the router is replicated and each MoE
            layer's output is all-reduced once. Dense layers are sharded as always.
        mmap: read the shards through a memory map (no copy: the fastest load). A shard truncated while the
            load uses its pages still kills the process with SIGBUS; False reads with ``os.preadv`` into
            host buffers (about 20% slower on a 2-core CPU), so a shard that changes during the load is a
            CheckpointChangedError naming it. Reloads always read that way (Limitations 13 in
            layerwise/reload/__init__.py).
    Returns:
        the model in eval mode; ``model(input_ids [B, T]) -> logits [B, T, vocab]`` (every rank returns
        the full logits; all ranks of the group must call forward together).
    Raises:
        CheckpointError: unusable directory (no config.json, missing or truncated shard, bad index, a tensor
            of an unsupported dtype); its subclass ConfigError: a config.json that lacks a required field or holds
            a value the model refuses (an unknown rope_type, a bad sliding_window or layer_types, a
            quantization_config that is not an FP8 layout layerwise reads). Names the file.
        UnsupportedArchitectureError: config.json names no supported architecture.
        UnexpectedWeightError / WeightShapeError / NonFiniteWeightError / MissingWeightError /
        DuplicateWeightError: a bad tensor; the error names the tensor key and file. WeightDtypeError (a
        WeightShapeError): a tensor of a dtype its parameter must not be cast from (float8 where the checkpoint
        has no quantization_config, integers); MissingScaleError: an FP8 weight without its scale.
        DeviceError: ``device`` is not cpu or a CUDA GPU that this torch build sees (a CPU-only torch asked for
            cuda names its version); raised before the checkpoint is opened (see :func:`resolve_device`).
        ValueError: an unknown scheme (the message suggests the nearest one), dtype, kernel or fp8_mode.
        TensorParallelError: the model's sizes (attention heads, kv heads, intermediate size, FP8 blocks; an MoE
            layer's experts under expert parallelism, its moe intermediate size otherwise) do not split over
            tp_group; raised before any weight is read.
        MissingDependencyError: a torchao scheme without torchao.
    """
    return load_model_with_report(
        path,
        quantization,
        device,
        dtype,
        kernel,
        fp8_mode,
        track_memory=False,
        tp_group=tp_group,
        global_scales=global_scales,
        mmap=mmap,
        expert_parallel=expert_parallel,
    )[0]


def _open_weights(model: nn.Module, weights: Weights, lazy: bool):
    if isinstance(weights, (str, os.PathLike)):
        ckpt = Checkpoint(weights)
        config = ModelConfig.from_dict(ckpt.config, ckpt.config_path)
        own = model.config
        for name in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "head_dim",
            "num_experts",
            "moe_intermediate_size",
        ):
            if getattr(config, name) != getattr(own, name):
                raise WeightShapeError(
                    f"checkpoint config {name}={getattr(config, name)} differs from the live "
                    f"model's {getattr(own, name)}",
                    file=ckpt.config_path,
                )
        fp8_format = Fp8CheckpointFormat.from_config(ckpt.config, ckpt.config_path)  # refuses an unreadable one
        own_format = checkpoint_fp8_format(model) if lazy else fp8_format  # lazy: a checkpoint-format reload
        if fp8_format != own_format:
            described = fp8_format.describe() if fp8_format else "unquantized (no quantization_config)"
            raise WeightDtypeError(
                f"the checkpoint's linear weights are {described}, the live model was loaded from "
                f"{own_format.describe() if own_format else 'an unquantized checkpoint'}: a reload takes weights in "
                f"the format the model was loaded from; load the model from this checkpoint instead",
                file=ckpt.config_path,
            )
        return (ckpt.iter_lazy() if lazy else ckpt), ckpt.file_of  # lazy: each rank reads only its slices
    return weights, None


def checkpoint_fp8_format(model: nn.Module) -> Fp8CheckpointFormat | None:
    """The FP8 checkpoint layout ``model`` was loaded from (and so takes on a checkpoint-format reload or weight
    update), or None for a model loaded from an unquantized checkpoint."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, Fp8CheckpointLinearMethod):
            return method.fmt
    return None


def reload_weights(
    model: nn.Module, weights: Weights, *, is_checkpoint_format: bool = True, atomic: bool = False
) -> ReloadReport:
    """Reload weights into ``model`` in place: every parameter keeps its object, storage and data_ptr.

    Args:
        model: a model returned by :func:`layerwise.load_model`. A tensor-parallel model (``model.tp_group``):
            every rank calls reload_weights with the same full (unsharded) weights; each rank reads or keeps
            only its own slices.
        weights: a checkpoint directory, or any iterable of (name, tensor). Tensors may live on any
            device; those waiting for the rest of their module are kept on the CPU (a list or tuple on
            CUDA: the caller's own tensors are kept, Limitations 12).
        is_checkpoint_format: True: Hugging Face names and dtype (e.g. BF16); each complete module
            is re-quantized and copied into its kernel tensors. Modules absent from the stream are
            left unchanged (partial updates). False: the model's own parameter names
            (``model.named_parameters()``, e.g. ``...qkv_proj.weight`` in float8_e4m3fn and
            ``...qkv_proj.weight_scale``), copied directly after a dtype/shape/finiteness check.
        atomic: stage every processed module and write the kernel tensors only once the whole
            stream has been checked. Extra device memory: the processed (kernel-format) size of
            every module in the stream, i.e. up to the model's own size for a full reload. Without
            it, the extra memory is about one module in the checkpoint dtype. On the CPU that module's
            staging buffer stays on the model for the next reload (``layerwise.reload.release_staging``
            frees it; Limitations 8 in ``layerwise/reload/__init__.py``).
    Returns:
        a :class:`ReloadReport`.
    Raises:
        ReloadError: the stream named an unknown tensor, a wrong shape, a non-finite value, a region
            twice, or left a module incomplete, or it (or torch) raised another exception midway (a
            shard of the directory truncated, rewritten or replaced meanwhile: a CheckpointChangedError naming
            the file, then ``cause``; Limitations 13 in ``layerwise/reload/__init__.py``). Raised before the
            affected module's kernel tensors are touched; ``updated_modules`` lists the modules already
            overwritten (none when ``atomic``), every other module holds its previous values, and the model
            stays usable.
            The original error is chained as ``__cause__`` and kept as ``cause``. One exception: a list or
            tuple reloaded on CUDA is checked for NaN/Inf on the device, read once at the end (no host
            synchronization per module; Limitations 12 in ``layerwise/reload/__init__.py``), so a non-finite
            value is raised after the whole stream was written, the module holding it included, and
            ``updated_modules`` lists them all (``atomic``: still nothing changed). Its tensors must not
            change until the call returns.
    """
    start = time.perf_counter()
    try:
        stream, file_of = _open_weights(model, weights, lazy=is_checkpoint_format)
    except LayerwiseError as e:
        raise ReloadError.wrap(e, []) from e
    try:
        return _reload(model, stream, file_of, is_checkpoint_format, atomic, start)
    finally:
        if isinstance(stream, Checkpoint):  # opened here: drop its file handles now, not at garbage collection
            stream.close()


def _reload(model: nn.Module, stream, file_of, is_checkpoint_format: bool, atomic: bool, start: float) -> ReloadReport:
    if not is_checkpoint_format:
        writer = KernelTensorWriter(model, atomic)
        try:
            for name, tensor in stream:
                writer.write(name, tensor)
            writer.commit()
        except Exception as e:  # a LayerwiseError, or an I/O or torch error midway: name what was overwritten
            raise ReloadError.wrap(e, writer.updated) from e  # atomic: filled only by the commit, so exact too
        return ReloadReport(writer.updated, time.perf_counter() - start, 0)
    session = None
    try:
        with layerwise_session(model, atomic=atomic, defer_checks=_defers_checks(model, stream)) as session:
            stream_weights(model, stream, file_of)
    except ReloadError:
        raise  # finalize already restored the model and listed the updated modules
    except Exception as e:  # a LayerwiseError, or an I/O or torch error midway: the session was aborted
        is_ours = isinstance(e, LayerwiseError)
        if is_ours and e.key and file_of is not None:  # raised at finalize (a queued unit's NaN), past stream_weights
            e.add_context(file=file_of(e.key))
        if session is None:  # the session never started (another one is open on the model): nothing was touched
            if not is_ours:
                raise
            raise ReloadError.wrap(e, []) from e
        # name what it overwrote, and what of that holds NaN or Inf (Limitations 12)
        raise ReloadError.wrap(e, session.updated_before_abort, non_finite_modules=session.non_finite_modules) from e
    return ReloadReport(list(session.processed), time.perf_counter() - start, session.peak_buffered_bytes)


def _defers_checks(model: nn.Module, stream) -> bool:
    """Whether a reload of ``stream`` checks NaN/Inf on the device and reads the results once, at its end, with
    copies that do not wait (Limitations 12 in ``layerwise/reload/__init__.py``): for a list or tuple (the caller
    holds its tensors until the call returns; an iterator may refill a buffer it handed out) of a model that
    :func:`model_defers_checks`."""
    return isinstance(stream, (list, tuple)) and model_defers_checks(model)


def model_digest(model: nn.Module) -> dict[str, str]:
    """SHA-256 of the bytes of every parameter and buffer, by name (to prove what a reload changed)."""
    out = {}
    for name, t in named_kernel_tensors(model).items():
        out[name] = hashlib.sha256(flat_bytes(t).cpu().numpy().tobytes()).hexdigest()
    return out
