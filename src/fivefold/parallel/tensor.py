"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism
(Korthikanti et al. 2022), applied to the plain model by a plan: module name -> style.

    model = build_meta(cfg)
    apply_tensor_parallel(model, dims, sp=True)     # shards shapes, swaps layers, hooks
    materialize(model, cfg, seed)                   # draws each full tensor, keeps its slice

Attention: q/k/v are column-parallel by heads, o_proj row-parallel; the MLP: gate/up
column-parallel, down row-parallel; so each block has two regions and, per micro-batch,
two all-reduces forward and two backward (with SP: all-gathers and reduce-scatters of the
same bytes; see tensor_ops). The embedding and the head split the vocabulary (padded up to
a multiple of tp; padding rows are zero and masked out of the logits' loss), and the loss
reduces per-token scalars instead of gathering the logits (and runs the head in chunks of
tokens, so even the local logits never exist whole). Tied embeddings share the one sharded
weight. `model.logits(h)` returns the local (b, s, V_pad/tp) logits.

Parameter metadata (set on every parameter, and put back whenever `.to()`/`to_empty()`
replaces the Parameter objects, because the module that owns a parameter keeps it):

    _full_shape     the logical (unpadded, unsplit) shape
    _shard_fn       full logical tensor -> this rank's local tensor (with padding)
    _tp_slice       None: the whole logical tensor; or (dim, start, stop): the local tensor
                    holds logical [start, stop) along dim; local entries past stop - start
                    along dim are padding (zeros; the vocabulary rows only)
    _tp_sharded     True when tp ranks hold different data (sum the norm across tp),
                    False when every tp rank holds the same tensor
    _tp_replicas    how many tp ranks hold this same local tensor: 1 for a disjoint shard,
                    tp // num_kv_heads for kv projections when num_kv_heads < tp, tp for a
                    replicated tensor
    _tp_info        the ParamInfo behind all of these (slices of every rank, gradient sync)

The global gradient norm follows one rule for every parameter:

    norm^2 = all_reduce_sum over tp of  sum_p ||grad_p||^2 / p._tp_replicas

(`tp_grad_norm`), so shards add up, replicated kv heads count once per distinct head and
replicated tensors once. Padding rows have zero gradients and add nothing.

Gradients are complete when autograd hands them over: parameters whose local gradient is
only a partial sum get a gradient hook that finishes the sum, once per backward (so per
micro-batch, correct under gradient accumulation, before any DP hook sees the gradient):
  - with SP, norm weights (and row-parallel biases) act on this rank's tokens only: their
    gradient is all-reduced over tp (Korthikanti et al. 2022 section 4.2.2; Megatron does
    this once per step in finalize_model_grads, which would tie this module to the
    trainer). Extra bytes per micro-batch: 4·h per norm weight (fp32), 2L+1 norms for a
    Llama, against 8·b·s·h·4 per layer for the activations.
  - kv heads shared by tp // kv ranks: each rank's gradient covers its own query heads
    only; they are summed over the sharing ranks (`tensor_ops.sum_grad_over_replicas`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from fivefold.config import ConfigError
from fivefold.models.loss import chunked_linear_cross_entropy, cross_entropy_sum
from fivefold.models.moe import MoE
from fivefold.parallel import comm
from fivefold.parallel.comm import Group
from fivefold.parallel.tensor_ops import (
    column_linear,
    enter_region,
    leave_region,
    sum_grad_over_replicas,
    sum_grad_over_tp,
)


@dataclass
class ParamInfo:
    """How one parameter's local tensor relates to its logical tensor."""

    full_shape: tuple[int, ...]
    tp: int
    dim: int | None = None  # None: replicated whole
    slices: list[tuple[int, int]] = field(default_factory=list)  # (start, stop) per tp rank
    local_size: int = 0  # along dim, padding included
    rank: int = 0
    replicas: int = 1
    grad_sync: tuple | None = None  # None | ("tp",) | ("replicas", slot, slots)

    @property
    def slice(self) -> tuple[int, int, int] | None:
        return None if self.dim is None else (self.dim, *self.slices[self.rank])

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.dim is not None:
            shape[self.dim] = self.local_size
        return tuple(shape)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """The local tensor of this rank from the full logical one (padding zero)."""
        if self.dim is None:
            return full.clone()
        start, stop = self.slices[self.rank]
        piece = full.narrow(self.dim, start, stop - start)
        out = full.new_zeros(self.local_shape)
        out.narrow(self.dim, 0, stop - start).copy_(piece)
        return out


def _replicated(shape, tp: int, grad_sync=None) -> ParamInfo:
    return ParamInfo(tuple(shape), tp, replicas=tp, grad_sync=grad_sync)


def _split(shape, dim: int, group: Group) -> ParamInfo:
    """Even split along dim, padded up to a multiple of tp (the last ranks' extra rows)."""
    size = shape[dim]
    local = -(-shape[dim] // group.size)
    slices = [(min(r * local, size), min((r + 1) * local, size)) for r in range(group.size)]
    return ParamInfo(tuple(shape), group.size, dim, slices, local, group.rank)


class TPParams:
    """Keeps `_tp_info` on the owning module and re-tags the parameters after `_apply`.

    `Module.to_empty` (used by `materialize`) creates new Parameter objects, dropping any
    attribute set on the old ones; the owning module survives, so it puts them back. For
    modules of the plain model (norms), the class is swapped for a subclass with this mixin,
    as FSDP2's `fully_shard` does.
    """

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        tag_params(self)
        return out


_SWAPPED: dict[type, type] = {}


def _own(module: nn.Module) -> nn.Module:
    cls = type(module)
    if not issubclass(cls, TPParams):
        if cls not in _SWAPPED:
            _SWAPPED[cls] = type(f"TP{cls.__name__}", (TPParams, cls), {})
        module.__class__ = _SWAPPED[cls]
    if "_tp_info" not in module.__dict__:
        module._tp_info = {}
    return module


def tag_params(module: nn.Module) -> None:
    for name, info in module.__dict__.get("_tp_info", {}).items():
        p = module._parameters.get(name)
        if p is None:
            continue
        p._tp_info, p._full_shape, p._shard_fn = info, info.full_shape, info.shard
        p._tp_slice, p._tp_replicas = info.slice, info.replicas
        p._tp_sharded = info.replicas < info.tp
        if info.grad_sync and p.requires_grad and not getattr(p, "_tp_hooked", False):
            p.register_hook(_grad_hook(info, module._tp_group))
            p._tp_hooked = True


def _grad_hook(info: ParamInfo, group: Group):
    if info.grad_sync[0] == "tp":
        return lambda grad: sum_grad_over_tp(grad, group)
    _, slot, slots = info.grad_sync
    return lambda grad: sum_grad_over_replicas(grad, group, slot, slots, info.dim)


def _set(module: nn.Module, name: str, info: ParamInfo, group: Group) -> None:
    """Give module.name the local shape of `info` (sharding real values, or on meta)."""
    _own(module)
    module._tp_group = group
    old = module._parameters[name]
    if old.is_meta:
        new = torch.empty(info.local_shape, dtype=old.dtype, device="meta")
    else:
        new = info.shard(old.detach()) if tuple(old.shape) == info.full_shape else old.detach()
    module._parameters[name] = nn.Parameter(new, requires_grad=old.requires_grad)
    module._tp_info[name] = info
    tag_params(module)


class ColumnParallelLinear(TPParams, nn.Module):
    """y_i = x W_i^T + b_i: rows of W (output features) split over tp; the input is whole.

    Reading a prepared region's input, the input-gradient reduction overlaps the weight
    gradient (tensor_ops); alone, it enters a region of its own.
    """

    def __init__(self, linear: nn.Linear, group: Group, sp: bool, weight: ParamInfo,
                 bias: ParamInfo | None, save_shard: bool = False):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.group, self.sp, self.save_shard = group, sp, save_shard
        _set(self, "weight", weight, group)
        if bias is not None:
            _set(self, "bias", bias, group)

    # A pluggable GEMM (x, weight, bias) -> y for this rank's shard, e.g. FP8 (lowp/). It
    # does not join the region's overlapped reduction: the region entry reduces its input
    # gradient as that of any other reader.
    linear_fn = None

    def forward(self, x):
        if self.linear_fn is not None:
            if getattr(x, "_tp_region", None) is None:
                x = enter_region(x, self.group, self.sp)
            return self.linear_fn(x, self.weight, self.bias)
        return column_linear(x, self.weight, self.bias, self.group, self.sp, self.save_shard)


class RowParallelLinear(TPParams, nn.Module):
    """y = sum_i x_i W_i^T + b: columns of W (input features) split; partial sums reduced
    (all-reduce, or with SP a reduce-scatter along the sequence), then the bias added once."""

    def __init__(self, linear: nn.Linear, group: Group, sp: bool):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.group, self.sp = group, sp
        _set(self, "weight", _split(linear.weight.shape, 1, group), group)
        if self.bias is not None:
            _set(self, "bias", _replicated(self.bias.shape, group.size,
                                           ("tp",) if sp else None), group)

    linear_fn = None  # a pluggable GEMM (x, weight, bias) -> y, e.g. FP8 (lowp/)

    def forward(self, x):
        y = leave_region((self.linear_fn or F.linear)(x, self.weight, None), self.group,
                         self.sp)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(TPParams, nn.Module):
    """Each rank looks up the tokens of its vocabulary rows; the others give zeros, and the
    sum over tp (or with SP, its reduce-scatter along the sequence) completes every row."""

    def __init__(self, embedding: nn.Embedding, group: Group, sp: bool):
        super().__init__()
        self.weight = embedding.weight
        self.group, self.sp = group, sp
        info = _vocab_info(embedding.weight.shape, group)
        self.vocab_start, stop = info.slices[group.rank]
        self.num_valid = stop - self.vocab_start
        _set(self, "weight", info, group)

    def forward(self, tokens):
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.num_valid)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight)
        return leave_region(rows.masked_fill(outside.unsqueeze(-1), 0.0), self.group, self.sp)


class VocabParallelCrossEntropy(nn.Module):
    """Replaces `CrossEntropySum`: the summed fp32 loss from this rank's vocabulary rows of
    the head, in chunks of tokens (models/loss.py); only per-token maxima and sums cross
    the wire. The head's input gradient is a partial sum here; the head's column region
    (entered by the final norm's hook) all-reduces it in backward."""

    def __init__(self, group: Group, vocab_start: int, num_valid: int):
        super().__init__()
        self.group, self.vocab_start, self.num_valid = group, vocab_start, num_valid

    def _all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.group, op="max")
        return t

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, self.group)
        return t

    def forward(self, hidden, weight, targets):
        return chunked_linear_cross_entropy(hidden, weight, targets, self.vocab_start,
                                            self.num_valid, self._all_reduce_max,
                                            self._all_reduce_sum)

    def from_logits(self, logits, targets):
        return cross_entropy_sum(logits, targets, self.vocab_start, self.num_valid,
                                 self._all_reduce_max, self._all_reduce_sum)


