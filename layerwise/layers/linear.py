"""Linear layers with tensor-parallel-ready weight loaders, and fused layers that own their fusion.

Naming and sharding follow vLLM: column-parallel layers split the output dimension across ranks,
``RowParallelLinear`` the input dimension; ``MergedColumnParallelLinear`` (gate_up_proj) and
``QKVParallelLinear`` (qkv_proj) concatenate several checkpoint tensors along the output dimension and
declare which checkpoint names they absorb in ``checkpoint_shards`` (checkpoint module name ->
shard_id), so the recursive ``load_weights`` can route ``mlp.gate_proj.weight`` to
``mlp.gate_up_proj`` with shard_id 0 without a mapping table in the model file.
With tp_size == 1 (the only size wired up so far) the narrowing is the identity.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

import torch
from torch import nn

from layerwise.distributed import get_tp_rank, get_tp_size
from layerwise.quant.base import QuantMethod
from layerwise.quant.parameters import ModelWeightParameter


class LinearBase(nn.Module):
    """y = x W^T + b with W created by ``quant_method`` in ``params_dtype`` (checkpoint format).

    Args:
        input_size / output_sizes: this rank's input features and fused output shard sizes.
        bias: whether a bias [sum(output_sizes)] is created (never quantized).
        quant_method: creates, processes and applies the weight.
        params_dtype: checkpoint-format dtype of weight and bias.
    """

    #: checkpoint module names this layer absorbs -> shard_id (empty: the layer's own name only)
    checkpoint_shards: Mapping[str, Hashable] = MappingProxyType({})

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool,
        quant_method: QuantMethod,
        params_dtype: torch.dtype,
    ):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.quant_method = quant_method
        quant_method.create_weights(self, input_size, self.output_sizes, params_dtype, self.weight_loader)
        if bias:
            self.bias = ModelWeightParameter(
                torch.empty(sum(self.output_sizes), dtype=params_dtype), self.weight_loader, output_dim=0
            )
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: ModelWeightParameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, method={self.quant_method.name}"


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel checkpoint tensors concatenated along the output dimension.

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
    ):
        if len(output_sizes) != len(checkpoint_shards):
            raise ValueError(f"{len(output_sizes)} output sizes for {len(checkpoint_shards)} checkpoint shards")
        tp = get_tp_size()
        super().__init__(
            input_size, [s // tp for s in output_sizes], bias=bias, quant_method=quant_method, params_dtype=params_dtype
        )
        self.checkpoint_shards = MappingProxyType(dict(checkpoint_shards))
        self._shard_index = {shard_id: i for i, shard_id in enumerate(self.checkpoint_shards.values())}

    def shard_offset_size(self, shard_id: Hashable) -> tuple[int, int]:
        """(offset, size) of shard ``shard_id`` along the output dimension of this rank's weight."""
        i = self._shard_index[shard_id]
        return sum(self.output_sizes[:i]), self.output_sizes[i]

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is None:  # an already-fused checkpoint tensor
            param.load_shard(loaded_weight, tp_rank=self.tp_rank, tp_size=self.tp_size)
            return
        offset, size = self.shard_offset_size(shard_id)
        param.load_shard(loaded_weight, offset, size, self.tp_rank, self.tp_size)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused along the output dimension (shard_id "q", "k", "v").

    Output layout per rank: [num_heads * head_dim | num_kv_heads * head_dim | num_kv_heads * head_dim].
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
    ):
        super().__init__(
            hidden_size,
            [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
            checkpoint_shards={"q_proj": "q", "k_proj": "k", "v_proj": "v"},
            bias=bias,
            quant_method=quant_method,
            params_dtype=params_dtype,
        )


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks (the partial sums are all-reduced once TP lands)."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool, quant_method: QuantMethod, params_dtype: torch.dtype
    ):
        super().__init__(
            input_size // get_tp_size(), [output_size], bias=bias, quant_method=quant_method, params_dtype=params_dtype
        )

    def weight_loader(self, param, loaded_weight, shard_id=None):
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} takes no shard_id, got {shard_id!r}")
        if param.input_dim is None:  # bias: replicated
            param.load_shard(loaded_weight)
        else:
            param.load_shard(loaded_weight, tp_rank=self.tp_rank, tp_size=self.tp_size)
