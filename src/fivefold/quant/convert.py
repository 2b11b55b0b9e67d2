"""Swap a model's linear layers for quantised ones: `quantize_(model, method, filter_fn)`.

Every `nn.Linear` is quantised by default except the output head (`lm_head`); the token
embedding is an `nn.Embedding` and stays float too. Keeping both in full precision is the
common default of weight-only schemes (AWQ, GPTQ and bitsandbytes leave them in fp16): they
are a small share of a large model's weights and the most sensitive to error. A MoE's
stacked expert weights are not `nn.Linear` and also stay float here.

`method` is one of METHODS: int8, int4 (round to nearest, RTN), nf4, mxfp4. AWQ is int4 after
`quant.awq.apply_awq` has rescaled (and clipped) the float weights; the swap itself is the
same. The model's function is the float one with each linear's weight replaced by its
dequantised copy (tests/test_quant_convert.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from torch import nn

from fivefold.numerics import intx, mx
from fivefold.quant.linear import Int4Linear, Int8Linear, MXFP4Linear, NF4Linear, QuantLinear

METHODS = ("int8", "int4", "awq", "nf4", "mxfp4")


@dataclass
class QuantSpec:
    """What `fivefold quantize` applied: the method, its options and which linears."""

    method: str
    group_size: int = intx.DEFAULT_GROUP_SIZE
    symmetric: bool = False
    include_head: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def default_filter(include_head: bool = False) -> Callable[[str, nn.Module], bool]:
    """Every nn.Linear, the head (`lm_head`) only when asked."""

    def keep(name: str, module: nn.Module) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        return include_head or name.split(".")[-1] != "lm_head"

    return keep


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown quantisation method '{method}'; one of "
                         f"{', '.join(METHODS)}")


def quantizable(model: nn.Module, filter_fn: Callable[[str, nn.Module], bool]) -> dict:
    """{name: nn.Linear} that `filter_fn` selects."""
    return {name: m for name, m in model.named_modules() if filter_fn(name, m)}


def check_shapes(model: nn.Module, spec: QuantSpec,
                 filter_fn: Callable[[str, nn.Module], bool] | None = None) -> None:
    """Raise ValueError naming the first linear whose input dimension the method's group
    or block does not divide (before anything is changed)."""
    filter_fn = filter_fn or default_filter(spec.include_head)
    for name, linear in quantizable(model, filter_fn).items():
        try:
            if spec.method in ("int4", "awq"):
                intx.check_group_size(linear.in_features, spec.group_size)
            elif spec.method == "mxfp4":
                mx.check_block_size(linear.in_features, mx.MX_BLOCK_SIZE)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None


def make_layer(linear: nn.Linear, spec: QuantSpec) -> QuantLinear:
    if spec.method == "int8":
        return Int8Linear.from_float(linear)
    if spec.method in ("int4", "awq"):
        return Int4Linear.from_float(linear, spec.group_size, spec.symmetric)
    if spec.method == "nf4":
        return NF4Linear.from_float(linear)
    if spec.method == "mxfp4":
        return MXFP4Linear.from_float(linear)
    check_method(spec.method)
    raise AssertionError(spec.method)


def empty_layer(in_features: int, out_features: int, bias: bool, spec: QuantSpec
                ) -> QuantLinear:
    """A zero layer of the right buffer shapes, for loading a quantised state dict."""
    if spec.method == "int8":
        return Int8Linear(in_features, out_features, bias)
    if spec.method in ("int4", "awq"):
        return Int4Linear(in_features, out_features, bias, spec.group_size, spec.symmetric)
    if spec.method == "nf4":
        return NF4Linear(in_features, out_features, bias)
    if spec.method == "mxfp4":
        return MXFP4Linear(in_features, out_features, bias)
    check_method(spec.method)
    raise AssertionError(spec.method)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def quantize_(model: nn.Module, method: str | QuantSpec,
              filter_fn: Callable[[str, nn.Module], bool] | None = None) -> list[str]:
    """Replace, in place, every linear `filter_fn(name, module)` selects (default: all but
    the head) by its quantised copy; returns the names replaced. The float weights are
    dropped with the old modules."""
    spec = method if isinstance(method, QuantSpec) else QuantSpec(method)
    check_method(spec.method)
    filter_fn = filter_fn or default_filter(spec.include_head)
    check_shapes(model, spec, filter_fn)
    targets = quantizable(model, filter_fn)
    for name, linear in targets.items():
        _replace(model, name, make_layer(linear, spec))
    return list(targets)


def quantize_structure_(model: nn.Module, spec: QuantSpec, names: list[str]) -> None:
    """Put empty quantised layers at `names` (a saved checkpoint's list), ready for
    `load_state_dict`: the inverse of quantize_ for loading."""
    for name in names:
        linear = model.get_submodule(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is {type(linear).__name__}, not a linear layer")
        _replace(model, name, empty_layer(linear.in_features, linear.out_features,
                                          linear.bias is not None, spec))
