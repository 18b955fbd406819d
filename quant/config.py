"""Quantization schemes: a registry from a scheme name to the methods that quantize each Linear and, where the
scheme has one, each fused-MoE layer's experts.

A scheme is registered once with :func:`register_scheme` (as torchao maps a config class to its
handler); :func:`parse_scheme` turns a user's string into the canonical scheme once, at the edge
(case-insensitive: "FP8", "fp8-Per-Channel"), and :class:`QuantConfig` carries the result.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field

from layerwise.errors import ConfigError
from layerwise.quant.base import QuantMethod, UnquantizedLinearMethod
from layerwise.quant.checkpoint_fp8 import Fp8CheckpointFormat, Fp8CheckpointLinearMethod
from layerwise.quant.fp8 import FP8_MODES, Fp8LinearMethod
from layerwise.quant.fp8_moe import Fp8MoEMethod
from layerwise.quant.moe_base import FusedMoEMethodBase, UnquantizedFusedMoEMethod

#: (argument after "name:", or None; kernel; fp8_mode; amax_reduce or None) -> a new method for one Linear layer
SchemeFactory = Callable[[str | None, str, str, Callable | None], QuantMethod]
#: (kernel, fp8_mode, amax_reduce or None) -> a new method for one fused-MoE layer's [E, N, K] experts
MoEFactory = Callable[[str, str, Callable | None], FusedMoEMethodBase]


@dataclass(frozen=True)
class _Scheme:
    name: str
    factory: SchemeFactory
    takes_argument: bool
    help: str
    moe: MoEFactory | None


_SCHEMES: dict[str, _Scheme] = {}
_ALIASES: dict[str, str] = {}


def register_scheme(
    name: str, *, aliases: tuple = (), takes_argument: bool = False, help: str = "", moe: MoEFactory | None = None
):
    """Decorator registering ``factory(argument, kernel, fp8_mode, amax_reduce) -> QuantMethod`` under ``name``.

    Args:
        name: canonical, lower-case scheme name ("fp8-per-channel").
        aliases: other accepted names ("fp8" for "fp8-per-tensor").
        takes_argument: the scheme is written "name:ARG" (torchao:<ConfigClass>).
        help: one line for ``layerwise load --help`` and error messages.
        moe: ``moe(kernel, fp8_mode, amax_reduce)`` -> the method of a fused-MoE layer's experts; None: the scheme
            cannot quantize fused experts (models with MoE layers refuse it).
    Raises:
        ValueError: the name or an alias is taken.
    """

    def decorator(factory: SchemeFactory) -> SchemeFactory:
        for n in (name, *aliases):
            if n in _ALIASES:
                raise ValueError(f"quantization scheme {n!r} is already registered")
            _ALIASES[n] = name
        _SCHEMES[name] = _Scheme(name, factory, takes_argument, help, moe)
        return factory

    return decorator


def scheme_names() -> list[str]:
    """Every accepted spelling, for help texts: "fp8", "fp8-per-tensor", ..., "torchao:<Config>"."""
    return [f"{n}:<{_SCHEMES[c].help.split()[0]}>" if _SCHEMES[c].takes_argument else n for n, c in _ALIASES.items()]


#: names other tools give a scheme (vLLM's, transformers') -> the scheme of layerwise that does the same; matched
#: exactly (a near miss such as int4 is another format, not a typo of int8)
_FOREIGN_NAMES = {
    "int8": "torchao:Int8WeightOnlyConfig",
    "fp8_e4m3": "fp8",
    "float8": "fp8",
    "e4m3": "fp8",
    "float8_e4m3fn": "fp8",
}


def unknown_scheme_message(text: str) -> str:
    """Why ``text`` is no scheme and what to write instead: the nearest accepted name (another tool's name, exactly:
    "int8" is torchao's Int8WeightOnlyConfig, "float8" / "e4m3" is fp8; otherwise difflib over the accepted names)
    and the accepted names, or for an e5m2 format that e4m3 is the only FP8 format, with the FP8 schemes."""
    head, _, argument = text.strip().partition(":")
    if "e5m2" in head.lower():
        fp8 = ", ".join(n for n in scheme_names() if n.startswith("fp8"))
        return (
            f"unknown quantization {text!r}: FP8 weights here are float8_e4m3fn (e4m3), the only FP8 format; "
            f"use one of {fp8}"
        )
    message = f"unknown quantization {text!r}; "
    key = head.lower()
    # a foreign name exactly; else a near miss of ours (0.8: fp8_per_block and torchoa, not fp4 or int4)
    near = [key] if key in _FOREIGN_NAMES else difflib.get_close_matches(key, _ALIASES, n=1, cutoff=0.8)
    if near:
        name = _FOREIGN_NAMES.get(near[0], near[0])
        if name in _SCHEMES and _SCHEMES[name].takes_argument:
            name += f":{argument or '<' + _SCHEMES[name].help.split()[0] + '>'}"
        message += f"did you mean {name!r}? "
    return message + f"choose one of: {', '.join(scheme_names())}"


def parse_scheme(text: str | None) -> tuple[str, str | None]:
    """(canonical scheme name, argument) from a user's scheme string; None means "none".

    Raises:
        ValueError: an unknown name (the message suggests the nearest one, see :func:`unknown_scheme_message`, and lists
            the accepted names), a missing or unexpected ":ARG".
    """
    if text is None:
        return "none", None
    head, sep, argument = str(text).strip().partition(":")
    canonical = _ALIASES.get(head.lower())
    if canonical is None:
        raise ValueError(unknown_scheme_message(str(text)))
    scheme = _SCHEMES[canonical]
    if scheme.takes_argument and not argument:
        raise ValueError(f"quantization {text!r} needs an argument: {canonical}:<{scheme.help.split()[0]}>")
    if not scheme.takes_argument and sep:
        raise ValueError(f"quantization {canonical!r} takes no ':{argument}'")
    return canonical, (argument or None)


@register_scheme(
    "fp8-per-tensor",
    aliases=("fp8",),
    help="float8_e4m3fn weights, one float32 scale per tensor",
    moe=lambda kernel, fp8_mode, amax_reduce: Fp8MoEMethod("tensor", kernel, fp8_mode, amax_reduce),
)
def _fp8_per_tensor(argument, kernel, fp8_mode, amax_reduce):
    return Fp8LinearMethod("tensor", kernel, fp8_mode, amax_reduce)


@register_scheme(
    "fp8-per-channel",
    help="float8_e4m3fn weights, one scale per output row",
    moe=lambda kernel, fp8_mode, amax_reduce: Fp8MoEMethod("channel", kernel, fp8_mode, amax_reduce),
)
def _fp8_per_channel(argument, kernel, fp8_mode, amax_reduce):
    return Fp8LinearMethod("channel", kernel, fp8_mode, amax_reduce)


@register_scheme(
    "fp8-per-block",
    help="float8_e4m3fn weights, one scale per 128 x 128 block",
    moe=lambda kernel, fp8_mode, amax_reduce: Fp8MoEMethod("block", kernel, fp8_mode, amax_reduce),
)
def _fp8_per_block(argument, kernel, fp8_mode, amax_reduce):
    return Fp8LinearMethod("block", kernel, fp8_mode, amax_reduce)


@register_scheme("torchao", takes_argument=True, help="Config class of torchao.quantization, applied per layer")
def _torchao(argument, kernel, fp8_mode, amax_reduce):
    from layerwise.quant.torchao import TorchaoLinearMethod

    return TorchaoLinearMethod(argument)


@register_scheme(
    "none",
    help="the checkpoint dtype (or dtype=), F.linear",
    moe=lambda kernel, fp8_mode, amax_reduce: UnquantizedFusedMoEMethod(),
)
def _none(argument, kernel, fp8_mode, amax_reduce):
    return UnquantizedLinearMethod()


@dataclass(frozen=True)
class QuantConfig:
    """Which method quantizes which layer, parsed once from a scheme string.

    Args:
        quantization: "fp8" (= "fp8-per-tensor"), "fp8-per-channel", "fp8-per-block",
            "torchao:<ConfigName>" (a torchao.quantization config class), "none" or None;
            case-insensitive except the torchao class name.
        kernel: "torch" or "triton" (already resolved for the target device).
        fp8_mode: "auto", "w8a8" or "w8a16" (see :class:`layerwise.quant.fp8.Fp8LinearMethod`).
        amax_reduce: under tensor parallelism with global scales, the in-place max-reduction of a float32
            amax over the group, given to FP8 per-tensor methods (None: each rank's local amax).
        checkpoint_format: the layout of a pre-quantized FP8 checkpoint (None: the checkpoint's linear weights are
            unquantized). Its linears then load through :class:`Fp8CheckpointLinearMethod` into the scheme's method.
    Only decoder Linear layers are quantized; embeddings, norms and lm_head keep the checkpoint dtype.
    Raises:
        ValueError: unknown scheme or fp8_mode; a torchao config that does not exist.
        MissingDependencyError: a torchao scheme without torchao installed.
    """

    quantization: str | None = "none"
    kernel: str = "torch"
    fp8_mode: str = "auto"
    amax_reduce: Callable | None = field(default=None, compare=False, repr=False)
    checkpoint_format: Fp8CheckpointFormat | None = None
    scheme: str = field(init=False)  # canonical: "fp8-per-tensor", "torchao:Float8WeightOnlyConfig", "none"
    _argument: str | None = field(init=False, repr=False)
    _entry: _Scheme = field(init=False, repr=False, compare=False)  # the registered scheme, looked up once

    def __post_init__(self):
        name, argument = parse_scheme(self.quantization)
        if self.fp8_mode not in FP8_MODES:
            raise ValueError(f"unknown fp8_mode {self.fp8_mode!r}; choose one of {FP8_MODES}")
        # built once now: an unknown torchao config fails here, not at the first layer, and the
        # method's name is the canonical spelling ("torchao:Float8WeightOnlyConfig")
        method = _SCHEMES[name].factory(argument, self.kernel, self.fp8_mode, self.amax_reduce)
        object.__setattr__(self, "scheme", method.name)
        object.__setattr__(self, "_argument", method.name.partition(":")[2] or None)
        object.__setattr__(self, "_entry", _SCHEMES[name])

    def get_linear_method(self, prefix: str) -> QuantMethod:
        """A new method for the Linear layer at ``prefix`` (e.g. "model.layers.0.mlp.down_proj"); for a linear the FP8
        checkpoint stores in FP8, one that reads its FP8 weight and scale first.

        Raises:
            ConfigError: the FP8 checkpoint lists only some of a fused layer's modules as unquantized.
        """
        method = self._entry.factory(self._argument, self.kernel, self.fp8_mode, self.amax_reduce)
        fmt = self.checkpoint_format
        if fmt is None or fmt.is_ignored(prefix):
            return method
        return Fp8CheckpointLinearMethod(fmt, method)

    def get_moe_method(self, prefix: str) -> FusedMoEMethodBase:
        """A new method for the experts of the fused-MoE layer at ``prefix`` (e.g. "model.layers.0.mlp.experts").

        Raises:
            ValueError: the scheme has no MoE method (torchao configs); the message lists the schemes that do.
            ConfigError: the checkpoint stores these experts in FP8 (not read yet; raised while the model is built).
        """
        fmt = self.checkpoint_format
        if fmt is not None and not fmt.is_ignored(prefix):
            raise ConfigError(
                f"config.json quantization_config: {prefix} holds FP8 experts ({fmt.describe()}); layerwise reads FP8 "
                f"checkpoints of dense models only so far: load the model's BF16 checkpoint (quantization= "
                f"quantizes its experts on the fly)"
            )
        moe = self._entry.moe
        if moe is None:
            supported = ", ".join(n for n, s in _SCHEMES.items() if s.moe is not None)
            raise ValueError(
                f"quantization {self.scheme!r} is not supported for mixture-of-experts layers ({prefix}: torchao "
                f"configs quantize nn.Linear weights, not fused [E, N, K] experts); use one of {supported}"
            )
        return moe(self.kernel, self.fp8_mode, self.amax_reduce)
