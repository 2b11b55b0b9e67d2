"""LoRA under tensor parallelism: each adapter follows the layout of the linear it wraps.

Column-parallel base (q, k, v, gate, up: W split by output rows, input whole):
    A (r × in) replicated, B (out × r) split by rows exactly as W (kv heads shared by several
    ranks included), so each rank's B_i (A x) is its own columns of the update; no extra
    communication. A's gradient, s·Σ_i (dy_i B_i)ᵀ x, is a partial sum on each rank:
    all-reduced over tp once per backward (the same hook norm weights use under SP). The
    input gradient of the adapter path is a partial sum too; the region entry reduces it
    with that of every other reader (parallel/tensor_ops.py, `Region.finish`).
Row-parallel base (o, down: W split by input columns, x split):
    A split by columns as W, B replicated. u_i = A_i x_i is a partial sum of u = A x, so the
    adapter path all-reduces u (b·s·r values, r ≪ out: far less than reducing its output)
    before B — with SP a reduce-scatter along the sequence, as the base's output. B's gradient
    is then complete on every rank without SP (each rank sees all tokens) and a partial sum
    over sequence shards with SP (all-reduced over tp, as the row-parallel bias).

The alternative, A split with the column-parallel input side, would cut A's rows by the
input features — which a column-parallel rank holds whole — so it saves nothing there; we
keep A replicated on column layers (PEFT's tensor-parallel LoRA does the same for colwise
layers: lora_A replicated, lora_B sharded like the base).

QLoRA under tp (`quantize_parallel_base`): after sharding and loading, each rank quantises
its LOCAL weight shard (NF4 or int8, quant/linear.py) and drops the float shard, so every
NF4 block of 64 (along the shard's flattened rows) and every int8 row scale lies inside one
rank's shard and nothing quantised ever crosses the wire. The column/row-parallel linear
keeps its region logic and bias; its GEMM becomes the quantised layer's (`linear_fn`).
Quantising per shard rounds differently from quantising the whole tensor: a row-parallel
shard's NF4 blocks cover other weights (64 of its own columns, not of the whole row), its
int8 scale is the absmax of its half row, and NF4's double-quantised scalers are grouped and
centred per shard. So a tp run computes with the dequantised shards, not with the whole
tensor's single-process quantisation (docs/lora.md gives the size of that difference).
"""

from __future__ import annotations

from torch import nn

from fivefold.errors import ConfigError
from fivefold.parallel.comm import Group
from fivefold.parallel.tensor import ParamInfo, _replicated, _set, _split
from fivefold.parallel.tensor_ops import leave_region


def shard_adapter(lora: nn.Module, style: str, group: Group, sp: bool) -> None:
    """Give `lora`'s A and B their tensor-parallel layout for a base of `style` (whose
    `_tp_info` is already set)."""
    tp = group.size
    a, b = lora.lora_A.weight, lora.lora_B.weight
    if style in ("colwise", "colwise_kv"):
        w = lora.base_layer._tp_info["weight"]
        b_info = ParamInfo(tuple(b.shape), tp, 0, w.slices, w.local_size, group.rank,
                           w.replicas, w.grad_sync)
        _set(lora.lora_B, "weight", b_info, group)
        _set(lora.lora_A, "weight", _replicated(a.shape, tp, ("tp",)), group)
    elif style == "rowwise":
        _set(lora.lora_A, "weight", _split(a.shape, 1, group), group)
        _set(lora.lora_B, "weight", _replicated(b.shape, tp, ("tp",) if sp else None), group)
        lora.reduce_rank_input = _Reduce(group, sp)
    else:
        raise ValueError(f"LoRA over a tensor-parallel '{style}' layer is not supported")


class _Reduce:
    """u_i -> the sum over tp of the adapters' rank-r inputs (reduce-scatter under SP)."""

    def __init__(self, group: Group, sp: bool):
        self.group, self.sp = group, sp

    def __call__(self, u):
        return leave_region(u, self.group, self.sp)


class _QuantGemm:
    """The pluggable GEMM (x, weight, bias) -> y of a tp linear whose base is quantised:
    the float `weight` is gone (None); the quantised shard computes x W_localᵀ."""

    def __init__(self, quant: nn.Module):
        self.quant = quant

    def __call__(self, x, weight, bias):
        y = self.quant(x)
        return y if bias is None else y + bias.to(y.dtype)


def quantize_parallel_base(layer: nn.Module, kind: str, name: str) -> None:
    """Replace the float weight shard of a Column/RowParallelLinear (parallel/tensor.py) by
    its NF4 or int8 copy, registered as `layer.quant_base`; the bias stays as it was."""
    from fivefold.numerics.nf4 import NF4_BLOCK_SIZE
    from fivefold.quant.linear import Int8Linear, NF4Linear

    weight = layer.weight
    rows, cols = weight.shape
    if kind == "nf4" and weight.numel() % NF4_BLOCK_SIZE:
        raise ConfigError(f"lora.base = nf4 with parallel.tp = {layer.group.size}: the shard "
                          f"of {name} is {rows}x{cols} = {weight.numel()} weights, not a "
                          f"multiple of the NF4 block ({NF4_BLOCK_SIZE}); pick another "
                          f"parallel.tp or lora.base = int8")
    if layer.linear_fn is not None:
        raise ConfigError(f"{name}: its tensor-parallel GEMM is already replaced (FP8?), so "
                          f"lora.base = {kind} cannot quantise it; use lora.base = none")
    shard = nn.Linear(cols, rows, bias=False, device="meta")
    shard.weight = weight
    quant = {"nf4": NF4Linear, "int8": Int8Linear}[kind].from_float(shard)
    quant._full_shape = tuple(weight._full_shape)  # the logical weight, for counts
    del layer.weight
    layer.register_parameter("weight", None)
    layer.quant_base = quant
    layer.linear_fn = _QuantGemm(quant)
