"""Linear layers sharded over a tensor-parallel group, and fused layers that own their fusion.

Naming and sharding rules follow vLLM (``vllm/model_executor/layers/linear.py``): with N ranks,
rank r holds

- ``ColumnParallelLinear``: output rows [r*O/N, (r+1)*O/N); nothing to do after the matmul.
- ``MergedColumnParallelLinear`` (gate_up_proj): O_i/N rows of each fused shard i, concatenated.
- ``QKVParallelLinear`` (qkv_proj): H/N query heads; K/N kv heads, or, when N > K, the one kv head
  r*K//N, replicated on N/K ranks (vLLM's ``num_kv_head_replicas``).
- ``RowParallelLinear`` (o_proj, down_proj): input columns [r*I/N, (r+1)*I/N); the partial outputs are
  all-reduced (sum) and the bias is added once, after the reduce.

Fused layers declare the checkpoint names they absorb in ``checkpoint_shards`` (checkpoint module name ->
shard_id), so the recursive ``load_weights`` routes ``mlp.gate_proj.weight`` to ``mlp.gate_up_proj`` with
shard_id 0 without a mapping table in the model file. A checkpoint that stores the fused tensor under the
layer's own name (Phi-3) loads it with shard_id None; it is split into its parts and each part narrowed to
this rank's rows, as if the parts had arrived one by one. Every loader reads only this rank's slice.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

import torch
from torch import nn

from layerwise.distributed import NO_TP, TPContext
from layerwise.errors import TensorParallelError
from layerwise.quant.base import QuantMethod
from layerwise.quant.parameters import ModelWeightParameter


class LinearBase(nn.Module):
    """y = x W^T + b with W [sum(output_sizes), input_size] created by ``quant_method`` in ``params_dtype``.

    Args:
        input_size / output_sizes: this rank's input features and fused output shard sizes.
        bias: whether a bias [sum(output_sizes)] is created (never quantized).
        quant_method: creates, processes and applies the weight.
        params_dtype: checkpoint-format dtype of weight and bias.
        prefix: the layer's name in the model, for error messages.
        tp: the tensor-parallel group (default: none).
    """

    #: checkpoint module names this layer absorbs -> shard_id (empty: the layer's own name only)
    checkpoint_shards: Mapping[str, Hashable] = MappingProxyType({})
    #: which dimension of the weight is split across ranks ("output" or "input")
    sharded_dim = "output"

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        quant_method: QuantMethod,
        params_dtype: torch.dtype,
        prefix: str = "",
        tp: TPContext = NO_TP,
    ):
        super().__init__()
        self.tp = tp
        self.prefix = prefix
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.quant_method = quant_method
        if tp.size > 1:
            local = self.output_sizes if self.sharded_dim == "output" else [input_size]
            quant_method.configure_tp_shard(prefix or type(self).__name__, self.sharded_dim, local)
        quant_method.create_weights(self, input_size, self.output_sizes, params_dtype, self.weight_loader)
        if bias:
            self.bias = ModelWeightParameter(
                torch.empty(sum(self.output_sizes), dtype=params_dtype), self.weight_loader, output_dim=0
            )
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: ModelWeightParameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Write the checkpoint tensor ``loaded_weight`` (CPU, float, full unsharded size) into this rank's part of
        ``param`` (this layer's weight [out, in] or bias [out]); ``shard_id`` names the fused part it fills (a
        value of ``checkpoint_shards``), None for the whole tensor.

        Raises:
            WeightShapeError: the tensor does not have the full shape of the region (names both shapes).
            ValueError: a ``shard_id`` this layer does not have.
        """
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., input_size] -> [..., sum(output_sizes)] (this rank's output columns) in x.dtype."""
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        tp = f", tp={self.tp.rank}/{self.tp.size}" if self.tp.size > 1 else ""
        return f"in={self.input_size}, out={self.output_sizes}, method={self.quant_method.name}{tp}"


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; one or more checkpoint tensors fused along it.

    Rank r holds rows [r*O_i/N, (r+1)*O_i/N) of each shard i (vLLM: ``ColumnParallelLinear``,
    ``MergedColumnParallelLinear``). Weight [sum(O_i)/N, in], bias [sum(O_i)/N] per rank.

    Args:
        output_sizes: full (unsharded) output size of each shard (one entry for an unfused layer).
    Raises:
        TensorParallelError: an output size is not divisible by the group size (names the layer).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        quant_method: QuantMethod,
        params_dtype: torch.dtype,
        prefix: str = "",
        tp: TPContext = NO_TP,
        _local: tuple[list[int], list[int]] | None = None,
    ):
        self.full_sizes = list(output_sizes)
        if _local is None:  # even split: shard i's rows [r * O_i/N, (r+1) * O_i/N)
            local = [tp.divide(s, f"{prefix or type(self).__name__}: output size") for s in output_sizes]
            _local = (local, [tp.rank * n for n in local])
        local_sizes, self.source_starts = _local
        super().__init__(
            input_size,
            local_sizes,
            bias=bias,
            quant_method=quant_method,
            params_dtype=params_dtype,
            prefix=prefix,
            tp=tp,
        )

    def _shard_index(self, shard_id: Hashable) -> int:
        return 0

    def shard_offset_size(self, shard_id: Hashable) -> tuple[int, int]:
        """(offset, size) of shard ``shard_id`` along the output dimension of this rank's weight."""
        i = self._shard_index(shard_id)
        return sum(self.output_sizes[:i]), self.output_sizes[i]

    def _load_part(self, param, loaded_weight, i: int, source_offset: int, source_size: int) -> None:
        param.load_shard(
            loaded_weight,
            sum(self.output_sizes[:i]),
            self.output_sizes[i],
            dim="output",
            source_start=source_offset + self.source_starts[i],
            source_size=source_size,
        )

    def weight_loader(self, param, loaded_weight, shard_id=None):
        """As :meth:`LinearBase.weight_loader`: rows [r * O_i / N, (r + 1) * O_i / N) of the [O_i, in] checkpoint
        tensor of shard i go to this rank's rows of shard i; shard_id None: the whole fused [sum(O_i), in] tensor,
        split into its shards."""
        if shard_id is None:  # the whole (possibly fused) checkpoint tensor: split it into its parts
            total = sum(self.full_sizes)
            for i in range(len(self.full_sizes)):
                self._load_part(param, loaded_weight, i, sum(self.full_sizes[:i]), total)
            return
        i = self._shard_index(shard_id)
        self._load_part(param, loaded_weight, i, 0, self.full_sizes[i])


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel checkpoint tensors concatenated along the output dimension.

    Per rank: [O_0/N | O_1/N | ...] rows (gate_up_proj: I/N rows of gate, then I/N rows of up).

    Args:
        output_sizes: full (unsharded) output size of each shard, e.g. [intermediate, intermediate].
        checkpoint_shards: checkpoint module name -> shard_id, in output order, e.g.
            {"gate_proj": 0, "up_proj": 1}. A checkpoint that already stores the fused tensor under
            this layer's own name (Phi-3's gate_up_proj) loads it whole (shard_id None).
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        checkpoint_shards: Mapping[str, Hashable],
        bias: bool,
        quant_method: QuantMethod,
        params_dtype: torch.dtype,
        prefix: str = "",
        tp: TPContext = NO_TP,
        _local: tuple[list[int], list[int]] | None = None,
    ):
        if len(output_sizes) != len(checkpoint_shards):
            raise ValueError(f"{len(output_sizes)} output sizes for {len(checkpoint_shards)} checkpoint shards")
        super().__init__(
            input_size,
            output_sizes,
            bias=bias,
            quant_method=quant_method,
            params_dtype=params_dtype,
            prefix=prefix,
            tp=tp,
            _local=_local,
        )
        self.checkpoint_shards = MappingProxyType(dict(checkpoint_shards))
        self._shard_indices = {shard_id: i for i, shard_id in enumerate(self.checkpoint_shards.values())}

    def _shard_index(self, shard_id: Hashable) -> int:
        try:
            return self._shard_indices[shard_id]
        except KeyError:
            raise ValueError(
                f"{self.prefix or type(self).__name__}: no shard_id {shard_id!r} (shards: {list(self._shard_indices)})"
            ) from None


