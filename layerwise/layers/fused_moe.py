"""Mixture-of-experts with fused expert weights (vLLM's ``FusedMoE`` layout) and top-k routing.

All experts of one decoder layer live in two parameters:

    w13_weight [E, 2I, H]   expert e's gate_proj rows [0, I), then its up_proj rows [I, 2I)
    w2_weight  [E, H, I]    expert e's down_proj

The checkpoint stores one tensor per (expert, projection); the layer declares how the rest of such a
key names a parameter and a shard (:meth:`FusedMoE.checkpoint_param`), so model files carry no
``expert_params_mapping`` table: ``5.up_proj.weight`` -> ("w13_weight", (5, "w3")). Shard ids use
vLLM's names: "w1" (gate), "w3" (up), "w2" (down).

During a layerwise load the layer is processed one *unit* at a time (:meth:`FusedMoE.processing_unit`):
expert e's w13 rows (gate and up together, since a per-tensor scale spans both) and expert e's w2, so
the device never holds more than one expert's checkpoint-dtype weights besides the quantized model
(see ``layerwise/reload/units.py``).

Routing is transformers' (``modeling_qwen3_moe.py`` / ``modeling_mixtral.py``, v5): router logits in
the activation dtype, softmax in float32, top-k, renormalized over the k chosen experts when asked
(Qwen3-MoE: ``norm_topk_prob``; Mixtral: always); Qwen3-MoE casts the weights back to the logits'
dtype, Mixtral keeps them in float32.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from types import MappingProxyType

import torch
from torch import nn

from layerwise.distributed import NO_TP, TPContext
from layerwise.errors import UnexpectedWeightError, WeightShapeError
from layerwise.layers.linear import ColumnParallelLinear
from layerwise.quant.base import UnquantizedLinearMethod
from layerwise.quant.moe_base import FusedMoEMethodBase
from layerwise.quant.parameters import check_loaded_dtype, copy_loaded

#: Qwen3-MoE / Qwen2-MoE / DeepSeek checkpoint names of an expert's projections -> shard_id
QWEN_EXPERT_SHARDS = MappingProxyType({"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
#: Mixtral checkpoint names -> shard_id (w1 gate, w3 up, w2 down)
MIXTRAL_EXPERT_SHARDS = MappingProxyType({"w1": "w1", "w3": "w3", "w2": "w2"})


def select_experts(
    router_logits: torch.Tensor, top_k: int, *, renormalize: bool, scores_in_logits_dtype: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as transformers computes it.

    Args:
        router_logits: [T, E] in the activation dtype.
        renormalize: divide the k chosen probabilities by their sum.
        scores_in_logits_dtype: cast the weights to router_logits' dtype (Qwen3-MoE) or keep them
            float32 (Mixtral).
    Returns:
        (topk_weights [T, k] float32 or the logits' dtype, topk_ids int64 [T, k]).
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if scores_in_logits_dtype:
        topk_weights = topk_weights.to(router_logits.dtype)
    return topk_weights, topk_ids


class FusedMoE(nn.Module):
    """E experts, each down(silu(gate(x)) * up(x)), with weights fused as w13_weight / w2_weight.

    Under a tensor-parallel group of N ranks (vLLM's two layouts, ``tp.expert_parallel``), rank r holds:

    - tensor parallelism over the experts (the default): every expert, its intermediate dimension sharded as a
      MergedColumnParallelLinear (gate rows [r*I/N, (r+1)*I/N) and the same up rows) and a RowParallelLinear
      (down columns): w13_weight [E, 2I/N, H], w2_weight [E, H, I/N]; each rank reads only those rows / columns;
    - expert parallelism: experts [r*E/N, (r+1)*E/N) whole, w13_weight [E/N, 2I, H], w2_weight [E/N, H, I]; the
      other experts' checkpoint tensors are skipped unread (:meth:`checkpoint_param` returns None for them).

    Either way the router runs replicated, each rank adds its experts' (or slices') contributions, and the sum is
    all-reduced once per layer. ``num_experts`` and ``intermediate_size`` are this rank's (what the quantization
    method creates and processes); ``global_num_experts`` and ``full_intermediate_size`` the checkpoint's.

    Args:
        num_experts: E. hidden_size: H. intermediate_size: I (per expert), all unsharded.
        quant_method: creates (on meta, in ``params_dtype``), processes (one expert at a time) and
            applies the expert weights.
        expert_shards: checkpoint projection name -> shard_id ("w1", "w3", "w2"), e.g.
            :data:`QWEN_EXPERT_SHARDS` or :data:`MIXTRAL_EXPERT_SHARDS`.
        prefix: the layer's name in the model, for messages.
        tp: the tensor-parallel group and layout (default: none).
    Raises:
        TensorParallelError: E (expert parallelism) or I (tensor parallelism) is not divisible by the group size, or
            the method's FP8 blocks would be split (raised while building, before any weight is read).
        ValueError: ``expert_shards`` does not map onto exactly w1, w3 and w2.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        quant_method: FusedMoEMethodBase,
        params_dtype: torch.dtype,
        expert_shards: Mapping[str, str],
        prefix: str = "",
        tp: TPContext = NO_TP,
    ):
        super().__init__()
        if sorted(expert_shards.values()) != ["w1", "w2", "w3"]:
            raise ValueError(f"expert_shards must map to w1, w3 and w2, got {dict(expert_shards)}")
        name = prefix or "FusedMoE"
        self.tp = tp
        self.global_num_experts, self.full_intermediate_size = num_experts, intermediate_size
        self.expert_start = 0
        if tp.size > 1 and tp.expert_parallel:
            num_experts = tp.divide(num_experts, f"{name}: expert parallelism: num_experts")
            self.expert_start = tp.rank * num_experts
        elif tp.size > 1:
            intermediate_size = tp.divide(
                intermediate_size, f"{name}: tensor parallelism over the experts: moe intermediate size"
            )
            quant_method.configure_tp_shard(name, intermediate_size)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.expert_shards = MappingProxyType(dict(expert_shards))
        self.prefix = prefix
        self.params_dtype = params_dtype  # the checkpoint format's (the kernel tensors may be FP8)
        self.quant_method = quant_method
        quant_method.create_weights(self, num_experts, hidden_size, intermediate_size, params_dtype, self.weight_loader)

    # --- checkpoint keys -> (parameter, shard) ------------------------------------------------------

    def checkpoint_param(self, name: str) -> tuple[str, tuple[int, str]] | None:
        """(parameter name, shard_id) of the checkpoint tensor ``<prefix>.<name>``, with this rank's expert index;
        None for an expert another rank holds (expert parallelism): the router skips it without reading it.

        ``name`` is "<expert>.<projection>.weight", e.g. "3.up_proj.weight" -> ("w13_weight", (3, "w3")).
        Raises:
            UnexpectedWeightError: not of that form, an expert id outside [0, E), or an unknown projection.
        """
        parts = name.split(".")
        if len(parts) != 3 or parts[2] != "weight" or not parts[0].isdigit():
            raise UnexpectedWeightError(
                f"{self.prefix}: expected '<expert>.<{'|'.join(self.expert_shards)}>.weight', got {name!r}"
            )
        expert_id, projection = int(parts[0]), parts[1]
        if expert_id >= self.global_num_experts:
            raise UnexpectedWeightError(
                f"{self.prefix}: expert {expert_id} does not exist (the layer has {self.global_num_experts} experts)"
            )
        shard = self.expert_shards.get(projection)
        if shard is None:
            raise UnexpectedWeightError(
                f"{self.prefix}: unknown expert projection {projection!r}; expected one of {list(self.expert_shards)}"
            )
        local = expert_id - self.expert_start
        if not 0 <= local < self.num_experts:
            return None  # another rank's expert
        return ("w2_weight" if shard == "w2" else "w13_weight"), (local, shard)

    def check_unowned(self, name: str, loaded_weight) -> None:
        """The checks an expert's checkpoint tensor gets on the ranks that skip it (expert parallelism: another rank
        holds the expert), from its metadata alone (nothing is read): the dtype and the shape its owner's
        :meth:`weight_loader` checks, so a bad tensor fails on every rank alike. Its values (NaN, Inf) are checked
        by the owner only.

        Raises:
            WeightShapeError / WeightDtypeError: as :meth:`weight_loader` would on the owner.
        """
        self._check_checkpoint_tensor(loaded_weight, self.expert_shards[name.split(".")[1]], self.params_dtype)

    def _check_checkpoint_tensor(self, loaded_weight, shard: str, dtype: torch.dtype) -> int:
        """Check an expert projection's unsharded checkpoint tensor ([I_full, H] for w1 / w3, [H, I_full] for w2)
        against ``dtype`` and its shape; returns the dimension a rank's slice is taken along (0: gate / up rows,
        1: down columns).

        Raises:
            WeightDtypeError: a dtype a copy would cast into other values. WeightShapeError: another shape (the key,
                added by the router, names the expert: in a session the loader runs as expert 0's).
        """
        check_loaded_dtype(loaded_weight, dtype)
        dim = 1 if shard == "w2" else 0
        expected = (self.full_intermediate_size, self.hidden_size)[:: -1 if dim else 1]
        if tuple(loaded_weight.shape) != expected:
            raise WeightShapeError(f"checkpoint shape {tuple(loaded_weight.shape)} does not match expected {expected}")
        return dim

    def weight_loader(self, param: torch.Tensor, loaded_weight, shard_id: tuple[int, str]) -> None:
        """Copy one expert's projection into ``param[expert_id]`` (this rank's expert index): w1 -> rows [0, I) of
        w13, w3 -> rows [I, 2I), w2 -> the whole [H, I] slice of w2 (I: this rank's intermediate size; under
        tensor parallelism over the experts, rows / columns [r*I, (r+1)*I) of the checkpoint tensor, read alone).
        Writes only ``param[expert_id]`` (the session's per-expert units rely on it, and check it).

        Args:
            param: w13_weight [E, 2I, H] or w2_weight [E, H, I] (or a tensor indexing like them).
            loaded_weight: the unsharded [I_full, H] for w1 / w3, [H, I_full] for w2; a tensor or a lazy checkpoint
                slice.
            shard_id: (expert_id, "w1" | "w3" | "w2").
        Raises:
            WeightShapeError: the tensor's shape is not the projection's, or an integer / bool tensor for a float
                ``param`` (:func:`layerwise.quant.parameters.check_loaded_dtype`).
            ValueError: a shard_id that does not fit ``param``.
        """
        expert_id, shard = shard_id
        target = param.data[expert_id]
        i, full = self.intermediate_size, self.full_intermediate_size
        if shard in ("w1", "w3"):
            if param.shape[1:] != (2 * i, self.hidden_size):
                raise ValueError(f"{self.prefix}: shard {shard} belongs to w13_weight")
            target = target.narrow(0, 0 if shard == "w1" else i, i)
        elif shard != "w2" or param.shape[1:] != (self.hidden_size, i):
            raise ValueError(f"{self.prefix}: shard {shard!r} does not fit a parameter of shape {tuple(param.shape)}")
        dim = self._check_checkpoint_tensor(loaded_weight, shard, param.dtype)
        if i != full:  # this rank's rows (gate, up) or columns (down): only they are read
            loaded_weight = loaded_weight.narrow(dim, self.tp.rank * i, i)
        copy_loaded(loaded_weight, target)  # without waiting where a session allows it (Limitations 12)

    # --- per-expert processing units (layerwise/reload/units.py) -------------------------------------

    def unit_shard_origin(self, shard_id: tuple[int, str]) -> tuple[int, tuple[int, str]]:
        """(expert id, the same load's shard_id for expert 0): :meth:`weight_loader` writes expert e's load exactly
        as expert 0's, moved by e experts, so the session records one expert's loads on the meta device and
        translates them (the check that a load stays inside its expert is made on that recording)."""
        return shard_id[0], (0, shard_id[1])

    def processing_unit(self, param_name: str, shard_id: tuple[int, str]) -> tuple[str, int]:
        """The unit a load belongs to: (parameter name, expert id), i.e. ``param[expert_id]``."""
        return param_name, shard_id[0]

    def processing_units(self) -> list[tuple[str, int]]:
        """Every unit of the layer: each expert's w13 (gate + up), then each expert's w2."""
        return [(p, e) for p in ("w13_weight", "w2_weight") for e in range(self.num_experts)]

    def unit_checkpoint_names(self, unit: tuple[str, int]) -> list[tuple[str, int, int]]:
        """(checkpoint name relative to the layer, first element, end element) of each checkpoint tensor
        that fills ``unit``, as flat element ranges of the unit: "5.gate_proj.weight", 0, I*H; ..."""
        param_name, e = unit
        e += self.expert_start  # the checkpoint's expert id
        names = {shard: proj for proj, shard in self.expert_shards.items()}
        ih = self.intermediate_size * self.hidden_size
        if param_name == "w2_weight":
            return [(f"{e}.{names['w2']}.weight", 0, ih)]
        return [(f"{e}.{names['w1']}.weight", 0, ih), (f"{e}.{names['w3']}.weight", ih, 2 * ih)]

    def forward(self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """hidden [T, H], topk_weights [T, k], topk_ids int64 [T, k] (the checkpoint's expert ids) -> [T, H] in
        hidden.dtype: sum over the k chosen experts of weight * expert(hidden); under a tensor-parallel group, each
        rank's share (its experts, or its intermediate slice of every expert) all-reduced (sum)."""
        if self.tp.size == 1:
            return self.quant_method.apply(self, hidden, topk_weights, topk_ids)
        if self.tp.expert_parallel:  # another rank's expert: the id num_experts, which adds nothing here
            local = topk_ids - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.num_experts), local, self.num_experts)
        return self.tp.all_reduce(self.quant_method.apply(self, hidden, topk_weights, topk_ids))

    def extra_repr(self) -> str:
        tp = ""
        if self.tp.size > 1:
            layout = "experts" if self.tp.expert_parallel else "intermediate"
            tp = f", tp={self.tp.rank}/{self.tp.size} ({layout} sharded)"
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"method={self.quant_method.name}{tp}"
        )


