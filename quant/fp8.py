"""FP8 (e4m3fn) online quantization of Linear weights at three scale granularities.

After loading, a layer holds ``weight`` (float8_e4m3fn, [out, in]) and its float32 scale(s):

=================  ==================  ==========================================================
scheme             scale parameter     shape
=================  ==================  ==========================================================
fp8-per-tensor     ``weight_scale``    [1]: one scale over the whole fused parameter
fp8-per-channel    ``weight_scale``    [out, 1]: one scale per output row
fp8-per-block      ``weight_scale_inv`` [ceil(out/128), ceil(in/128)] (DeepSeek-V3 / vLLM naming;
                                       despite the name it is the dequantization multiplier)
=================  ==================  ==========================================================

Fused layers (qkv_proj, gate_up_proj) and per-tensor scales: the scale is computed once over the
fused BF16 weight after all its shards are loaded (amax over q, k and v together). No shard is ever
quantized with its own scale and re-quantized to a shared one, so the vLLM failure mode of a
per-shard scale applied to the whole fused tensor cannot occur. e4m3 is floating point, so a shard
smaller than its siblings keeps its 3 mantissa bits as long as its values stay above
amax * 2^-6 / 448 (about amax / 28672); only a shard ~10^4x smaller falls into the subnormal range
and loses precision (tests/test_schemes.py measures both; per-channel scales avoid it).

Forward: W8A8 (activation quantized on the fly: per tensor for per-tensor weights, per token for
per-channel weights, then ``torch._scaled_mm``) on CUDA sm89+, or W8A16 (dequantize, then
``F.linear``). On CUDA with ``kernel="triton"`` the activation quantization is one fused Triton
kernel (``kernels.fp8_act``); on CPU it is the torch reference, bit for bit the same bytes.
Per-block weights run W8A16 on CPU; on CUDA (``kernel="triton"``, bf16/fp16) they run the Triton
block-scaled W8A8 GEMM on sm_89+ (activations per token group of 128) and the Triton W8A16 GEMM on older
GPUs. Per-tensor and per-channel weights run the Triton W8A8 GEMM with x quantized inside it
(``kernels.fp8_gemm.dynamic_w8a8_gemm``) instead of the quantization kernel and ``torch._scaled_mm`` where a
tuned configuration says it was faster on this GPU. Every W8A16 forward on CUDA
(fp8_mode "w8a16", sm_80, unaligned shapes, fp16 per-channel) decodes the FP8 weight inside a Triton GEMM for up
to ``W8A16_GEMM_MAX_M`` tokens instead of dequantizing the whole weight (``kernels.fp8_gemm``). On CPU
(kernel "torch") the W8A16 forward is the native fused GEMM (``kernels.cpu_native.linear_fp8``: FP8 tiles
dequantized into a cache-resident float32 buffer, never a whole BF16 weight) where the extension is built.
This mirrors vLLM's online ``Fp8LinearMethod`` (BF16 checkpoint, quantized in
``process_weights_after_loading``).

Tensor parallelism: each rank quantizes its own shard. A per-tensor scale is then the rank's local amax
(vLLM's behaviour) unless ``amax_reduce`` is given (``load_model(..., global_scales=True)``): it reduces the
amax (max) over the group, so every rank's FP8 shard equals the matching slice of the unsharded model byte
for byte. Per-channel scales shard with the rows of column-parallel layers; a row-parallel layer holds part
of every row, so its per-row amax is local (vLLM) or, with ``amax_reduce``, reduced over the group.
Per-block scales shard with the blocks: a rank's shard must consist of whole 128-blocks along the sharded
dimension (checked at construction).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from layerwise.errors import NonFiniteWeightError, TensorParallelError
from layerwise.kernels import (
    BLOCK_SIZE,
    FP8_DTYPE,
    cpu_native,
    fp8_amax,
    fp8_dequantize,
    fp8_quantize,
    fp8_quantize_pieces,
    fp8_quantize_weight,
    fp8_scale,
    pieces_fit,
    scale_from_amax,
)
from layerwise.kernels.reference import ACT_GRANULARITY, activation_scale, quantize
from layerwise.quant.base import QuantMethod, check_finite

logger = logging.getLogger(__name__)
FP8_MODES = ("auto", "w8a8", "w8a16")
SCALE_NAMES = {"tensor": "weight_scale", "channel": "weight_scale", "block": "weight_scale_inv"}


def scaled_mm_supported(device: torch.device, granularity: str = "tensor") -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` with the weight scales of ``granularity`` ("tensor" or
    "channel", the latter with per-token activation scales): CUDA sm89+; on CPU per tensor wherever torch has
    ``_scaled_mm``, row-wise where :func:`cpu_rowwise_scaled_mm` finds it (torch 2.13 yes, 2.11 no)."""
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)
    if device.type != "cpu" or not hasattr(torch, "_scaled_mm"):
        return False
    return granularity != "channel" or cpu_rowwise_scaled_mm()