def qkv_partition(num_heads: int, num_kv_heads: int, tp: TPContext, prefix: str = "") -> tuple[int, int, int, int]:
    """(query heads per rank, first query head, kv heads per rank, first kv head) of rank ``tp.rank``.

    vLLM's rule (``QKVParallelLinear``): H/N query heads; K/N kv heads when N <= K, else one kv head,
    r*K//N, replicated on N/K ranks.

    Raises:
        TensorParallelError: H not divisible by N, or K and N not multiples of one another (names both).
    """
    name = prefix or "QKVParallelLinear"
    n, r = tp.size, tp.rank
    q_local = tp.divide(num_heads, f"{name}: num_attention_heads")
    if n <= num_kv_heads:
        kv_local = tp.divide(num_kv_heads, f"{name}: num_key_value_heads")
        return q_local, r * q_local, kv_local, r * kv_local
    if n % num_kv_heads:
        raise TensorParallelError(
            f"{name}: tensor-parallel size {n} is larger than num_key_value_heads={num_kv_heads} "
            f"but not a multiple of it, so kv heads cannot be replicated evenly"
        )
    return q_local, r * q_local, 1, r * num_kv_heads // n


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused along the output dimension (shard_id "q", "k", "v").

    Output layout per rank: [q_local * head_dim | kv_local * head_dim | kv_local * head_dim], the heads of
    :func:`qkv_partition`; each rank reads only the rows of its own heads (the replicated kv head included).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        quant_method: QuantMethod,
        params_dtype: torch.dtype,
        prefix: str = "",
        tp: TPContext = NO_TP,
    ):
        q_local, q_first, kv_local, kv_first = qkv_partition(num_heads, num_kv_heads, tp, prefix)
        self.num_heads_per_rank, self.num_kv_heads_per_rank = q_local, kv_local
        local = [q_local * head_dim, kv_local * head_dim, kv_local * head_dim]
        starts = [q_first * head_dim, kv_first * head_dim, kv_first * head_dim]
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            checkpoint_shards={"q_proj": "q", "k_proj": "k", "v_proj": "v"},
            bias=bias,
            quant_method=quant_method,
            params_dtype=params_dtype,
            prefix=prefix,
            tp=tp,
            _local=(local, starts),
        )


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks: weight [out, in/N] holds input columns [r*in/N, (r+1)*in/N)
    (vLLM: ``RowParallelLinear``). The bias [out] is replicated and added once, after the all-reduce.

    Raises:
        TensorParallelError: ``input_size`` is not divisible by the group size (names the layer).
    """

    sharded_dim = "input"

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool,
        quant_method: QuantMethod,
        params_dtype: torch.dtype,
        prefix: str = "",
        tp: TPContext = NO_TP,
    ):
        super().__init__(
            tp.divide(input_size, f"{prefix or type(self).__name__}: input size"),
            [output_size],
            bias=bias,
            quant_method=quant_method,
            params_dtype=params_dtype,
            prefix=prefix,
            tp=tp,
        )

    def weight_loader(self, param, loaded_weight, shard_id=None):
        """As :meth:`LinearBase.weight_loader`: columns [r * in / N, (r + 1) * in / N) of the [out, in] checkpoint
        weight go to this rank; the bias [out] is replicated. Takes no ``shard_id`` (ValueError)."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        if param.input_dim is None:  # bias: replicated
            param.load_shard(loaded_weight)
        else:
            param.load_shard(loaded_weight, tp_rank=self.tp.rank, tp_size=self.tp.size, dim="input")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in/N] (this rank's columns) -> [..., out], summed over the ranks, plus the bias."""
        if self.tp.size == 1:
            return self.quant_method.apply(self, x, self.bias)
        y = self.tp.all_reduce(self.quant_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias
