"""Quantization methods for fused mixture-of-experts layers, and the unquantized one.

A method owns, for a ``FusedMoE`` layer (``layerwise/layers/fused_moe.py``):

* ``create_weights``: checkpoint-format ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] on the
  current device (meta during a layerwise load), in the checkpoint dtype;
* ``create_kernel_tensors`` + ``process_expert``: the kernel-format tensors of the whole layer
  (allocated once) and the processing of ONE expert's w13 or w2 into its slices of them. The
  layerwise session calls these per expert, so an MoE layer is never materialized whole in the
  checkpoint dtype (the 1.5x peak that vLLM PR #39041 removed);
* ``apply``: the forward over the experts the router chose.

The eager forward loops over the experts that received tokens (transformers' and vLLM's reference
``fused_moe`` loop): gather their tokens, ``down(silu(gate) * up)``, scale by the routing weight,
add into the output rows. That loop reads the chosen expert ids on the host, which a CUDA graph
cannot capture. While a graph is being captured (the Engine's decode step), and within
:func:`capture_path` (the Engine's warm-up before it captures), the method runs every expert instead
(``apply_all_experts``): the same per-expert ``expert_linear`` calls on all T tokens,
each expert's result masked to the tokens that chose it, so it needs no host sync and its temporaries
are [T, 2I] and [T, H] activations (no weights gathered across experts; W8A16 on CPU dequantizes one
expert at a time, as eager does). Its cost is E expert
GEMM pairs per layer and step instead of the ~T*k that eager runs: at decode batch sizes these are
memory-bound reads of every expert's weight once, the bytes a fused MoE kernel reads as soon as
T*k >= E; for long batches it computes E/k times the FLOPs, so it is the capture path, not the eager one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from layerwise.kernels import require_finite
from layerwise.quant.parameters import ModelWeightParameter, WeightLoader

_CAPTURE_PATH: ContextVar[bool] = ContextVar("layerwise_moe_capture_path", default=False)


@contextlib.contextmanager
def capture_path() -> Iterator[None]:
    """Within the block, MoE forwards run eagerly the path they run under CUDA-graph capture
    (:meth:`FusedMoEMethodBase.apply_all_experts`), on any device. A warm-up before a capture runs in it, so that
    every kernel specialization the capture will launch (every expert on all T rows: other row counts, and so
    other Triton specializations, than the chosen experts' rows of the eager loop) is compiled and loaded
    beforehand: a Triton kernel launched for the first time while its stream captures fails to load its module
    ("operation not permitted when stream is capturing").
    """
    token = _CAPTURE_PATH.set(True)
    try:
        yield
    finally:
        _CAPTURE_PATH.reset(token)


EXPERT_PARAMS = ("w13_weight", "w2_weight")


class FusedMoEMethodBase:
    """Base class of fused-MoE methods (see the module docstring for the contract)."""

    #: short name used in reports
    name = "base"

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register w13_weight [E, 2I, H] and w2_weight [E, H, I] in ``params_dtype`` (checkpoint format)."""
        shapes = {
            "w13_weight": (num_experts, 2 * intermediate_size, hidden_size),
            "w2_weight": (num_experts, hidden_size, intermediate_size),
        }
        for name, shape in shapes.items():
            layer.register_parameter(name, ModelWeightParameter(torch.empty(shape, dtype=params_dtype), weight_loader))

    def create_kernel_tensors(self, layer: nn.Module, device: torch.device) -> dict[str, nn.Parameter]:
        """Uninitialized kernel-format parameters of the whole layer on ``device``, by name."""
        raise NotImplementedError

    def configure_tp_shard(self, layer_name: str, local_intermediate_size: int) -> None:
        """Called before ``create_weights`` of a layer whose experts' intermediate dimension is sharded over more than
        one rank (each rank: ``local_intermediate_size`` gate, up rows and down columns): remember it, and raise if
        this method cannot quantize the slices like the matching part of the unsharded experts.

        Raises:
            TensorParallelError: the slice does not fit the method's layout (default: never).
        """

    def accepts_weight_pieces(self, shape: torch.Size, spans: list[tuple[int, int]]) -> bool:
        """Whether :meth:`process_expert` can take an expert's weight of ``shape`` as pieces at flat element
        ``spans`` (its verbatim loads; see ``QuantMethod.accepts_weight_pieces``). Default: no."""
        return False

    def process_expert(
        self,
        layer: nn.Module,
        param_name: str,
        expert_id: int,
        weight: torch.Tensor | None,
        kernel_tensors: dict[str, torch.Tensor],
        weight_pieces: list[tuple[int, torch.Tensor]] | None = None,
    ) -> None:
        """Write expert ``expert_id``'s ``param_name`` (``weight``: [2I, H] or [H, I], checkpoint dtype)
        into its slices of ``kernel_tensors``. Nothing is written when it raises. ``weight`` may live in the
        session's reused CPU staging buffer: copy from it, never keep a view of it. With ``weight_pieces``
        (only where :meth:`accepts_weight_pieces` said so) ``weight`` is None and the expert is those pieces,
        [(flat element offset within the expert, contiguous tensor)].

        Raises:
            NonFiniteWeightError: ``weight`` holds NaN or Inf.
        """
        raise NotImplementedError

    def process_experts(
        self,
        layer: nn.Module,
        batches: dict[str, tuple[list[int], list[list[tuple[int, torch.Tensor]]]]],
        kernel_tensors: dict[str, torch.Tensor],
    ) -> None:
        """:meth:`process_expert` of several experts at once, ``{param_name: (expert_ids, weight_pieces)}``, each
        expert given as its pieces (the session queues a layer's experts whose loads are all verbatim checkpoint
        tensors). A method whose :meth:`accepts_weight_pieces` can say yes implements it.

        Raises:
            NonFiniteWeightError: an expert holds NaN or Inf, raised before any expert of any parameter is written.
        """
        raise NotImplementedError(f"{type(self).__name__} takes weight pieces but has no process_experts")

    def process_weights_after_loading(self, layer: nn.Module, into: dict[str, torch.Tensor] | None = None) -> None:
        """Whole-layer processing (a layer loaded outside a layerwise session): expert by expert into
        freshly allocated kernel tensors, which then replace the checkpoint-format parameters (``into`` is not
        used: a session processes MoE layers expert by expert, straight into the kernel tensors).

        Raises:
            NonFiniteWeightError: a weight holds NaN or Inf.
        """
        kernel_tensors = self.create_kernel_tensors(layer, layer.w13_weight.device)
        for name in EXPERT_PARAMS:
            weight = getattr(layer, name).data
            for e in range(weight.shape[0]):
                self.process_expert(layer, name, e, weight[e], kernel_tensors)
        for name in EXPERT_PARAMS:
            delattr(layer, name)
        for name, t in kernel_tensors.items():
            layer.register_parameter(name, t)

    def expert_linear(self, layer: nn.Module, param_name: str, expert_id: int, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W_e^T for expert ``expert_id``'s ``param_name`` -> [M, N] in x.dtype."""
        raise NotImplementedError

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) for x [T, H] -> [T, H] in x.dtype. An id equal to
        ``layer.num_experts`` adds nothing (a choice of an expert another rank holds, under expert parallelism).

        Expert e: down(silu(gate(x)) * up(x)); the weighted result is cast to x.dtype and accumulated
        into the output expert by expert, in increasing expert id, as transformers does. Eager: only the
        experts that received tokens run, on their tokens (the expert ids are read on the host). While
        the current CUDA stream is capturing a graph, and within :func:`capture_path`: :meth:`apply_all_experts`
        (no host sync).
        """
        if _CAPTURE_PATH.get() or (x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return self.apply_all_experts(layer, x, topk_weights, topk_ids)
        out = torch.zeros_like(x)
        # [E, k, T]; an id equal to num_experts (another rank's expert) falls in the dropped last class
        mask = F.one_hot(topk_ids, layer.num_experts + 1)[..., : layer.num_experts].permute(2, 1, 0)
        for e in (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist():
            pos, tokens = torch.where(mask[e])
            gate, up = self.expert_linear(layer, "w13_weight", e, x[tokens]).chunk(2, dim=-1)
            y = self.expert_linear(layer, "w2_weight", e, F.silu(gate) * up)  # [n_e, H]
            # = transformers' index_add_ (a token meets an expert at most once, so one add per element);
            # index_put_ because torch's CPU index_add_ wakes its thread pool even for a few rows
            out.index_put_((tokens,), (y * topk_weights[tokens, pos, None]).to(out.dtype), accumulate=True)
        return out

    def apply_all_experts(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """:meth:`apply` without reading ids on the host, for CUDA-graph capture: every expert runs on all
        T tokens, and its weighted result is added only where the token chose it.

        Args / returns as :meth:`apply` (x [T, H]; topk_weights [T, k]; topk_ids int64 [T, k] -> [T, H]).
        Expert e runs the eager path's ``expert_linear`` calls (w13, silu(gate) * up, w2) on all of x, then
        ``out += where(chose_e, y_e * weight_e, 0).to(x.dtype)`` in increasing e: a token's additions are
        eager's, in eager's order, and every other expert adds an exact zero (its NaN or Inf, if any,
        cannot reach the output). Equal to :meth:`apply` where the GEMMs give each
        row the same result whatever the row count (measured on CPU: tests/test_moe_capture_path.py).
        FP8 W8A8 quantizes activations over the rows it is given: per-token scales see the same row,
        a per-tensor scale sees all T rows here (the expert's rows only in eager), so per-tensor W8A8
        differs from eager by the coarser activation scale.

        Cost: E expert GEMM pairs per layer instead of the ~T*k of eager; at decode batches each reads
        every expert's weight once (memory-bound; the bytes a fused MoE kernel reads once T*k >= E), for
        large T it does E/k times eager's FLOPs. Memory: [T, 2I] and [T, H] temporaries per expert (and,
        where the scheme's forward dequantizes, one expert's weight, as in eager), nothing proportional to
        T*k experts. It replaces a path that gathered the k experts of every token as [T*k, N, K] weights.
        """
        t, num_experts = x.shape[0], layer.num_experts
        # dense routing, [T, E]: the token's weight where it chose the expert, and the choice itself (the mask is
        # the choice, not weight != 0, so a chosen expert whose weight underflowed to 0 adds y * 0 as in eager); an
        # id equal to num_experts (another rank's expert) lands in a last column that is never read
        dense_weights = topk_weights.new_zeros(t, num_experts + 1).scatter_(1, topk_ids, topk_weights)
        chose = torch.zeros(t, num_experts + 1, dtype=torch.bool, device=x.device).scatter_(1, topk_ids, True)
        out = torch.zeros_like(x)
        for e in range(num_experts):
            gate, up = self.expert_linear(layer, "w13_weight", e, x).chunk(2, dim=-1)  # [T, I] each
            y = self.expert_linear(layer, "w2_weight", e, F.silu(gate) * up)  # [T, H]
            out += torch.where(chose[:, e, None], y * dense_weights[:, e, None], 0.0).to(out.dtype)
        return out


class UnquantizedFusedMoEMethod(FusedMoEMethodBase):
    """Expert weights stay in the checkpoint dtype (or ``dtype=``); forward is ``F.linear`` per expert."""

    name = "none"

    def create_kernel_tensors(self, layer: nn.Module, device: torch.device) -> dict[str, nn.Parameter]:
        return {
            name: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
            for name, p in ((n, getattr(layer, n)) for n in EXPERT_PARAMS)
        }

    def process_expert(self, layer, param_name, expert_id, weight, kernel_tensors) -> None:
        require_finite(weight, f"{param_name} of expert {expert_id} holds NaN or Inf")  # or deferred, as any check
        with torch.no_grad():
            kernel_tensors[param_name][expert_id].copy_(weight)

    def expert_linear(self, layer, param_name, expert_id, x):
        return F.linear(x, getattr(layer, param_name)[expert_id])
