"""Online FP8 (e4m3fn) for fused mixture-of-experts layers, one expert at a time.

After loading, a ``FusedMoE`` layer holds ``w13_weight`` [E, 2I, H] and ``w2_weight`` [E, H, I] in
float8_e4m3fn and float32 scales named as the dense scheme names them (``quant/fp8.py``), prefixed:

=================  ==========================================  ==========================================
scheme             w13 scale                                   w2 scale
=================  ==========================================  ==========================================
fp8-per-tensor     ``w13_weight_scale`` [E]: one per expert,   ``w2_weight_scale`` [E]
                   amax over its gate AND up rows together
fp8-per-channel    ``w13_weight_scale`` [E, 2I, 1]             ``w2_weight_scale`` [E, H, 1]
fp8-per-block      ``w13_weight_scale_inv``                    ``w2_weight_scale_inv``
                   [E, ceil(2I/128), ceil(H/128)]              [E, ceil(H/128), ceil(I/128)]
=================  ==========================================  ==========================================

Expert e's slice is exactly what the dense scheme makes of the [2I, H] (or [H, I]) matrix: the same
kernels (``layerwise.kernels`` fp8_amax / scale_from_amax / fp8_quantize, with the scheme's kernel),
so its bytes equal torch's own cast ``(w.float() / scale).clamp(-448, 448).to(float8_e4m3fn)``. A
per-block w13 is blocked as one [2I, H] matrix, so when I is not a multiple of 128 a block spans gate
and up rows. The torch kernel takes the whole expert's amax, then quantizes it straight into its FP8 slice:
on CPU in one native pass each (``kernels/cpu_native.py``), else through the reference, whose float32 work
buffers are row chunks of at most 1 MiB (or 128 rows x K x 4 bytes for per-block amax). Experts given as their
loaded tensors (pieces: the session's ``process_experts`` batches of a layer read from a checkpoint) are
quantized where they lie: every expert's scales first, then the bytes, each in one native pass over the whole
batch on CPU (``fp8_scale_pieces_batch``, ``fp8_quantize_pieces_batch``). The Triton kernels
quantize 2 tiles (:func:`expert_tiles`), which bounds their FP8 output, and copy each into the slice.

Forward (``apply``): per expert that received tokens, ``quant/fp8.py``'s ``Fp8LinearMethod.apply`` on
the expert's slice: W8A8 (``torch._scaled_mm``, activations quantized per tensor or per token) where
the dense scheme would use it (fp8_mode "auto": CUDA sm89+; "w8a8": also CPU), else W8A16 (dequantize the
expert, then matmul). Under CUDA-graph capture the same per-expert forward runs for every expert on all
tokens, masked by the routing (``moe_base`` ``apply_all_experts``).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from layerwise.errors import TensorParallelError
from layerwise.kernels import (
    BLOCK_SIZE,
    FP8_DTYPE,
    fp8_amax,
    fp8_quantize,
    fp8_quantize_pieces,
    fp8_quantize_pieces_batch,
    fp8_scale,
    fp8_scale_pieces_batch,
    pieces_fit,
    require_finite,
    scale_from_amax,
    scale_shape,
)
from layerwise.quant.fp8 import SCALE_NAMES, Fp8LinearMethod
from layerwise.quant.moe_base import EXPERT_PARAMS, FusedMoEMethodBase


def expert_scale_shape(num_experts: int, n: int, k: int, granularity: str) -> tuple[int, ...]:
    """Shape of the scale of an [E, N, K] expert weight: [E], [E, N, 1] or [E, ceil(N/128), ceil(K/128)]."""
    return (num_experts, *scale_shape((n, k), granularity))


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def expert_tiles(n: int, k: int, align: int, parts: int) -> list[tuple[int, int, int, int]]:
    """(r0, r1, c0, c1) tiles covering an [n, k] matrix, each about 1/``parts`` of it, starting at multiples
    of ``align`` (128 for blocks, so a tile holds whole scale blocks). Rows are split first; columns too
    when ``align`` rows alone already exceed a part (an expert's w2 with H < 128 * parts)."""
    target = max(1, -(-n * k // parts))
    row_step = min(_round_up(n, align), max(align, _round_up(-(-n // parts), align)))
    col_step = k if row_step * k <= 2 * target else min(k, max(align, _round_up(-(-target // row_step), align)))
    return [
        (r0, min(r0 + row_step, n), c0, min(c0 + col_step, k))
        for r0 in range(0, n, row_step)
        for c0 in range(0, k, col_step)
    ]


def _tile_scale(scale: torch.Tensor, granularity: str, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
    """The entries of an expert's ``scale`` that the tile rows [r0, r1) x columns [c0, c1) use (a view)."""
    if granularity == "tensor":
        return scale
    if granularity == "channel":
        return scale[r0:r1]
    bn, bk = BLOCK_SIZE
    return scale[r0 // bn : -(-r1 // bn), c0 // bk : -(-c1 // bk)]


class Fp8MoEMethod(FusedMoEMethodBase):
    """FP8 experts with one scale per expert, per expert row, or per 128 x 128 block of an expert.

    Args:
        granularity: "tensor", "channel" or "block".
        kernel: "torch" or "triton" (quantize at load time, dequantize for W8A16).
        fp8_mode: "auto", "w8a8" or "w8a16", as :class:`layerwise.quant.fp8.Fp8LinearMethod`.
        amax_reduce: under tensor parallelism over the experts' intermediate dimension (``configure_tp_shard``), the
            in-place max-reduction of a float32 amax over the group (``load_model(..., global_scales=True)``): a
            scale whose amax spans every rank's slice (per tensor: an expert's gate+up, its down; per channel: a
            down row) is then the unsharded expert's, so every rank's FP8 slice equals the matching slice of the
            TP=1 model byte for byte. None: each rank's own slice (vLLM's behaviour).
    Raises:
        ValueError: unknown granularity or fp8_mode.
    """

    def __init__(self, granularity: str = "tensor", kernel: str = "torch", fp8_mode: str = "auto", amax_reduce=None):
        # the dense method runs each expert's matmul (its W8A8 / W8A16 choice is cached per param: one shape each);
        # it checks granularity and fp8_mode
        self._dense = {p: Fp8LinearMethod(granularity, kernel, fp8_mode) for p in EXPERT_PARAMS}
        self.granularity, self.kernel, self.fp8_mode = granularity, kernel, fp8_mode
        self.name = f"fp8-per-{granularity}"
        dense_scale = SCALE_NAMES[granularity]  # "weight_scale" / "weight_scale_inv"
        self.scale_names = {p: p.replace("weight", dense_scale) for p in EXPERT_PARAMS}
        self.amax_reduce = amax_reduce
        self.reduced: tuple[str, ...] = ()  # the parameters whose scales are reduced over the group
        # sharded over a group that reduces: every expert unit joins one collective, so that a NaN in one rank's
        # slice fails every rank at that unit instead of leaving the others waiting in a later reduction
        self.agree = False

    def configure_tp_shard(self, layer_name: str, local_intermediate_size: int) -> None:
        """Per-block scales: the slice must be whole 128-blocks. With ``amax_reduce``, the scales that span the
        sharded dimension are reduced: per tensor both w13 and w2, per channel w2 (its rows span every rank's
        columns; a w13 row is whole on its rank).

        Raises:
            TensorParallelError: per-block scales and a slice that is not a multiple of 128 (names the layer).
        """
        if self.granularity == "block" and local_intermediate_size % BLOCK_SIZE[0]:
            raise TensorParallelError(
                f"{layer_name}: per-rank moe intermediate size {local_intermediate_size} is not a multiple of the "
                f"{BLOCK_SIZE[0]}-element FP8 block, so a tensor-parallel slice would split a block; use "
                f"fp8-per-tensor or fp8-per-channel, expert parallelism, or a smaller tensor-parallel size"
            )
        if self.amax_reduce is not None:
            self.reduced = {"tensor": EXPERT_PARAMS, "channel": ("w2_weight",), "block": ()}[self.granularity]
            self.agree = True

    def create_kernel_tensors(self, layer: nn.Module, device: torch.device) -> dict[str, nn.Parameter]:
        out = {}
        for name in EXPERT_PARAMS:
            e, n, k = getattr(layer, name).shape
            out[name] = nn.Parameter(torch.empty(e, n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
            scale = torch.empty(expert_scale_shape(e, n, k, self.granularity), dtype=torch.float32, device=device)
            out[self.scale_names[name]] = nn.Parameter(scale, requires_grad=False)
        return out

    def accepts_weight_pieces(self, shape: torch.Size, spans: list[tuple[int, int]]) -> bool:
        """An expert's gate and up loads (or its down load) are quantized where they are, when they fit; not when a
        scale is reduced over the group (its amax is taken whole, then reduced)."""
        return not self.agree and pieces_fit(shape, spans, self.granularity)

    def process_expert(self, layer, param_name, expert_id, weight, kernel_tensors, weight_pieces=None) -> None:
        """Quantize ``weight`` [N, K] into ``kernel_tensors[param_name][expert_id]`` and its scale slice.

        Given ``weight_pieces`` (the expert's verbatim loads, ``weight`` None): amax over the pieces, then each
        piece straight into its rows of the FP8 slice (``fp8_quantize_pieces``). Else the whole expert's scale,
        then the torch kernel writes the slice itself (see the module docstring) and Triton quantizes 2 tiles.

        Raises:
            NonFiniteWeightError: ``weight`` holds NaN or Inf (raised by the scale, before any write).
        """
        q = kernel_tensors[param_name].data[expert_id]
        g, (n, k) = self.granularity, q.shape
        if weight_pieces is not None:  # from the loaded tensors themselves; raises before any write
            scale = fp8_quantize_pieces(weight_pieces, q.shape, g, q, self.kernel)
        else:
            scale = self._scale(param_name, expert_id, weight)  # raises before any write
            if self.kernel == "torch":
                fp8_quantize(weight, scale, within_range=True, out=q)
            else:
                for r0, r1, c0, c1 in expert_tiles(n, k, BLOCK_SIZE[0] if g == "block" else 1, parts=2):
                    tile_scale = _tile_scale(scale, g, r0, r1, c0, c1)
                    q[r0:r1, c0:c1].copy_(fp8_quantize(weight[r0:r1, c0:c1], tile_scale, self.kernel))
        kernel_tensors[self.scale_names[param_name]].data[expert_id].copy_(scale)

    def _scale(self, param_name: str, expert_id: int, weight: torch.Tensor) -> torch.Tensor:
        """The scale of one expert's ``weight`` [N, K] (the whole expert, or this rank's slice of it).

        Sharded over a group that reduces (``self.agree``), the ranks reach this expert in the same order (the same
        stream) and each joins one collective: the amax itself (max) where the scale spans the slices
        (``self.reduced``), else a finiteness flag, so a NaN or Inf in any rank's slice raises on every rank.

        Raises:
            NonFiniteWeightError: ``weight`` (or, under a reducing group, any rank's slice) holds NaN or Inf.
        """
        if not self.agree:
            return fp8_scale(weight, self.granularity, self.kernel)
        amax = fp8_amax(weight, self.granularity, self.kernel)
        inf = torch.full_like(amax, float("inf"))
        if param_name in self.reduced:  # NaN -> Inf on all; the max over ranks; Inf from any rank raises on all
            return scale_from_amax(self.amax_reduce(torch.where(torch.isfinite(amax), amax, inf)))
        bad = torch.where(torch.isfinite(amax).all(), torch.zeros(1, device=amax.device), float("inf"))
        flag = self.amax_reduce(bad)
        require_finite(flag, f"{param_name} of expert {expert_id} holds NaN or Inf (on some rank's slice)")
        return scale_from_amax(amax)

    def process_experts(self, layer, batches, kernel_tensors) -> None:
        """Experts given as their pieces, ``{param_name: (expert_ids, weight_pieces)}``, into their FP8 slices and
        scales: every expert's scales first (``fp8_scale_pieces_batch``, on CPU one native pass over all the
        pieces), then every expert's bytes (``fp8_quantize_pieces_batch``): the same bytes and scales as
        :meth:`process_expert` of each.

        Raises:
            NonFiniteWeightError: an expert holds NaN or Inf (raised before any write to any parameter).
        """
        g = self.granularity
        scales = {}
        for param_name, (_, pieces) in batches.items():
            shape = kernel_tensors[param_name].shape[1:]
            scales[param_name] = fp8_scale_pieces_batch(pieces, shape, g, self.kernel)
        for param_name, (expert_ids, pieces) in batches.items():
            q = kernel_tensors[param_name].data
            fp8_quantize_pieces_batch(
                pieces, scales[param_name], q.shape[1:], g, [q[e] for e in expert_ids], self.kernel
            )
            scale = kernel_tensors[self.scale_names[param_name]].data
            index = torch.tensor(expert_ids, device=scale.device)
            scale[index] = scales[param_name].to(scale.device).view(-1, *scale.shape[1:])

    def _expert_scale(self, layer: nn.Module, param_name: str, expert_id: int) -> torch.Tensor:
        scale = getattr(layer, self.scale_names[param_name])
        if self.granularity == "tensor":
            # on CUDA a copy: the view scale[e:e+1] sits 4*e bytes into the tensor, and cuBLASLt's FP8 matmul
            # refuses a scale pointer that is not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED on the H100, e > 0)
            view = scale[expert_id : expert_id + 1]
            return view.clone() if view.is_cuda else view
        return scale[expert_id]  # [N, 1] rows: e * N * 4 bytes in, aligned for N % 4 == 0

    def expert_linear(self, layer, param_name, expert_id, x):
        dense = self._dense[param_name]
        expert = SimpleNamespace(
            weight=getattr(layer, param_name)[expert_id],
            **{dense.scale_name: self._expert_scale(layer, param_name, expert_id)},
        )
        return dense.apply(expert, x, None)
