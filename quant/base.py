"""The quantization-method interface and the unquantized method.

A method owns three things for a layer, as in vLLM's ``QuantizeMethodBase``:
``create_weights`` (checkpoint-format parameters, on whatever device is current, usually meta),
``process_weights_after_loading`` (turn loaded checkpoint tensors into kernel tensors), and
``apply`` (the forward).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from layerwise.kernels import require_finite
from layerwise.quant.parameters import ModelWeightParameter, WeightLoader


def check_finite(layer: nn.Module, skip: Sequence[str] = ()) -> None:
    """Raise NonFiniteWeightError naming the first parameter of ``layer`` (except ``skip``) holding
    NaN/Inf (:func:`layerwise.kernels.require_finite`: inside ``deferred_finite_checks`` recorded instead)."""
    for name, p in layer.named_parameters(recurse=False):
        if name not in skip:
            require_finite(p, f"parameter {name!r} holds NaN or Inf")


class QuantMethod:
    """Base class of linear-layer quantization methods."""

    #: short name used in reports, e.g. "fp8-per-tensor"
    name = "base"
    #: True when ``process_weights_after_loading`` replaces ``weight`` with new tensors and keeps no view of
    #: the checkpoint-format weight: the session may then materialize it in a reused staging buffer
    #: (see layerwise.reload.meta.StagingBuffer). Anything else that aliases the buffer is copied out.
    replaces_weight = False
    #: True when the kernel tensors ARE the checkpoint-format parameters (processing only checks them): a
    #: non-atomic reload then replays the module's loads straight into the live tensors, with no staging copy.
    checkpoint_format = False

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_sizes: Sequence[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register ``weight`` [sum(output_sizes), input_size] in ``params_dtype`` (checkpoint format).

        ``output_sizes`` are this rank's sizes of the fused shards (one entry for unfused layers).
        """
        weight = ModelWeightParameter(
            torch.empty(sum(output_sizes), input_size, dtype=params_dtype), weight_loader, output_dim=0, input_dim=1
        )
        layer.register_parameter("weight", weight)

    def configure_tp_shard(self, layer_name: str, sharded_dim: str, local_sizes: Sequence[int]) -> None:
        """Called before ``create_weights`` of a layer sharded over more than one rank: remember how the layer
        is sharded, and raise if this method cannot quantize the rank's shard like the matching part of the
        unsharded weight.

        Args:
            layer_name: the layer's name in the model (for the message).
            sharded_dim: "output" (column-parallel: rows) or "input" (row-parallel: columns).
            local_sizes: this rank's sizes along ``sharded_dim`` (one per fused shard for "output").
        Raises:
            TensorParallelError: the shard does not fit the method's layout (default: never).
        """

    def accepts_weight_pieces(self, shape: torch.Size, spans: list[tuple[int, int]]) -> bool:
        """Whether :meth:`process_weights_after_loading` can take ``weight`` as pieces instead of a materialized
        tensor: its loads, each a verbatim copy of a contiguous tensor to flat element ``spans`` [(offset, numel)]
        of a weight of ``shape``. The session then skips copying those loads into a staging buffer and passes
        ``weight_pieces=[(offset, tensor)]``; ``layer.weight`` is then left on the meta device. Default: no."""
        return False

    def process_weights_after_loading(self, layer: nn.Module, into: dict[str, torch.Tensor] | None = None) -> None:
        """Turn the loaded checkpoint-format parameters into kernel tensors (in place on ``layer``).

        Args:
            into: on a non-atomic reload, the live model's kernel tensors by name. A method may write a result
                straight into the matching tensor (and register that tensor's storage on ``layer``) instead of
                allocating a new one, saving the allocation and the copy the session would make; it must do
                so only after every check that can raise, as that write is the reload's point of no return.
                None on a first load and an atomic reload. Ignoring it is always correct.
        Raises:
            NonFiniteWeightError: a weight holds NaN or Inf (checked with ``check_finite`` / the kernels'
                ``require_finite``; inside ``layerwise.kernels.finite.deferred_finite_checks`` the checks are
                recorded instead, the method goes on, and its caller reports the write).
        """
        raise NotImplementedError

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T + bias for x [..., in] -> y [..., out] in x.dtype."""
        raise NotImplementedError


class UnquantizedLinearMethod(QuantMethod):
    """Weights stay in the dtype they were created in; forward is ``F.linear``."""

    name = "none"
    checkpoint_format = True

    def process_weights_after_loading(self, layer: nn.Module, into: dict[str, torch.Tensor] | None = None) -> None:
        check_finite(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