class SparseMoeBlock(nn.Module):
    """Router (``gate``, kept in the checkpoint dtype) plus fused experts (``experts``).

    Checkpoint keys: ``<prefix>.gate.weight`` [E, H] and ``<prefix>.experts.<e>.<projection>.weight``.

    Args:
        num_experts / top_k / hidden_size / intermediate_size: E, k, H, I.
        renormalize: renormalize the top-k weights (Qwen3-MoE norm_topk_prob; Mixtral always).
        scores_in_logits_dtype: see :func:`select_experts`.
        quant_method: the experts' method (the router is never quantized).
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        scores_in_logits_dtype: bool,
        quant_method: FusedMoEMethodBase,
        params_dtype: torch.dtype,
        expert_shards: Mapping[str, Hashable],
        prefix: str = "",
        tp: TPContext = NO_TP,
    ):
        super().__init__()
        self.top_k, self.renormalize, self.scores_in_logits_dtype = top_k, renormalize, scores_in_logits_dtype
        self.experts = FusedMoE(
            num_experts,
            hidden_size,
            intermediate_size,
            quant_method=quant_method,
            params_dtype=params_dtype,
            expert_shards=expert_shards,
            prefix=f"{prefix}.experts",
            tp=tp,
        )
        self.gate = ColumnParallelLinear(
            hidden_size,
            [num_experts],
            bias=False,
            quant_method=UnquantizedLinearMethod(),
            params_dtype=params_dtype,
            prefix=f"{prefix}.gate",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., H] -> [..., H] in x.dtype."""
        x2 = x.reshape(-1, x.shape[-1])  # [T, H]
        router_logits = self.gate(x2)  # [T, E]
        topk_weights, topk_ids = select_experts(
            router_logits,
            self.top_k,
            renormalize=self.renormalize,
            scores_in_logits_dtype=self.scores_in_logits_dtype,
        )
        return self.experts(x2, topk_weights, topk_ids).reshape(x.shape)