@functools.cache
def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``_scaled_mm`` takes row-wise scales ([M, 1] and [1, N]): tried once on a 16 x 16
    product. torch 2.11 fails an internal assertion there ("only supports per-tensor scaling for CPU backend")."""
    a = torch.ones(16, 16).to(FP8_DTYPE)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def scaled_mm_preferred(device: torch.device) -> bool:
    """Whether "auto" picks W8A8: on CUDA sm89+ only. torch 2.13's CPU ``_scaled_mm`` is a scalar
    reference, orders of magnitude behind dequantize + matmul."""
    return device.type == "cuda" and scaled_mm_supported(device)


def scaled_mm_out_dtypes(granularity: str, device: torch.device) -> tuple[torch.dtype, ...]:
    """Output (= activation) dtypes ``torch._scaled_mm`` accepts for ``granularity`` on ``device``.

    CUDA's row-wise (per-channel) FP8 GEMM is a CUTLASS kernel with bf16 output only
    (aten/src/ATen/native/cuda/RowwiseScaledMM*: f8f8bf16_rowwise); per-tensor scaling goes
    through cuBLASLt, which writes bf16, fp16 or fp32. torch 2.13's CPU ``_scaled_mm`` takes all three.
    """
    if device.type == "cuda" and granularity == "channel":
        return (torch.bfloat16,)
    return (torch.bfloat16, torch.float16, torch.float32)


# Rows of x (tokens) up to which the CUDA W8A16 forward runs the Triton FP8 GEMM; larger batches (prefill)
# dequantize the weight once and call cuBLAS, whose large-M tiles beat the decode-shaped Triton tiles while
# the dequantization is amortized over many rows. 64 is a first guess (the decode batches of issue 14 are
# 8); set it from the decode/prefill timings on the target GPU.
W8A16_GEMM_MAX_M = 64

_WARNED: set = set()  # (scheme, dtype, device type) already warned about: one warning each per process


def _warn_once(key: tuple, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning(message)


def fused_forward(kernel: str, x: torch.Tensor) -> bool:
    """Whether the forward runs the Triton kernels (fused activation quantization, FP8 GEMMs): on CUDA
    with ``kernel="triton"`` (the CUDA default) and bf16/fp16 activations. Elsewhere the torch path
    (reference activation quantization, dequantize + ``F.linear``) runs, as on CPU."""
    return kernel == "triton" and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


class Fp8LinearMethod(QuantMethod):
    """FP8 weights with one scale per tensor, per output channel, or per 128 x 128 block.

    Args:
        granularity: "tensor", "channel" or "block".
        kernel: "torch" or "triton": the kernels that quantize at load time and dequantize (W8A16).
        fp8_mode: "auto" (W8A8 on CUDA sm89+ when both weight dims are multiples of 16, else W8A16; per-block:
            the Triton block-scaled W8A8 GEMM on CUDA sm89+ with kernel "triton", else W8A16),
            "w8a8" (also on CPU, where it is slow; per-block: CUDA sm89+ with kernel "triton" only), or "w8a16".
        amax_reduce: for per-tensor scales under tensor parallelism, an in-place max-reduction of the
            rank's float32 amax over the group (None: the local amax).
    Raises:
        ValueError: unknown fp8_mode or granularity.
    The forward raises RuntimeError where fp8_mode "w8a8" cannot run (see ``_use_scaled_mm``; per-block: not
    CUDA sm89+ with kernel "triton" and bf16/fp16 activations).
    """

    replaces_weight = True  # weight -> new FP8 tensor + scale; the bias is the only tensor kept

    def __init__(
        self,
        granularity: str = "tensor",
        kernel: str = "torch",
        fp8_mode: str = "auto",
        amax_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ):
        if fp8_mode not in FP8_MODES:
            raise ValueError(f"unknown fp8_mode {fp8_mode!r}; choose one of {FP8_MODES}")
        if granularity not in SCALE_NAMES:
            raise ValueError(f"unknown granularity {granularity!r}; choose one of {tuple(SCALE_NAMES)}")
        self.granularity, self.kernel, self.fp8_mode = granularity, kernel, fp8_mode
        self.amax_reduce = amax_reduce
        self.sharded_dim: str | None = None  # "output" / "input" under tensor parallelism (configure_tp_shard)
        self.scale_name = SCALE_NAMES[granularity]
        self._scaled_mm: dict[torch.dtype, bool] = {}  # per activation dtype, decided at its first forward
        self.name = f"fp8-per-{granularity}"

    def accepts_weight_pieces(self, shape: torch.Size, spans: list[tuple[int, int]]) -> bool:
        """Pieces are quantized in place when they fit the granularity, without tensor-parallel amax reduction."""
        return self.amax_reduce is None and pieces_fit(shape, spans, self.granularity)

    def process_weights_after_loading(
        self,
        layer: nn.Module,
        into: dict[str, torch.Tensor] | None = None,
        weight_pieces: list[tuple[int, torch.Tensor]] | None = None,
    ) -> None:
        """Quantize ``layer.weight`` [out, in] to float8_e4m3fn and register its float32 scale.

        With ``into`` (a non-atomic reload), the FP8 bytes are written straight into the live ``weight`` after
        the scale is known (so after the NaN/Inf checks); the scale, a few bytes, is left to the session's copy.
        With ``weight_pieces`` the weight is quantized from them (:func:`fp8_quantize_pieces`) and
        ``layer.weight`` (left on the meta device by the session) is not read.

        Raises:
            NonFiniteWeightError: the weight or another parameter (the bias) holds NaN or Inf.
        """
        w = layer.weight  # on the meta device when given as pieces
        device = weight_pieces[0][1].device if weight_pieces else w.device
        target = (into or {}).get("weight")
        if target is None or (target.shape, target.dtype, target.device) != (w.shape, FP8_DTYPE, device):
            target = None
        # global scales: a per-tensor amax spans every rank's shard; a per-channel amax of a row-parallel
        # layer spans every rank's columns of the row. Column-parallel rows and whole blocks are complete.
        partial = self.granularity == "tensor" or (self.granularity == "channel" and self.sharded_dim == "input")
        if weight_pieces is not None:
            check_finite(layer, skip=("weight",))
            q = target.data if target is not None else torch.empty(w.shape, dtype=FP8_DTYPE, device=device)
            scale = fp8_quantize_pieces(
                weight_pieces, w.shape, self.granularity, q, self.kernel, out_fresh=target is None
            )
        else:
            q = None
            if self.amax_reduce is not None and partial:
                amax = fp8_amax(w.data, self.granularity, self.kernel)
                try:
                    check_finite(layer, skip=("weight",))  # the weight's own check is its amax
                except NonFiniteWeightError:  # join the collective anyway, with +Inf: every rank then fails together
                    self.amax_reduce(torch.full_like(amax, float("inf")))
                    raise
                scale = scale_from_amax(self.amax_reduce(amax))  # max over ranks; +Inf from any rank raises on all
            elif target is None:  # a fresh output: per channel on the CPU, one pass over the weight
                check_finite(layer, skip=("weight",))  # the weight's own check is its amax
                q, scale = fp8_quantize_weight(w.data, self.granularity, self.kernel)
            else:
                check_finite(layer, skip=("weight",))
                scale = fp8_scale(w.data, self.granularity, self.kernel)
            if q is None:
                # the scale comes from the weight's own amax (or a max over ranks): the reference may skip its clamp
                out = target.data if target is not None else None
                q = fp8_quantize(w.data, scale, self.kernel, within_range=True, out=out)
        del layer.weight
        layer.weight = nn.Parameter(q, requires_grad=False)
        scale = scale.reshape(1) if self.granularity == "tensor" else scale
        layer.register_parameter(self.scale_name, nn.Parameter(scale, requires_grad=False))

    def configure_tp_shard(self, layer_name: str, sharded_dim: str, local_sizes: Sequence[int]) -> None:
        """Remember the sharded dimension (a row-parallel layer's output rows are partial, so with
        ``amax_reduce`` its per-channel amax is reduced too). Per-block scales: every local size along the
        sharded dimension must be a multiple of 128.

        Raises:
            TensorParallelError: a shard boundary would split a 128-block (names the layer and sizes).
        """
        self.sharded_dim = sharded_dim
        if self.granularity != "block":
            return
        block = BLOCK_SIZE[0] if sharded_dim == "output" else BLOCK_SIZE[1]  # (rows, columns) of a block
        if any(n % block for n in local_sizes):
            raise TensorParallelError(
                f"{layer_name}: per-rank {sharded_dim} sizes {list(local_sizes)} are not multiples of the "
                f"{block}-element FP8 block, so a tensor-parallel shard boundary would split a block; "
                f"use fp8-per-tensor or fp8-per-channel, or a smaller tensor-parallel size"
            )

    def _use_scaled_mm(self, weight: torch.Tensor, dtype: torch.dtype) -> bool:
        """Whether the forward for activations of ``dtype`` runs W8A8 (``torch._scaled_mm``).

        Falls back to W8A16 with one logged warning when ``_scaled_mm`` does not take ``dtype``
        for this scale layout (fp16/fp32 with per-channel scales on CUDA).
        Raises:
            RuntimeError: fp8_mode "w8a8" where ``_scaled_mm`` cannot run at all (device, shape).
        """
        if self.fp8_mode == "w8a16" or self.granularity == "block":
            return False
        out_features, in_features = weight.shape
        aligned = weight.device.type != "cuda" or (in_features % 16 == 0 and out_features % 16 == 0)
        if self.fp8_mode == "auto" and not (scaled_mm_preferred(weight.device) and aligned):
            return False
        if not (scaled_mm_supported(weight.device, self.granularity) and aligned):
            raise RuntimeError(
                f"w8a8 requested but torch._scaled_mm (torch {torch.__version__}) cannot run per-{self.granularity} "
                f"scales of shape {tuple(weight.shape)} on {weight.device}; use fp8_mode='auto' or 'w8a16'"
            )
        if dtype not in scaled_mm_out_dtypes(self.granularity, weight.device):
            _warn_once(
                (self.name, dtype, weight.device.type),
                f"{self.name}: torch._scaled_mm does not take {dtype} activations on {weight.device.type}; "
                f"running W8A16 for them instead",
            )
            return False
        return True

    def _apply_triton_gemm(
        self, weight: torch.Tensor, scale: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The Triton FP8 GEMM forward on CUDA (``kernels.fp8_gemm``), or None where it does not apply.

        Per-block weights on sm_89+ (unless fp8_mode "w8a16"): activations quantized per token group of 128,
        then the block-scaled W8A8 GEMM, at any M. Otherwise W8A16 (FP8 weight bytes decoded inside the GEMM)
        for at most ``W8A16_GEMM_MAX_M`` rows; None beyond, so the caller dequantizes + ``F.linear``.
        """
        from layerwise.kernels.fp8_act import quantize_activation  # needs triton: imported on CUDA only
        from layerwise.kernels.fp8_gemm import fp8_native, w8a8_gemm, w8a16_gemm

        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        bias = bias.to(x.dtype) if bias is not None else None
        if self.granularity == "block" and self.fp8_mode != "w8a16" and fp8_native(x.device):
            # quantized first, not inside the GEMM (dynamic_w8a8_gemm: each column tile would quantize x again,
            # see kernels.fp8_gemm)
            xq, x_scale = quantize_activation(x2, ACT_GRANULARITY["block"])
            y = w8a8_gemm(xq, x_scale, weight, scale, x.dtype, bias)
        elif x2.shape[0] <= W8A16_GEMM_MAX_M and not (self.granularity == "block" and self.fp8_mode == "w8a8"):
            y = w8a16_gemm(x2, weight, scale, bias)
        else:
            return None
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """y = x @ W^T + bias for x [..., in] (bf16/fp16/fp32) -> y [..., out] in x.dtype, from the float8_e4m3fn
        weight [out, in] and its float32 scale: W8A8 (x quantized per tensor / token / token group, then
        ``_scaled_mm`` or a Triton GEMM) where :meth:`_use_scaled_mm` or the per-block Triton path applies, else
        W8A16 (the Triton GEMM up to ``W8A16_GEMM_MAX_M`` rows on CUDA; on CPU with kernel "torch" the native fused
        GEMM, ``cpu_native.linear_fp8``, where it is built and takes the tensors; else dequantize + ``F.linear``).

        Raises:
            RuntimeError: fp8_mode "w8a8" where it cannot run: ``_scaled_mm`` lacks the device, shape or scale layout
                (row-wise scales on a CPU torch without them included), or per-block weights off CUDA sm89+,
                without kernel "triton" or with fp32 activations. The message names the fp8_mode to use.
        """
        weight, scale = layer.weight, getattr(layer, self.scale_name)
        use_scaled_mm = self._scaled_mm.get(x.dtype)
        if use_scaled_mm is None:  # weight device and shape never change after loading
            use_scaled_mm = self._scaled_mm[x.dtype] = self._use_scaled_mm(weight, x.dtype)
        if not use_scaled_mm:
            y = self._apply_triton_gemm(weight, scale, x, bias) if fused_forward(self.kernel, x) else None
            if y is not None:
                return y
            if self.granularity == "block" and self.fp8_mode == "w8a8":
                raise RuntimeError(
                    f"w8a8 with per-block scales runs on CUDA sm89+ with kernel='triton' and bf16/fp16 "
                    f"activations only (the Triton block-scaled GEMM); got {x.dtype} on {x.device}, "
                    f"kernel={self.kernel!r}; use fp8_mode='auto' or 'w8a16'"
                )
            if self.kernel == "torch" and cpu_native.supports_linear(x, weight, scale, bias):
                return cpu_native.linear_fp8(x, weight, scale, bias, checked=True)  # no dequantized weight
            return F.linear(x, fp8_dequantize(weight, scale, x.dtype, self.kernel), bias)
        x2 = x.reshape(-1, x.shape[-1])
        act_granularity = ACT_GRANULARITY[self.granularity]
        if fused_forward(self.kernel, x):  # one Triton launch (two per tensor) instead of ~10 torch kernels
            from layerwise.kernels.fp8_act import quantize_activation  # needs triton: imported on CUDA only
            from layerwise.kernels.fp8_gemm import dynamic_w8a8_gemm, tuned_tiles

            tiles = tuned_tiles("w8a8", x2.shape[0], weight.shape[0], weight.shape[1], x.device)
            if tiles is not None:  # the tuner found the Triton W8A8 GEMM (x quantized inside) faster on this GPU
                bias = bias.to(x.dtype) if bias is not None else None
                y = dynamic_w8a8_gemm(x2.contiguous(), act_granularity, weight, scale, bias, tiles)
                return y.reshape(*x.shape[:-1], weight.shape[0])
            xq, x_scale = quantize_activation(x2.contiguous(), act_granularity)
        else:
            x_scale = activation_scale(x2, act_granularity)
            xq = quantize(x2, x_scale, torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device))
        w_scale = scale if self.granularity == "tensor" else scale.t()  # [1, out] for row-wise
        y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])
