"""torchao configs applied layer by layer inside process_weights_after_loading.

``quantization="torchao:Float8WeightOnlyConfig"`` (or any config class exported by
``torchao.quantization`` that ``quantize_`` accepts for an ``nn.Linear``) quantizes each Linear
weight as soon as its layer is loaded, so the peak stays the final model plus about one layer,
instead of torchao's usual "load everything in BF16, then quantize_". The weight becomes the
torchao tensor subclass; forward is ``F.linear``, which the subclass dispatches.
Reload copies into the existing subclass (``copy_`` of Float8Tensor and Int8Tensor copies their
inner qdata/scale storages in place, measured with torchao 0.18).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerwise.kernels.reference import CHUNK_NUMEL
from layerwise.optional import import_optional
from layerwise.quant.base import QuantMethod, check_finite


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


class TorchaoLinearMethod(QuantMethod):
    """Applies a torchao config to one Linear weight at a time.

    Args:
        config_name: class name in ``torchao.quantization``, e.g. "Float8WeightOnlyConfig",
            "Int8WeightOnlyConfig".
    """

    def __init__(self, config_name: str):
        self.config = torchao_config(config_name)
        self.name = f"torchao:{type(self.config).__name__}"

    def _quantize(self, weight: torch.Tensor) -> torch.Tensor:
        from torchao.quantization import quantize_

        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        quantize_(linear, self.config)
        quantized = linear.weight.data
        # quantize_ leaves the module in a reference cycle (a bound method in a partial), which would
        # keep both the BF16 input and the result alive until the next garbage collection
        linear._parameters.clear()
        return quantized

    def quantize_rows(self, weight: torch.Tensor) -> torch.Tensor:
        """Quantize a [N, K] weight in row chunks (at most N / 8 rows and CHUNK_NUMEL / 4 elements).

        torchao's quantize_ makes float32 temporaries of the whole weight (measured: peak 3.4x a
        layer above the model for Float8WeightOnlyConfig). For row-wise configs (block_size
        [1, K], every inner tensor split by rows: Float8WeightOnly, Int8WeightOnly) the chunks'
        inner tensors are written into full-size buffers and the subclass is rebuilt with
        ``__tensor_unflatten__``; the result is byte-identical to quantizing the whole weight.
        Other configs are quantized whole.
        """
        n, k = weight.shape
        # torchao makes several float32 copies of what it quantizes: keep a chunk at most 1/8 of the
        # weight and at most CHUNK_NUMEL / 4 elements
        rows = max(1, min(CHUNK_NUMEL // 4 // max(1, k), -(-n // 8)))
        if n <= rows:
            return self._quantize(weight)
        first = self._quantize(weight[:rows])
        names, ctx = first.__tensor_flatten__()
        inner_first = {name: getattr(first, name) for name in names}
        row_wise = (
            isinstance(ctx, dict)
            and list(ctx.get("block_size", [])) == [1, k]
            and all(t.dim() >= 1 and t.shape[0] == rows for t in inner_first.values())
        )
        if not row_wise:
            return self._quantize(weight)
        inner = {name: t.new_empty((n, *t.shape[1:])) for name, t in inner_first.items()}
        for name, t in inner_first.items():
            inner[name][:rows].copy_(t)
        del first, inner_first
        for r0 in range(rows, n, rows):
            part = self._quantize(weight[r0 : r0 + rows])
            for name in names:
                inner[name][r0 : r0 + rows].copy_(getattr(part, name))
        return type(part).__tensor_unflatten__(inner, ctx, weight.shape, weight.stride())

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        check_finite(layer)
        quantized = self.quantize_rows(layer.weight.data)
        del layer.weight
        layer.weight = nn.Parameter(quantized, requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)