def _vocab_info(shape, group: Group) -> ParamInfo:
    vocab, tp = shape[0], group.size
    info = _split(shape, 0, group)
    if info.slices[-1][0] >= vocab:
        raise ConfigError(f"model.vocab_size = {vocab} is too small for parallel.tp = {tp}: "
                          f"some rank would hold only padding rows; lower tp")
    return info


def _kv_info(shape, group: Group, num_kv_heads: int, head_dim: int) -> ParamInfo:
    """kv projections split by heads; with fewer heads than tp, each rank holds the head its
    query heads read (query head j reads kv head j // (heads / kv_heads), so rank r's heads
    all read kv head r // (tp / kv_heads))."""
    tp = group.size
    if num_kv_heads >= tp:
        return _split(shape, 0, group)
    replicas = tp // num_kv_heads
    slices = [((r // replicas) * head_dim, (r // replicas + 1) * head_dim) for r in range(tp)]
    return ParamInfo(tuple(shape), tp, 0, slices, head_dim, group.rank, replicas,
                     ("replicas", group.rank // replicas, num_kv_heads))


def llama_plan() -> dict[str, str]:
    """The tensor-parallel plan of `models.llama.Llama`: module-name pattern -> style."""
    return {
        "embed_tokens": "vocab_embedding",
        "layers.*.input_layernorm": "sequence_norm",
        "layers.*.self_attn": "attention",
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise_kv",
        "layers.*.self_attn.v_proj": "colwise_kv",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.self_attn.q_norm": "head_norm",
        "layers.*.self_attn.k_norm": "head_norm",
        "layers.*.post_attention_layernorm": "sequence_norm",
        "layers.*.mlp": "region",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "norm": "head_input",
        "lm_head": "vocab_head",
        "loss_fn": "vocab_loss",
    }


def _pattern(p: str) -> re.Pattern:
    return re.compile("^" + re.escape(p).replace(r"\*", r"[^.]+") + "$")


def apply_tensor_parallel(model: nn.Module, dims, sp: bool,
                          plan: dict[str, str] | None = None,
                          sp_saved_input: str = "full") -> nn.Module:
    """Shard `model` (meta-built or materialized) over dims["tp"] in place; returns it.

    sp_saved_input: what a column-parallel linear keeps for its weight gradient under SP,
    "full" (the gathered input) or "shard" (this rank's sequence shard, gathered again in
    backward; tensor_ops)."""
    if sp_saved_input not in ("full", "shard"):
        raise ConfigError(f"parallel.sp_saved_input = '{sp_saved_input}' is not one of "
                          f"full, shard")
    shard = sp and sp_saved_input == "shard"
    group: Group = dims["tp"]
    cfg, tp = model.cfg, group.size
    if sp and tp == 1:
        raise ConfigError("parallel.sp = true needs parallel.tp > 1; set parallel.tp or sp=false")
    for what, size in (("num_heads", cfg.num_heads), ("intermediate_size",
                                                      cfg.intermediate_size)):
        if size % tp:
            raise ConfigError(f"parallel.tp = {tp} does not divide model.{what} = {size}; "
                              f"pick a tp that divides it")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise ConfigError(f"parallel.tp = {tp} and model.num_kv_heads = {cfg.num_kv_heads}: "
                          f"one must divide the other")
    if tp > 1:
        compiled = [(_pattern(k), v) for k, v in (plan or llama_plan()).items()]
        for name, module in list(model.named_modules()):
            style = next((s for pat, s in compiled if pat.match(name)), None)
            if style is not None:
                _apply_style(model, name, module, style, group, sp, shard)
    for module in model.modules():  # everything else is replicated (identical grads)
        for pname, p in module.named_parameters(recurse=False):
            if not hasattr(p, "_tp_info"):
                _set(module, pname, _replicated(p.shape, tp), group)
    return model


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def _apply_style(model, name: str, module: nn.Module, style: str, group: Group, sp: bool,
                 shard: bool = False):
    cfg = model.cfg
    wrapped = getattr(module, "base_layer", None)
    if wrapped is not None and hasattr(module, "shard_for_tensor_parallel"):
        # An adapter around the linear (finetune/lora.py): the style shards the wrapped
        # linear, then the adapter lays out its own factors to match.
        _apply_style(model, f"{name}.base_layer", wrapped, style, group, sp, shard)
        module.shard_for_tensor_parallel(style, group, sp)
        return
    if style in ("colwise", "vocab_head"):
        w = module.weight.shape
        weight = _vocab_info(w, group) if style == "vocab_head" else _split(w, 0, group)
        bias = None if module.bias is None else ParamInfo(
            tuple(module.bias.shape), group.size, 0, weight.slices, weight.local_size, group.rank)
        _replace(model, name, ColumnParallelLinear(module, group, sp, weight, bias, shard))
    elif style == "colwise_kv":
        weight = _kv_info(module.weight.shape, group, cfg.num_kv_heads, cfg.dim_per_head)
        bias = None if module.bias is None else _kv_info(
            module.bias.shape, group, cfg.num_kv_heads, cfg.dim_per_head)
        _replace(model, name, ColumnParallelLinear(module, group, sp, weight, bias, shard))
    elif style == "rowwise":
        _replace(model, name, RowParallelLinear(module, group, sp))
    elif style == "vocab_embedding":
        _replace(model, name, VocabParallelEmbedding(module, group, sp))
    elif style == "vocab_loss":
        start, stop = _vocab_info((cfg.vocab_size, cfg.hidden_size), group).slices[group.rank]
        _replace(model, name, VocabParallelCrossEntropy(group, start, stop - start))
    elif style == "head_norm":  # one weight shared by every head: tp ranks hold other heads
        for pname, p in module.named_parameters(recurse=False):
            _set(module, pname, _replicated(p.shape, group.size, ("tp",)), group)
    elif style in ("sequence_norm", "head_input"):
        for pname, p in module.named_parameters(recurse=False):
            _set(module, pname, _replicated(p.shape, group.size, ("tp",) if sp else None), group)
        if style == "head_input":  # the norm's output enters the head's column region
            module.register_forward_hook(lambda m, args, out: enter_region(out, group, sp))
    elif style == "region" and isinstance(module, MoE):
        return  # experts replicated over tp: each rank runs them whole, no region to enter
    elif style in ("attention", "region"):
        if style == "attention":
            module.num_heads = cfg.num_heads // group.size
            module.num_kv_heads = max(cfg.num_kv_heads // group.size, 1)
        module.register_forward_pre_hook(
            lambda m, args: (enter_region(args[0], group, sp, shard), *args[1:]))
    else:
        raise ValueError(f"unknown tensor-parallel style '{style}' for module '{name}'")


def tp_grad_norm(params: Iterable[nn.Parameter], group: Group) -> torch.Tensor:
    """The global fp32 gradient norm over tp, counting each distinct value once."""
    total = torch.zeros((), dtype=torch.float32)
    for p in params:
        if p.grad is not None:
            total = total + p.grad.float().pow(2).sum() / getattr(p, "_tp_replicas", 1)
    comm.all_reduce(total, group)
    return total.sqrt()


def _gather(local: torch.Tensor, info: ParamInfo, group: Group) -> torch.Tensor:
    if info.dim is None:
        return local.detach().clone()
    pieces = torch.empty(group.size * local.numel(), dtype=local.dtype, device=local.device)
    comm.all_gather(pieces, local.detach().contiguous().view(-1), group)
    pieces = pieces.view(group.size, *local.shape)
    full = local.new_empty(info.full_shape)
    for r, (start, stop) in enumerate(info.slices):
        full.narrow(info.dim, start, stop - start).copy_(
            pieces[r].narrow(info.dim, 0, stop - start))
    return full


def gather_full_state(model: nn.Module, dims, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) as the full logical tensor, on every tp rank.

    A collective: all tp ranks must call it. Parameters without a gradient are skipped
    when `grads` is set (the same ones on every rank).
    """
    group: Group = dims["tp"]
    out = {}
    for name, p in model.named_parameters():
        tensor = p.grad if grads else p
        if tensor is not None:
            out[name] = _gather(tensor, p._tp_info, group)
    return out


def load_tp_state(model: nn.Module, named_full_tensors) -> tuple[list[str], list[str]]:
    """Copy full logical tensors (a dict or (name, tensor) pairs) into the local shards.

    Returns (missing, unexpected) parameter names, as `load_state_dict` does.
    """
    params = dict(model.named_parameters())
    items = named_full_tensors.items() if isinstance(named_full_tensors, dict) else (
        named_full_tensors)
    seen, unexpected = set(), []
    with torch.no_grad():
        for name, full in items:
            p = params.get(name)
            if p is None:
                unexpected.append(name)
                continue
            if tuple(full.shape) != tuple(p._full_shape):
                raise ValueError(f"{name}: got shape {tuple(full.shape)}, the model's logical "
                                 f"shape is {tuple(p._full_shape)}")
            p.copy_(p._shard_fn(full.to(device=p.device)).to(p.dtype))
            seen.add(name)
    return [n for n in params if n not in seen], unexpected
