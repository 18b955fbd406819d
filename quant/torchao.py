"""torchao configs applied layer by layer inside process_weights_after_loading.

``quantization="torchao:Float8WeightOnlyConfig"`` (or any config class exported by
``torchao.quantization`` that ``quantize_`` accepts for an ``nn.Linear``) quantizes each Linear
weight as soon as its layer is loaded, so the peak stays the final model plus about one layer,
instead of torchao's usual "load everything in BF16, then quantize_". The weight becomes the
torchao tensor subclass; forward is ``F.linear``, which the subclass dispatches.
Reload copies into the existing subclass (``copy_`` of Float8Tensor and Int8Tensor copies their
inner qdata/scale storages in place, measured with torchao 0.18), or, for a per-row float8 weight whose
loads are whole rows, writes its qdata and scale directly (Limitations 5).

Row chunks (see :meth:`TorchaoLinearMethod.quantize_rows`): torchao's ``quantize_`` makes float32
temporaries of everything it quantizes, so a weight is quantized a few rows at a time and the
subclass reassembled. That is exact only where every output row depends on its input row alone.

Limitations (the code points back to them):

1. Only the tensor types in ``ROW_LOCAL_TYPES`` are chunked (their inner tensors are plain arrays
   indexed by weight row), and only when their ``block_size`` is ``[1, G]`` (per row, or groups
   within a row). Per-tensor scales (``PerTensor()`` granularity, the default of
   ``Float8DynamicActivationFloat8WeightConfig``) depend on every row: such weights are quantized
   whole by ``quantize_``, float32 temporaries included, except as in 4.
2. torchao may leave a weight unquantized (a plain tensor): ``Float8DynamicActivationFloat8WeightConfig``
   skips weights whose dimensions are not multiples of 16, ``Int4WeightOnlyConfig`` skips on CPU. Row
   chunks are multiples of 16 rows so a chunk is skipped only where the whole weight is; whenever a
   chunk's result differs in kind from the first chunk's (plain vs subclass, another type or
   metadata) the whole weight is quantized at once instead, so the result is always torchao's
   result for the whole weight.
3. Where this module reproduces torchao's arithmetic (``_LOCAL_ROWS``: ``Float8Tensor`` and ``Int8Tensor``
   per row, see :func:`_float8_rows`, :func:`_int8_rows`), only the first chunk and a shorter last chunk
   go through ``quantize_``; the rest is computed here, without the per-chunk cost of ``quantize_``
   (an nn.Linear, config checks, the subclass built and flattened). The torchao results are compared
   byte for byte with the local ones, and any difference sends the weight back to ``quantize_`` per
   chunk. The check is made once per process for each config, chunk shape, dtype and device: later
   weights of the same shape are computed here whole (``_VERIFIED``). This assumes that torchao's
   decision to quantize or skip a chunk depends on its shape, dtype and device, not its values (true
   of torchao 0.18), so the middle chunks, shaped like the first, are quantized where it is.
4. A per-tensor ``Float8Tensor`` (torch kernel) is computed here in two passes: max|w| over the whole
   weight (``torch.aminmax``, no temporary), then the quantization in row chunks. The arithmetic is first
   checked byte for byte against torchao's result for the first chunk alone (its own per-tensor scale);
   a difference sends the weight to ``quantize_`` whole. As in 3, the check is made once per process for each
   config, chunk shape, dtype and device (``_VERIFIED_PER_TENSOR``).
5. A weight whose shape was verified (3) as a per-row float8_e4m3fn ``Float8Tensor`` and whose loads are verbatim
   copies of whole rows (``layerwise/reload`` Limitations 10) is quantized from the loaded tensors themselves
   on the native CPU kernels, with no BF16 copy: every row scale first (the NaN/Inf check, and 6's check as a
   zero scale), then the bytes, on a non-atomic reload straight into the live weight's ``qdata`` and ``scale``
   (the live tensor object is kept). The first weight of each shape in a process is assembled and quantized
   as in 3, to be verified.
6. torchao's result is checked too, not only the weight it came from: a finite weight can quantize to NaN
   (torchao's float8 gives an all-zero row, or a per-tensor all-zero weight, the scale 0 and 0 / 0 = NaN bytes;
   its int8 configs clamp their scales to float32's eps, and int8 and intx stayed finite on all-zero rows, blocks
   and weights with torchao 0.18: tests/test_zero_weights.py). Any NaN or Inf in the result's inner
   tensors (qdata, scale, ...) is a NonFiniteWeightError naming the scheme (:func:`check_quantized`), raised
   before the result reaches the model: the session names the module and writes nothing of it (a reload that
   defers its checks, ``layerwise/reload`` Limitations 12, records the check instead, writes the module and
   raises at its end, as for a NaN in the checkpoint; atomic still changes nothing). The bytes stay torchao's
   (``quantize_rows`` returns them as they are); making such rows finite would change what torchao computes,
   so this module refuses them instead. The check is one pass over qdata's bytes (two max reductions, no
   temporary) and one over the scales.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from layerwise.errors import NonFiniteWeightError
from layerwise.kernels import FP8_DTYPE, cpu_native, pieces_fit, require_finite
from layerwise.kernels.finite import deferred_sink
from layerwise.optional import import_optional
from layerwise.quant.base import QuantMethod, check_finite

logger = logging.getLogger(__name__)

#: torchao tensor subclasses whose inner tensors are [N, ...] arrays indexed by weight row (Limitations 1)
ROW_LOCAL_TYPES = ("Float8Tensor", "Int8Tensor", "IntxUnpackedToInt8Tensor")
#: row chunks are multiples of this many rows: torchao's float8 configs skip a weight whose dimensions
#: are not multiples of 16 (torchao.quantization.utils._fp8_mm_compat), so an aligned chunk is
#: skipped exactly when the whole weight is
ROW_ALIGN = 16
#: default elements per row chunk on the CPU (torchao makes a few float32 copies of a chunk: 1 MiB each)
DEFAULT_CHUNK_NUMEL = 1 << 18
#: default elements per row chunk on other devices (a GPU): each chunk costs ~10 kernel launches and its Python,
#: and CPU-sized chunks cut an 8B model's weights into 27.6k (64 rows, 16 for down_proj's K = 14336; the H100
#: torchao reload in benchmarks/results/reload_latency_cuda_8b.json ran with them). With this budget the N / 8 rows
#: bound decides (8 chunks a weight); the local float32 work buffer is 1/8 of a weight's elements (58.7 MB for
#: Llama-3-8B's gate_up_proj; torchao's own quantize_ of a chunk makes a few of that size), below the BF16
#: module the session materializes
DEVICE_CHUNK_NUMEL = 1 << 24


def torchao_config(name: str):
    """An instance of ``torchao.quantization.<name>`` (default arguments); the class name is matched
    exactly, or else case-insensitively.

    Raises:
        MissingDependencyError: torchao is not installed (the message gives the pip line).
        ValueError: no such config class (the message lists torchao's).
    """
    tq = import_optional("torchao.quantization", extra="torchao", purpose=f"quantization 'torchao:{name}'")
    known = sorted(n for n in dir(tq) if n.endswith("Config") and not n.startswith("_"))
    match = name if name in known else next((n for n in known if n.lower() == name.lower()), None)
    if match is None:
        raise ValueError(f"unknown torchao config {name!r}; torchao.quantization has {', '.join(known)}")
    return getattr(tq, match)()


def quantize_whole(weight: torch.Tensor, config) -> torch.Tensor:
    """torchao's ``quantize_(config)`` applied to an ``nn.Linear`` holding ``weight`` [N, K]: the
    torchao tensor subclass, or a plain tensor where torchao leaves the weight as it is."""
    from torchao.quantization import quantize_

    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    quantize_(linear, config)
    quantized = linear.weight.data
    # quantize_ leaves the module in a reference cycle (a bound method in a partial), which would
    # keep both the BF16 input and the result alive until the next garbage collection
    linear._parameters.clear()
    return quantized


def _row_layout(t: torch.Tensor, rows: int):
    """(type, inner tensor names, flatten context) of a quantized [rows, K] chunk whose inner tensors
    are split by weight row (Limitations 1), else None."""
    if type(t).__name__ not in ROW_LOCAL_TYPES or not hasattr(t, "__tensor_flatten__"):
        return None
    names, ctx = t.__tensor_flatten__()
    block_size = list(ctx.get("block_size", ())) if isinstance(ctx, dict) else []
    if len(block_size) != 2 or block_size[0] != 1 or t.dim() != 2:
        return None
    if not all(getattr(t, n).dim() >= 1 and getattr(t, n).shape[0] == rows for n in names):
        return None
    return type(t), list(names), ctx


def _float8_rows(w: torch.Tensor, out: dict, ctx: dict, work: torch.Tensor) -> None:
    """Per-row float8 quantization of ``w`` [R, K] into ``out["qdata"]`` [R, K] (float8) and ``out["scale"]``
    [R, 1] (float32), byte-identical to torchao's ``Float8Tensor.from_hp(w, granularity=PerRow())`` with its
    torch kernel (``_choose_scale_float8`` then ``_quantize_affine_float8``, torchao 0.18): the row amax and
    ``amax / max`` are computed in ``w.dtype`` (a BF16 weight gets a BF16-rounded scale), then
    ``clamp(w.float() / scale, -max, max)`` is cast. An all-zero row gets scale 0 and NaN bytes, as in
    torchao. ``work``: float32, at least ``w.numel()`` elements (no other temporary is that large)."""
    qdata, scale = out["qdata"], out["scale"]
    fmax = torch.finfo(qdata.dtype).max
    if qdata.dtype == FP8_DTYPE and cpu_native.supports(w, qdata):  # the same arithmetic, one pass each
        scale.copy_(_native_row_scales(w))
        cpu_native.quantize(w, scale, "channel", out=qdata)  # clamp(float32(w) / scale) cast, as below
        return
    x = work[: w.numel()].view(w.shape).copy_(w)  # exact; torch's CPU reductions are faster on float32 than on bf16
    hi, lo = x.amax(dim=1, keepdim=True), x.amin(dim=1, keepdim=True)  # (torch.aminmax over rows is slower)
    amax = torch.maximum(hi, lo.neg_()).abs_().to(w.dtype)  # == w.abs().amax(1) (NaN propagates), +0.0 if all 0
    scale.copy_(amax / fmax)
    qdata.copy_(x.div_(scale).clamp_(-fmax, fmax))  # float32 / float32 scale, as torchao's w.float() / scale


def _native_row_scales(w: torch.Tensor) -> torch.Tensor:
    """torchao's per-row float8_e4m3fn scales of ``w`` [R, K] (a tensor ``cpu_native.supports``), [R, 1] in w.dtype:
    the row amax and ``amax / max`` computed in ``w.dtype``, as :func:`_float8_rows` describes."""
    return cpu_native.amax(w, "channel").to(w.dtype) / torch.finfo(FP8_DTYPE).max


def _int8_rows(w: torch.Tensor, out: dict, ctx: dict, work: torch.Tensor) -> None:
    """Per-row symmetric int8 quantization of ``w`` [R, K] into ``out["qdata"]`` [R, K] (int8), ``out["scale"]``
    [R, 1] (float32) and ``out["zero_point"]`` [R, 1] (int8, zeros), byte-identical to torchao's
    ``Int8Tensor.from_hp(w, granularity=PerRow())`` (``choose_qparams_affine`` SYMMETRIC with float32 eps,
    then ``quantize_affine``, torchao 0.18): scale = max(-min(row_min, 0), max(row_max, 0)) / ((qmax - qmin)
    / 2) in ``w.dtype``, clamped to >= eps, then ``clamp(round(w * (1 / scale)), qmin, qmax)`` in float32;
    [qmin, qmax] = [-128, 127], or [-64, 63] with ``reduce_range``. (torchao also adds the zero point, 0
    for symmetric mappings: that only turns -0.0 into +0.0, the same int8 byte.) ``work`` as in
    :func:`_float8_rows`."""
    qdata, scale, zero_point = out["qdata"], out["scale"], out["zero_point"]
    qmin, qmax = (-64, 63) if ctx.get("reduce_range") else (-128, 127)
    x = work[: w.numel()].view(w.shape).copy_(w)  # exact; torch's CPU reductions are faster on float32 than on bf16
    min_val = x.amin(dim=1, keepdim=True).to(w.dtype)
    max_val = x.amax(dim=1, keepdim=True).to(w.dtype)
    min_neg = torch.min(min_val, torch.zeros_like(min_val))
    max_pos = torch.max(-min_neg, torch.max(max_val, torch.zeros_like(max_val)))
    scale.copy_(torch.clamp(max_pos / (float(qmax - qmin) / 2), min=torch.finfo(torch.float32).eps))
    zero_point.zero_()
    qdata.copy_(x.mul_(1.0 / scale).round_().clamp_(qmin, qmax))  # as torchao's w * (1 / scale), in float32


#: (repr(config), chunk rows, rows of a shorter last chunk, K, dtype, device) -> (layout, [(inner name, (shape
#: past the rows, dtype))]) of chunks whose local arithmetic matched torchao's bytes (Limitations 3). Holds
#: no tensor and no model; cleared when it reaches 256 entries.
_VERIFIED: dict = {}

#: the same key -> (layout, qdata dtype, scale shape, scale dtype) of per-tensor float8 weights whose local
#: arithmetic matched torchao's bytes (Limitations 4). Holds no tensor and no model; cleared at 256 entries.
_VERIFIED_PER_TENSOR: dict = {}


def _remember(verified: dict, key: tuple, value) -> None:
    """Record a verified chunk shape in ``verified`` (``_VERIFIED`` or ``_VERIFIED_PER_TENSOR``), which is emptied
    when it reaches 256 entries."""
    if len(verified) >= 256:
        verified.clear()
    verified[key] = value


#: torchao tensor type -> (inner tensor names, this module's arithmetic for its chunks) (Limitations 3)
_LOCAL_ROWS = {
    "Float8Tensor": (["qdata", "scale"], _float8_rows),
    "Int8Tensor": (["qdata", "scale", "zero_point"], _int8_rows),
}


def _local_rows(layout, k: int, device: torch.device):
    """This module's arithmetic for chunks of ``layout`` where it may reproduce torchao's (Limitations 3), else
    None: one scale per row (block_size [1, K]), the inner tensors it writes, and for Float8Tensor torchao's
    torch kernel, not MSLK (which torchao picks on CUDA sm90+ where the mslk package is installed, or when
    ``kernel_preference`` asks for it)."""
    cls, names, ctx = layout
    names_and_fn = _LOCAL_ROWS.get(cls.__name__)
    if names_and_fn is None or names != names_and_fn[0] or list(ctx["block_size"]) != [1, k]:
        return None
    if cls.__name__ == "Float8Tensor":
        if getattr(ctx.get("kernel_preference"), "name", "AUTO") == "MSLK":
            return None
        if device.type == "cuda":
            from torchao.utils import _is_mslk_available

            if _is_mslk_available():
                return None
    return names_and_fn[1]


def _per_tensor_float8_layout(t: torch.Tensor, device: torch.device):
    """(type, inner names, flatten context without block_size) of a Float8Tensor with one scale for the whole
    chunk ``t``, quantized with torchao's torch kernel (see :func:`_local_rows`), else None (Limitations 4)."""
    if type(t).__name__ != "Float8Tensor" or not hasattr(t, "__tensor_flatten__"):
        return None
    names, ctx = t.__tensor_flatten__()
    if sorted(names) != ["qdata", "scale"] or list(ctx["block_size"]) != list(t.shape) or t.scale.numel() != 1:
        return None
    if _local_rows((type(t), ["qdata", "scale"], dict(ctx, block_size=[1, t.shape[1]])), t.shape[1], device) is None:
        return None
    return type(t), sorted(names), {name: v for name, v in ctx.items() if name != "block_size"}


def _float8_per_tensor(w: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, work: torch.Tensor) -> None:
    """Per-tensor float8 quantization of ``w`` [N, K] into ``qdata`` [N, K] and ``scale`` [1, 1] (float32),
    byte-identical to torchao's ``Float8Tensor.from_hp(w, granularity=PerTensor())`` with its torch kernel:
    amax = max|w| and ``amax / max`` in ``w.dtype``, then ``clamp(w.float() / scale, -max, max)`` cast, in
    row chunks of ``work.numel() // K`` rows (``work``: float32)."""
    fmax = torch.finfo(qdata.dtype).max
    lo, hi = torch.aminmax(w)  # one pass over w, no temporary; NaN propagates
    amax = torch.maximum(hi, lo.neg()).abs_()  # == w.abs().amax(), in w.dtype
    scale.copy_((amax / fmax).reshape(1, 1))
    n, k = w.shape
    rows = max(1, work.numel() // k)
    for r0 in range(0, n, rows):
        x = work[: min(rows, n - r0) * k].view(-1, k).copy_(w[r0 : r0 + rows])
        qdata[r0 : r0 + rows].copy_(x.div_(scale).clamp_(-fmax, fmax))


def _check_finite(t: torch.Tensor) -> None:
    """Raise NonFiniteWeightError (naming the parameter 'weight') where ``t`` holds NaN or Inf (inside
    ``deferred_finite_checks``: recorded instead, see :func:`layerwise.kernels.require_finite`)."""
    require_finite(t, "parameter 'weight' holds NaN or Inf")


def _inner_tensors(t: torch.Tensor, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(name, plain tensor) of every inner tensor of a torchao tensor subclass, nested ones as "tensor_impl.scale";
    none for a plain tensor (a weight torchao left unquantized is the weight itself, checked before)."""
    if not is_traceable_wrapper_subclass(t):
        return []
    out = []
    for name in t.__tensor_flatten__()[0]:
        inner = getattr(t, name)
        out += (
            _inner_tensors(inner, f"{prefix}{name}.")
            if is_traceable_wrapper_subclass(inner)
            else [(prefix + name, inner)]
        )
    return out


def _non_finite_result(scheme: str, where: str, scales: list[torch.Tensor]) -> NonFiniteWeightError:
    """The error of a finite weight that ``scheme`` quantized to NaN or Inf (Limitations 6): where, and how many of
    ``scales`` (the result's floating inner tensors named "scale") are 0, the float8 cause. Reads them (error path)."""
    message = f"{scheme} quantized the finite weight to NaN or Inf (in its {where})"
    zero, total = sum(int((s == 0).sum()) for s in scales), sum(s.numel() for s in scales)
    if zero:
        message += (
            f": {zero} of its {total} scales are 0 (an all-zero row or block, or an all-zero weight: torchao's "
            f"float8 divides it by a zero scale, 0 / 0 = NaN); fp8-per-tensor, fp8-per-channel and fp8-per-block "
            f"quantize such weights to zeros"
        )
    return NonFiniteWeightError(message)


def check_quantized(quantized: torch.Tensor, scheme: str) -> None:
    """Raise NonFiniteWeightError (naming ``scheme``) where an inner tensor of torchao's result ``quantized`` (qdata,
    scale, ...) holds NaN or Inf (Limitations 6); inside ``deferred_finite_checks`` recorded instead (see
    :func:`layerwise.kernels.require_finite`). Float8 bytes are checked by two max reductions, no temporary."""
    inner = _inner_tensors(quantized)
    for where, t in inner:
        try:
            require_finite(t, "")
        except NonFiniteWeightError:
            scales = [s for n, s in inner if n.rpartition(".")[2] == "scale" and s.is_floating_point()]
            raise _non_finite_result(scheme, where, scales) from None


def _check_scales_nonzero(scale: torch.Tensor, scheme: str) -> None:
    """Limitations 6 for per-row float8 computed here (5), before its bytes are written: a row whose scale is 0 (an
    all-zero row) gets NaN bytes, as in torchao. Raises NonFiniteWeightError naming ``scheme``; inside
    ``deferred_finite_checks`` records the check instead."""
    flag = (scale == 0).any()
    sink = deferred_sink()
    if sink is not None:
        sink.append(flag)
    elif bool(flag):
        raise _non_finite_result(scheme, "qdata", [scale])


class TorchaoLinearMethod(QuantMethod):
    """Applies a torchao config to one Linear weight at a time.

    Args:
        config_name: class name in ``torchao.quantization``, e.g. "Float8WeightOnlyConfig",
            "Int8WeightOnlyConfig" (default arguments), or a config instance, e.g.
            ``Float8WeightOnlyConfig(granularity=PerTensor())``.
        chunk_numel: at most this many weight elements are quantized at a time (rounded to whole
            multiples of ``ROW_ALIGN`` rows, at least ``ROW_ALIGN`` rows, at most N / 8 rows);
            a weight of at most one chunk of rows is quantized whole (see :meth:`quantize_rows`).
            None: ``DEFAULT_CHUNK_NUMEL`` for a weight on the CPU, ``DEVICE_CHUNK_NUMEL`` elsewhere.
    Raises:
        MissingDependencyError / ValueError: as :func:`torchao_config`.
    """

    def __init__(self, config_name, *, chunk_numel: int | None = None):
        self.config = torchao_config(config_name) if isinstance(config_name, str) else config_name
        self.name = f"torchao:{type(self.config).__name__}"
        self.chunk_numel = chunk_numel
        # later chunks need not set torchao's recommended Inductor options again (the first one did)
        fields = {f.name for f in dataclasses.fields(self.config)} if dataclasses.is_dataclass(self.config) else ()
        self._chunk_config = (
            dataclasses.replace(self.config, set_inductor_config=False)
            if "set_inductor_config" in fields
            else self.config
        )

    def _chunk_rows(self, n: int, k: int, device: torch.device) -> int:
        """Rows per chunk of a weight on ``device``: at most chunk_numel elements (its device default when None)
        and N / 8 rows, a multiple of ROW_ALIGN."""
        budget = self.chunk_numel
        if budget is None:
            budget = DEFAULT_CHUNK_NUMEL if device.type == "cpu" else DEVICE_CHUNK_NUMEL
        rows = min(budget // max(1, k), -(-n // 8))
        return max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN)

    def quantize_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """torchao's quantization of ``weight`` [N, K] (``quantize_`` on an ``nn.Linear`` holding it), computed
        in row chunks where that gives the same bytes (see the module's Limitations).

        Returns:
            the torchao tensor subclass [N, K] (e.g. Float8Tensor: qdata float8 [N, K], scale float32 [N, 1]),
            or a plain tensor where torchao leaves the weight unquantized (logged as a warning).
        Raises:
            NonFiniteWeightError: ``weight`` holds NaN or Inf (checked on the row scales where the chunks are
                computed locally: a non-finite row has a non-finite scale; else on ``weight``).
        """
        n, k = weight.shape
        rows = self._chunk_rows(n, k, weight.device)
        if n <= rows:
            return self._quantize(weight)
        key = (repr(self.config), rows, n % rows, k, weight.dtype, weight.device)
        per_tensor = _VERIFIED_PER_TENSOR.get(key)
        if per_tensor is not None:  # Limitations 4: this shape was quantized locally and checked before
            return self._float8_per_tensor_local(weight, rows, per_tensor)
        verified = _VERIFIED.get(key)
        if verified is not None:  # Limitations 3: this shape was quantized locally and checked before
            (cls, names, ctx), tails = verified
            inner = {
                name: torch.empty((n, *shape), dtype=dtype, device=weight.device) for name, (shape, dtype) in tails
            }
            self._local_chunks(weight, rows, {}, verified[0], inner)
            return self._unflatten(cls, inner, ctx, weight)
        first = quantize_whole(weight[:rows], self.config)
        layout = _row_layout(first, rows)
        if layout is None:  # plain, per-tensor, or a type not known to be row-local
            per_tensor = _per_tensor_float8_layout(first, weight.device)
            if per_tensor is not None:
                quantized = self._float8_per_tensor(weight, rows, first, per_tensor, key)
                if quantized is not None:
                    return quantized
            del first
            return self._quantize(weight)
        cls, names, ctx = layout
        inner = {name: getattr(first, name).new_empty((n, *getattr(first, name).shape[1:])) for name in names}
        if _local_rows(layout, k, weight.device) is not None:
            references = {0: first}
            if n % rows:  # torchao's own result for the shorter last chunk: skipped, or its bytes
                last = quantize_whole(weight[n - n % rows :], self._chunk_config)
                if _row_layout(last, n % rows) != layout:  # Limitations 2
                    del first, last, references, inner
                    return self._quantize(weight)
                references[n - n % rows] = last
            if self._local_chunks(weight, rows, references, layout, inner):
                _remember(_VERIFIED, key, (layout, [(name, (t.shape[1:], t.dtype)) for name, t in inner.items()]))
                return self._unflatten(cls, inner, ctx, weight)
            del references
        _check_finite(weight)
        for name in names:
            inner[name][:rows].copy_(getattr(first, name))
        del first
        for r0 in range(rows, n, rows):
            r1 = min(r0 + rows, n)
            part = quantize_whole(weight[r0:r1], self._chunk_config)
            if _row_layout(part, r1 - r0) != layout:  # Limitations 2: not the kind of the first chunk
                del part, inner
                return self._quantize(weight)
            for name in names:
                inner[name][r0:r1].copy_(getattr(part, name))
            del part
        return cls.__tensor_unflatten__(inner, ctx, weight.shape, weight.stride())

    def _float8_per_tensor(self, weight: torch.Tensor, rows: int, first: torch.Tensor, layout, key: tuple):
        """The per-tensor Float8Tensor of ``weight`` computed locally in two passes (Limitations 4), or None where
        torchao would treat a shorter last chunk differently (Limitations 2) or the local bytes of ``first``'s
        rows differ from torchao's ``first``. A match is remembered under ``key`` for later weights."""
        n, k = weight.shape
        if (
            n % rows
            and _per_tensor_float8_layout(quantize_whole(weight[n - n % rows :], self._chunk_config), weight.device)
            != layout
        ):
            return None
        work = torch.empty(rows * k, dtype=torch.float32, device=weight.device)
        qdata, scale = torch.empty_like(first.qdata), torch.empty_like(first.scale)
        _float8_per_tensor(weight[:rows], qdata, scale, work)  # the arithmetic, checked on the first chunk alone
        for mine, theirs in ((qdata, first.qdata), (scale, first.scale)):
            if not torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)):
                logger.warning("%s: the local per-tensor float8 differs from torchao's; quantize_ whole", self.name)
                return None
        spec = (layout, first.qdata.dtype, tuple(first.scale.shape), first.scale.dtype)
        del first, qdata, scale, work
        _remember(_VERIFIED_PER_TENSOR, key, spec)
        return self._float8_per_tensor_local(weight, rows, spec)

    def _float8_per_tensor_local(self, weight: torch.Tensor, rows: int, spec) -> torch.Tensor:
        """The per-tensor Float8Tensor of ``weight`` by this module's arithmetic (Limitations 4), for a ``spec``
        (layout, qdata dtype, scale shape, scale dtype) checked against torchao's bytes."""
        (cls, _, ctx), qdata_dtype, scale_shape, scale_dtype = spec
        n, k = weight.shape
        work = torch.empty(rows * k, dtype=torch.float32, device=weight.device)
        inner = {
            "qdata": torch.empty((n, k), dtype=qdata_dtype, device=weight.device),
            "scale": torch.empty(scale_shape, dtype=scale_dtype, device=weight.device),
        }
        _float8_per_tensor(weight, inner["qdata"], inner["scale"], work)
        return self._unflatten(cls, inner, dict(ctx, block_size=[n, k]), weight)

    @staticmethod
    def _unflatten(cls, inner: dict, ctx: dict, weight: torch.Tensor) -> torch.Tensor:
        """The torchao tensor from locally computed ``inner`` tensors, after their finiteness check (NaN and Inf
        in a row reach its scale); ``ctx`` is copied, so no two weights share its block_size list."""
        _check_finite(inner["scale"])
        ctx = {name: list(v) if isinstance(v, list) else v for name, v in ctx.items()}
        return cls.__tensor_unflatten__(inner, ctx, weight.shape, weight.stride())

    def _local_chunks(self, weight: torch.Tensor, rows: int, references: dict, layout, inner: dict) -> bool:
        """Fill ``inner`` with the local arithmetic of ``layout`` (:func:`_local_rows`), ``rows`` at a time
        (Limitations 3); False (``inner`` then partly written) where the local bytes differ from a torchao
        result in ``references`` ({first row: torchao tensor} of the first chunk and a shorter last one)."""
        n, k = weight.shape
        _, names, ctx = layout
        local_rows = _local_rows(layout, k, weight.device)
        work = torch.empty(rows * k, dtype=torch.float32, device=weight.device)
        # the chunks torchao also quantized first (to compare), then the rest: in one span where float8 runs on
        # the native CPU kernels (they need no float32 work buffer), else chunk by chunk
        spans = [(r0, min(r0 + rows, n)) for r0 in sorted(references)]
        native = local_rows is _float8_rows and inner["qdata"].dtype == FP8_DTYPE and cpu_native.supports(weight)
        rest = [r for r in range(0, n, rows) if r not in references]
        if native and rest:  # one run: the references are the first chunk and the shorter last one
            spans.append((rest[0], min(rest[-1] + rows, n)))
        else:
            spans += [(r, min(r + rows, n)) for r in rest]
        for r0, r1 in spans:
            local_rows(weight[r0:r1], {name: inner[name][r0:r1] for name in names}, ctx, work)
            reference = references.get(r0)
            for name in names if reference is not None else ():
                if not torch.equal(inner[name][r0:r1].view(torch.uint8), getattr(reference, name).view(torch.uint8)):
                    logger.warning("%s: the local %s differs from torchao's; quantize_ per chunk", self.name, name)
                    return False
        return True

    def _quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """The whole ``weight`` [N, K] through :func:`quantize_whole`, after the finiteness check; a weight torchao
        leaves plain is logged."""
        _check_finite(weight)
        quantized = quantize_whole(weight, self.config)
        if not hasattr(quantized, "__tensor_flatten__"):
            logger.warning(
                "%s left a weight of shape %s unquantized (%s)", self.name, tuple(weight.shape), quantized.dtype
            )
        return quantized

    def _native_float8_layout(self, n: int, k: int, dtype: torch.dtype, device: torch.device):
        """The layout of a per-row Float8Tensor (float8_e4m3fn) that an [N, K] ``dtype`` weight on ``device`` was
        verified to have (Limitations 3) and the native CPU kernels compute (Limitations 5), else None."""
        rows = self._chunk_rows(n, k, device)
        if n <= rows or not cpu_native.available():  # a weight of one chunk goes to quantize_ whole
            return None
        verified = _VERIFIED.get((repr(self.config), rows, n % rows, k, dtype, device))
        if verified is None or _local_rows(verified[0], k, device) is not _float8_rows:
            return None
        return verified[0] if dict(verified[1])["qdata"][1] == FP8_DTYPE else None

    def accepts_weight_pieces(self, shape: torch.Size, spans: list[tuple[int, int]]) -> bool:
        """Whole rows of a weight whose shape was verified as a per-row float8 layout (Limitations 5)."""
        cpu = torch.device("cpu")
        return (
            len(shape) == 2
            and any(self._native_float8_layout(*shape, dtype, cpu) is not None for dtype in cpu_native.DTYPE_CODES)
            and pieces_fit(shape, spans, "channel")
        )

    def _quantize_pieces(
        self, pieces: list[tuple[int, torch.Tensor]], meta: torch.Tensor, into: dict[str, torch.Tensor] | None
    ) -> torch.Tensor:
        """:meth:`quantize_rows` of the weight given as ``pieces`` (whole rows, see ``accepts_weight_pieces``),
        each quantized where it lies: the row scales of every piece first (the finiteness check), then the
        float8 bytes, into the live weight's own qdata and scale when ``into`` holds a matching Float8Tensor
        (Limitations 5). A weight whose layout is not verified for the pieces' dtype and device is assembled
        and quantized by :meth:`quantize_rows`."""
        (n, k), (dtype, device) = meta.shape, (pieces[0][1].dtype, pieces[0][1].device)
        layout = self._native_float8_layout(n, k, dtype, device)
        if layout is None or not all(t.dtype == dtype and cpu_native.supports(t) for _, t in pieces):
            weight = torch.empty(n, k, dtype=dtype, device=device)
            for off, t in pieces:
                weight.view(-1)[off : off + t.numel()].copy_(t.reshape(-1))
            return self.quantize_rows(weight)
        cls, _, ctx = layout
        rows = [(off // k, t.view(-1, k)) for off, t in pieces]
        scale = torch.empty(n, 1, dtype=torch.float32)
        for r0, t in rows:
            scale[r0 : r0 + t.shape[0]] = _native_row_scales(t)
        _check_finite(scale)  # a NaN or Inf row has a non-finite scale; raised before any write
        _check_scales_nonzero(scale, self.name)  # an all-zero row would get NaN bytes (Limitations 6)
        live = (into or {}).get("weight")
        if not (
            type(live) is cls
            and live.shape == (n, k)
            and all(
                (getattr(live, name).shape, getattr(live, name).dtype) == want and getattr(live, name).is_contiguous()
                for name, want in (("qdata", ((n, k), FP8_DTYPE)), ("scale", ((n, 1), torch.float32)))
            )
        ):
            live = None
        qdata = live.qdata if live is not None else torch.empty(n, k, dtype=FP8_DTYPE)
        if live is not None:
            scale = live.scale.copy_(scale)
        # a scale rounded to the weight's dtype is within 2^-8 of amax / 448, so |w / scale| < 450: the unclamped
        # conversion gives the same bytes, unless a scale is 0 (an all-zero row: NaN bytes, as torchao's) or tiny
        within = bool((scale >= torch.finfo(torch.float32).tiny).all())
        for r0, t in rows:
            r1 = r0 + t.shape[0]
            cpu_native.quantize(t, scale[r0:r1], "channel", out=qdata[r0:r1], within_range=within)
        return live if live is not None else self._unflatten(cls, {"qdata": qdata, "scale": scale}, ctx, meta)

    def process_weights_after_loading(
        self,
        layer: nn.Module,
        into: dict[str, torch.Tensor] | None = None,
        weight_pieces: list[tuple[int, torch.Tensor]] | None = None,
    ) -> None:
        """Replace ``layer.weight`` [N, K] by :meth:`quantize_rows` of it. Given ``weight_pieces`` (``layer.weight``
        then on the meta device), the pieces are quantized where they lie, and with ``into`` (a non-atomic
        reload) straight into the live weight's inner tensors, which then stays the layer's weight
        (Limitations 5); else ``into`` is not used.

        Raises:
            NonFiniteWeightError: the weight or another parameter (the bias) holds NaN or Inf, or torchao quantized
                the finite weight to NaN or Inf (an all-zero row in float8, Limitations 6; the message names the
                scheme). Raised before anything is written into ``into``.
        """
        check_finite(layer, skip=("weight",))  # the weight's own check is in quantize_rows
        if weight_pieces is not None:
            quantized = self._quantize_pieces(weight_pieces, layer.weight, into)
        else:
            quantized = self.quantize_rows(layer.weight.data)
        live = quantized if isinstance(quantized, nn.Parameter) else None  # the live weight, written in place
        if live is None:  # a live weight was checked before its bytes were written (_quantize_pieces)
            check_quantized(quantized, self.name)
        del layer.weight
        layer.weight = live if live is not None else nn.Parameter(quantized, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear`` with the torchao tensor subclass weight: torchao dispatches the quantized matmul."""
        return F.linear(x, layer.weight, bias)
