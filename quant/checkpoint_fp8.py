"""Pre-quantized FP8 checkpoints: their ``quantization_config`` and the linear method that loads their weights.

Two layouts are read, both with float8_e4m3fn weights and float32 dequantization multipliers (w ~= weight * scale):

=======================  ==============================================  =================================
config.json              scale tensor per linear                         granularity
=======================  ==============================================  =================================
quant_method "fp8",      ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]  block (DeepSeek-V3, Qwen3-FP8;
weight_block_size        (despite the name, the multiplier)               vLLM's ``Fp8Config``)
[128, 128]
quant_method "fp8"       ``weight_scale`` [1]                             tensor
compressed-tensors       ``weight_scale`` [1] / [N, 1] /                  "strategy": tensor / channel /
"float-quantized"        [ceil(N/128), ceil(K/128)]                       block (llm-compressor)
=======================  ==============================================  =================================

A module's float8 ``weight`` and its scale are one unit: the module is processed only when both have arrived
(the session counts the elements of both), so neither is written without the other.

:class:`Fp8CheckpointLinearMethod` creates those two checkpoint-format parameters and, after loading, turns them
into the kernel tensors of the scheme the user asked for (``target``):

- the same layout: the file's bytes and scales are kept as they are (fp8-per-block from a block checkpoint whose
  fused shards each start on a whole block; fp8-per-channel from a per-tensor or per-channel checkpoint, a per-tensor
  scale repeated over its rows; fp8-per-tensor where every row of the layer has the same scale);
- anything else: the weight is dequantized (weight x scale in float32, rounded to the parameters' dtype, 128 rows
  at a time) and handed to the target method as the BF16 checkpoint of the dequantized weights would be
  (re-quantized by an FP8 scheme or torchao; ``quantization=None`` keeps the dequantized weight). vLLM, given
  per-tensor shards with different scales, re-quantizes a fused layer to their maximum; here the dequantized layer
  gets a scale of its own amax.

Activations are quantized dynamically (per token / tensor / token group, as for every FP8 scheme here): a checkpoint
with static activation scales is refused when its config is read, as are other formats (e5m2, other block shapes,
integer compressed-tensors schemes) and FP8 experts of MoE layers.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from layerwise.errors import ConfigError, TensorParallelError
from layerwise.kernels import FP8_DTYPE, fp8_dequantize
from layerwise.quant.base import QuantMethod, check_finite
from layerwise.quant.fp8 import Fp8LinearMethod
from layerwise.quant.parameters import BlockScaleParameter, ModelWeightParameter, RowScaleParameter, WeightLoader

#: the one block shape read: (rows, columns), as every published block-FP8 checkpoint
BLOCK = (128, 128)
#: fused layers -> the checkpoint modules they absorb, to match a checkpoint's list of unquantized modules
FUSED_SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True)
class Fp8CheckpointFormat:
    """How a pre-quantized FP8 checkpoint stores its linear weights (parsed from config.json ``quantization_config``).

    Attributes:
        granularity: "tensor" (a scale of one element per tensor, or per row: read alike), "channel" or "block".
        scale_name: the checkpoint's name of the scale next to ``weight``: "weight_scale_inv" or "weight_scale".
        ignored: modules left unquantized (``modules_to_not_convert`` / ``ignored_layers`` / ``ignore``): names,
            name suffixes, or "re:<regex>" patterns (compressed-tensors).
        quant_method: "fp8" or "compressed-tensors".
    """

    granularity: str
    scale_name: str
    ignored: tuple[str, ...] = ()
    quant_method: str = "fp8"

    @property
    def scheme(self) -> str:
        """The layerwise scheme whose kernel tensors are the file's bytes and scales: "fp8-per-block", ..."""
        return f"fp8-per-{self.granularity}"

    def describe(self) -> str:
        """For messages: "FP8 (fp8, per-block weight_scale_inv)"."""
        return f"FP8 ({self.quant_method}, per-{self.granularity} {self.scale_name})"

    @classmethod
    def from_config(cls, config: dict, source: str | None = None) -> Fp8CheckpointFormat | None:
        """The format of a checkpoint whose config.json dict is ``config``; None when it has no
        ``quantization_config`` (a BF16 / FP16 / FP32 checkpoint).

        Raises:
            ConfigError: a ``quantization_config`` this loader does not read, naming the field and value: another
                ``quant_method`` (gptq, awq, bitsandbytes, ...), an FP8 format other than e4m3, a block other than
                128 x 128, static activation scales, or a compressed-tensors scheme that is not 8-bit float weights
                in one group. ``source`` (the config file) is named.
        """
        qc = config.get("quantization_config")
        if qc is None:
            return None
        if not isinstance(qc, dict):
            raise ConfigError(f"config.json quantization_config must be an object, got {qc!r}", file=source)
        method = str(qc.get("quant_method", "")).lower()
        if method == "fp8":
            return cls._from_fp8(qc, source)
        if method == "compressed-tensors":
            return cls._from_compressed_tensors(qc, source)
        raise ConfigError(
            f"config.json quantization_config.quant_method={qc.get('quant_method')!r}: layerwise reads FP8 "
            f"checkpoints (quant_method 'fp8', or 'compressed-tensors' with 8-bit float weights) and unquantized "
            f"ones; use the model's BF16 checkpoint",
            file=source,
        )

    @classmethod
    def _from_fp8(cls, qc: dict, source: str | None) -> Fp8CheckpointFormat:
        fmt = str(qc.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ConfigError(
                f"config.json quantization_config.fmt={qc.get('fmt')!r}: FP8 weights are read as e4m3 "
                f"(float8_e4m3fn) only",
                file=source,
            )
        _refuse_static(qc.get("activation_scheme", "dynamic"), "activation_scheme", source)
        block = qc.get("weight_block_size")
        ignored = tuple(qc.get("modules_to_not_convert") or ()) + tuple(qc.get("ignored_layers") or ())
        if block is None:
            return cls("tensor", "weight_scale", ignored)
        _check_block(block, "weight_block_size", source)
        return cls("block", "weight_scale_inv", ignored)

    @classmethod
    def _from_compressed_tensors(cls, qc: dict, source: str | None) -> Fp8CheckpointFormat:
        where = "config.json quantization_config"
        if qc.get("format") not in ("float-quantized", "naive-quantized"):
            raise ConfigError(
                f"{where}.format={qc.get('format')!r}: of compressed-tensors checkpoints, layerwise reads the "
                f"'float-quantized' FP8 layout only",
                file=source,
            )
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise ConfigError(
                f"{where}.config_groups has {len(groups)} groups: layerwise reads one FP8 scheme for every linear",
                file=source,
            )
        ((name, group),) = groups.items()
        weights = group.get("weights") or {}
        if weights.get("num_bits") != 8 or weights.get("type") != "float":
            raise ConfigError(
                f"{where}.config_groups.{name}.weights: num_bits={weights.get('num_bits')!r}, "
                f"type={weights.get('type')!r}; layerwise reads 8-bit float (FP8) weights only",
                file=source,
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise ConfigError(
                f"{where}.config_groups.{name}.weights.strategy={strategy!r}: FP8 weights per tensor, channel or "
                f"block only",
                file=source,
            )
        if strategy == "block":
            _check_block(weights.get("block_structure"), f"config_groups.{name}.weights.block_structure", source)
        if weights.get("symmetric", True) is not True:
            raise ConfigError(
                f"{where}.config_groups.{name}.weights.symmetric={weights.get('symmetric')!r}: FP8 weights with zero "
                f"points are not read; symmetric FP8 only",
                file=source,
            )
        activations = group.get("input_activations")
        if activations is not None and not activations.get("dynamic", False):
            _refuse_static("static", f"config_groups.{name}.input_activations.dynamic=false", source)
        for field, what in (
            ("output_activations", f"config_groups.{name}.output_activations"),
            ("kv_cache_scheme", "kv_cache_scheme"),
        ):
            value = (group if field == "output_activations" else qc).get(field)
            if value is not None:
                raise ConfigError(
                    f"{where}.{what} is set: the checkpoint carries static {field.replace('_', ' ')} scales "
                    f"(k_scale / v_scale, output_scale) that layerwise does not read; use kv_cache_dtype='fp8' for an "
                    f"FP8 KV cache calibrated at load time, and a checkpoint without them",
                    file=source,
                )
        return cls(strategy, "weight_scale", tuple(qc.get("ignore") or ()), "compressed-tensors")

    def is_ignored(self, prefix: str) -> bool:
        """Whether the linear at ``prefix`` ("model.layers.0.self_attn.qkv_proj") is stored unquantized. A fused layer
        is when all its checkpoint modules are listed.

        Raises:
            ConfigError: some of a fused layer's modules are listed and others are not (the fused weight would
                be half FP8, half BF16).
        """
        if self._listed(prefix):  # the layer's own name (Phi-3 stores qkv_proj, gate_up_proj fused)
            return True
        parent, _, name = prefix.rpartition(".")
        names = [f"{parent}.{shard}" for shard in FUSED_SHARDS.get(name, ())] or [prefix]
        listed = [n for n in names if self._listed(n)]
        if listed and len(listed) != len(names):
            raise ConfigError(
                f"config.json quantization_config lists {listed} as unquantized but not "
                f"{[n for n in names if n not in listed]}: layerwise fuses them into {prefix}, which must be all FP8 "
                f"or all unquantized"
            )
        return bool(listed)

    def _listed(self, name: str) -> bool:
        """Whether module ``name`` is listed: a "re:" pattern matching it, or an entry that is a dotted run of its
        components (the whole name, a suffix such as "lm_head" or "mlp.down_proj", or a prefix such as
        "model.layers.0" covering everything under it, as transformers' FP8 loader reads the list)."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], name):
                    return True
            elif f".{entry}." in f".{name}.":
                return True
        return False


def _refuse_static(scheme, field: str, source: str | None) -> None:
    if scheme != "dynamic":
        raise ConfigError(
            f"config.json quantization_config {field} ({scheme!r}): the checkpoint has static activation scales; "
            f"layerwise quantizes activations dynamically and does not read them: use the checkpoint's dynamic "
            f"FP8 variant or its BF16 checkpoint",
            file=source,
        )


def _check_block(block, field: str, source: str | None) -> None:
    if not isinstance(block, (list, tuple)) or tuple(block) != BLOCK:
        raise ConfigError(
            f"config.json quantization_config {field}={block!r}: FP8 blocks of {list(BLOCK)} only", file=source
        )


def resolve_scheme(quantization: str | None, fmt: Fp8CheckpointFormat | None) -> str | None:
    """The scheme to load a checkpoint of format ``fmt`` with: "fp8" (the default, any FP8) means the checkpoint's own
    FP8 layout on an FP8 checkpoint (as vLLM's ``quantization="fp8"`` uses a serialized FP8 checkpoint as it is), and
    fp8-per-tensor on a BF16 one; every other value is taken as given."""
    if fmt is not None and isinstance(quantization, str) and quantization.strip().lower() == "fp8":
        return fmt.scheme
    return quantization


class Fp8CheckpointLinearMethod(QuantMethod):
    """Loads a linear layer of a pre-quantized FP8 checkpoint and hands the result to ``target``.

    Checkpoint-format parameters: ``weight`` float8_e4m3fn [out, in] and the scale (``fmt.scale_name``): a
    :class:`RowScaleParameter` float32 [out, 1] for per-tensor and per-channel checkpoints, a
    :class:`BlockScaleParameter` float32 [sum ceil(O_i/128), ceil(in/128)] for block ones. Kernel tensors: the
    target's (see the module docstring for when they are the file's own bytes).

    Args:
        fmt: the checkpoint's format.
        target: the method of the scheme the user asked for (Fp8LinearMethod, UnquantizedLinearMethod, torchao).
    """

    def __init__(self, fmt: Fp8CheckpointFormat, target: QuantMethod):
        self.fmt, self.target = fmt, target
        self.name = target.name
        # the target's: a kept weight is a copy of the file's bytes and a dequantized one a new tensor either way,
        # and what the target makes of that new tensor (a torchao subclass) is its own business
        self.replaces_weight = target.replaces_weight
        self.output_sizes: list[int] = []
        self.params_dtype = torch.bfloat16

    def configure_tp_shard(self, layer_name: str, sharded_dim: str, local_sizes: Sequence[int]) -> None:
        """As the target's; a block checkpoint also needs whole 128-blocks per rank along ``sharded_dim``.

        Raises:
            TensorParallelError: a rank's shard would split a block of the checkpoint's scales.
        """
        self.target.configure_tp_shard(layer_name, sharded_dim, local_sizes)
        block = BLOCK[0] if sharded_dim == "output" else BLOCK[1]
        if self.fmt.granularity == "block" and any(n % block for n in local_sizes):
            raise TensorParallelError(
                f"{layer_name}: per-rank {sharded_dim} sizes {list(local_sizes)} are not multiples of the "
                f"{block}-element block of the FP8 checkpoint's scales; use a smaller tensor-parallel size"
            )

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register ``weight`` float8_e4m3fn [sum(output_sizes), input_size] and its float32 scale."""
        self.output_sizes, self.params_dtype = list(output_sizes), params_dtype
        out = sum(output_sizes)
        weight = ModelWeightParameter(
            torch.empty(out, input_size, dtype=FP8_DTYPE), weight_loader, output_dim=0, input_dim=1
        )
        if self.fmt.granularity == "block":
            scale = BlockScaleParameter(
                torch.empty(sum(self.scale_rows()), -(-input_size // BLOCK[1]), dtype=torch.float32),
                weight_loader,
                output_dim=0,
                input_dim=1,
                row_sizes=output_sizes,
                block=BLOCK,
            )
        else:
            scale = RowScaleParameter(torch.empty(out, 1, dtype=torch.float32), weight_loader, output_dim=0)
        layer.register_parameter("weight", weight)
        layer.register_parameter(self.fmt.scale_name, scale)

    def scale_rows(self) -> list[int]:
        """Rows of the checkpoint-format scale per fused shard: its block rows (ceil(O_i / 128)) for a block
        checkpoint, its O_i rows otherwise."""
        if self.fmt.granularity == "block":
            return [-(-n // BLOCK[0]) for n in self.output_sizes]
        return list(self.output_sizes)

    def _kept(self, scale: torch.Tensor) -> torch.Tensor | None:
        """The target's scale tensor when the file's bytes with their ``scale`` are already the target's kernel
        tensors, else None."""
        target = self.target
        # under tensor parallelism the file's bytes are already every rank's slice of the unsharded layer, global
        # scales or not; each decision below is the same on every rank (a per-tensor shard's scale is one number
        # every rank reads), so the ranks that re-quantize (and may all-reduce an amax) are all of them or none
        if not isinstance(target, Fp8LinearMethod):
            return None
        if self.fmt.granularity == "block":
            # the fused grid is the shards' grids stacked when every shard but the last fills whole block rows
            aligned = all(n % BLOCK[0] == 0 for n in self.output_sizes[:-1])
            return scale if target.granularity == "block" and aligned else None
        if target.granularity == "channel":
            return scale
        if target.granularity == "tensor" and self.fmt.granularity == "tensor" and bool((scale == scale[0]).all()):
            return scale[0].reshape(1)
        return None

    def dequantized(self, layer: nn.Module) -> torch.Tensor:
        """The layer's loaded FP8 weight times its scale, [out, in] in the parameters' dtype: each product in float32,
        then rounded, as the BF16 checkpoint of the dequantized weights would hold it. Computed a 128-row block at a
        time, so the float32 temporary is 128 rows, not the layer."""
        q, scale = layer.weight.data, getattr(layer, self.fmt.scale_name).data
        out = torch.empty(q.shape, dtype=self.params_dtype, device=q.device)
        row = grid_row = 0
        for n, n_scale in zip(self.output_sizes, self.scale_rows(), strict=True):  # each shard, its own scale rows
            for start in range(0, n, BLOCK[0]):
                rows = slice(row + start, row + min(n, start + BLOCK[0]))
                if self.fmt.granularity == "block":
                    scales = scale[grid_row + start // BLOCK[0]].unsqueeze(0)
                else:
                    scales = scale[rows]
                out[rows] = fp8_dequantize(q[rows], scales, self.params_dtype)
            row, grid_row = row + n, grid_row + n_scale
        return out

    def process_weights_after_loading(self, layer: nn.Module, into: dict[str, torch.Tensor] | None = None) -> None:
        """Keep the file's bytes and scale as the target's kernel tensors where the layouts agree; otherwise
        dequantize and let the target process the weight (``into``: as the target takes it).

        Raises:
            NonFiniteWeightError: the scale or another parameter (a bias) holds NaN or Inf (float8_e4m3fn bytes
                can hold NaN too: the weight is checked where it is dequantized).
        """
        scale_name = self.fmt.scale_name
        q, scale = layer.weight.data, getattr(layer, scale_name).data
        kept = self._kept(scale)
        # float8_e4m3fn has a NaN encoding: a kept weight is checked here, a dequantized one by the target
        check_finite(layer, skip=() if kept is not None else ("weight",))
        if kept is not None:
            delattr(layer, scale_name)
            layer.weight = nn.Parameter(q.clone(), requires_grad=False)
            layer.register_parameter(self.target.scale_name, nn.Parameter(kept.clone(), requires_grad=False))
            return
        w = self.dequantized(layer)
        delattr(layer, scale_name)
        layer.weight = nn.Parameter(w, requires_grad=False)
        self.target.process_weights_after_loading(layer, into)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The target's forward: y [..., out] = x [..., in] @ W^T + bias."""
        return self.target.apply(layer, x, bias)
