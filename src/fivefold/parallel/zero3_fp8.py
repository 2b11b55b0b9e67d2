"""ZeRO-3's all-gather of FP8 weights in FP8 (parallel.fp8_allgather, tensorwise): the FP8
linears' and the routed experts'.

torchao's float8 training for FSDP2 casts each rank's shard of a float8 linear's weight to
FP8 before the all-gather, with the tensorwise scale of the whole weight, so the gather
moves 1 byte per element instead of 2 (bf16), and the GEMM takes the gathered FP8 weight
as it is (torchao `float8/fsdp_utils.py`: `WeightWithDynamicFloat8CastTensor`, and
`precompute_float8_dynamic_scale_for_fsdp`, which computes every weight's scale after the
optimizer step in one all-reduce). Here:

    1. scales, once per step (`refresh_scales`): each rank takes the amax of its piece of
       every such weight of every unit, and ONE all_reduce(max) of all those amaxes gives
       every weight's amax, so its scale (numerics.scaling.amax_to_scale) is the one the
       tensorwise cast of the whole weight computes. The cast is elementwise, so each
       rank's bytes are exactly the bytes of that cast (bit-equal to quantising the
       gathered bf16 weight). The gatherer refreshes them at the first FP8 gather after the
       weights changed (construction, an optimizer step, a checkpoint load) or a step began;
    2. a unit's gather (`start`) casts the rank's pieces of those weights to e4m3 and sends
       one uint8 message: the unit's other elements (norms, padding) as raw bytes of their
       dtype, then the codes, padded to the longest rank's message (a unit's shard cuts
       fall anywhere in its weights, so the ranks' counts differ), asynchronously like a
       bf16 unit's gather: the next unit's FP8 gather overlaps this unit's compute;
    3. `finish` (when the unit is needed) puts the FP8 bytes in a per-unit byte buffer (freed
       with the unit, like the bf16 one); each weight's module gets `fp8_weight` (data a
       view of that buffer, scale the weight's) that its FP8 GEMMs use instead of
       quantising the weight (lowp/linear.py). The weight's bf16 view is filled with the
       dequantised values, so the parameter holds what the GEMM uses.

The cast (2) and the unpack (3) are one fused kernel each on a GPU (and on meta, a trace of
one), over all of the unit's pieces: B + 1 bytes of HBM traffic per shard element and
2 + B per gathered element, against the eager torch ops' B + 28 and 19 + 3B, which the CPU
runs (numerics/fp8_gather.py; the same bytes either way).

Delayed scaling (train.fp8_scaling = delayed, lowp/delayed.py): the scale a weight's cast
takes is its history's (fmt.max / max of its W row), known to every rank, so once every
gathered weight's row holds a record `refresh_scales` needs no all-reduce: the gather casts
with the history's multiplier, the bytes the linear's own delayed cast of the whole weight
writes. Each rank's amax of its piece of W goes with the gathered weight (`GatheredWeight.
record`) and the linear folds it into its pending W record (lowp/delayed.py
`record_gathered`); the step's one all_reduce(max) of every record (`end_step`, over the
pipeline stage's ranks: the mesh's `stage` group) makes it the whole weight's amax, the
record the linear folds without the gather.
On a step where a weight's row has no record yet (the first), its scale is its own amax,
as delayed scaling's first step is dynamic: the one all-reduce of amaxes above gives it.
The input gradient's Wᵀ is the gathered codes transposed, as under dynamic scaling.

Routed experts (lowp/experts.py; tensorwise runs the per-expert loop): each expert's (N, K)
slice of a stacked (E, N, K) weight is a weight of its own here, with its own amax in the
one all-reduce and its own scale, the tensorwise cast the loop's FP8 linear makes of it;
`finish` hands the module `fp8_experts` ({"w_gate": [one GatheredWeight per expert], ...}),
whose codes the loop's GEMMs take. Under expert parallelism the experts' weights live in
the expert-data-parallel group's own ZeRO-3 (parallel/expert_optim.py), whose gatherer does
the same over edp. Under delayed scaling each expert's weight casts with its own history
(lowp/delayed.py `expert_state`), the first step with the all-reduced amax, as a linear's;
its piece's amax goes with it as the expert's W record. An expert that meets no token on a
rank folds that record too, with no flag (lowp/experts.py `_fold_gathered`), so the step's
reduction holds the whole weight's amax wherever any rank recorded it.

Only tensorwise: one scale per weight makes a shard's cast independent of where the shard
cuts the weight. Rowwise scales the weight along K for the forward GEMM and along N for
the input gradient's (lowp/linear.py), so each gather would need its own per-row or
per-column amaxes and the linear two FP8 copies of its weight; torchao, too, gathers FP8
for tensorwise only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivefold.lowp import delayed
from fivefold.lowp.experts import FP8ExpertsMixin
from fivefold.lowp.linear import FP8LinearFn, FP8LinearMixin, fp8_linear
from fivefold.numerics import fp8_gather
from fivefold.numerics.formats import E4M3
from fivefold.numerics.fp8 import FP8Tensor
from fivefold.numerics.scaling import amax_to_scale, tensor_amax
from fivefold.parallel import comm

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")  # a routed-experts module's stacked weights
FUSED_ON_DEVICE = True  # the fused pack and unpack on a GPU (and on meta, a trace of one)


def fused(t: torch.Tensor) -> bool:
    """Whether a gather of tensors on t's device takes the fused kernels (the CPU: eager)."""
    return FUSED_ON_DEVICE and t.device.type != "cpu"


def mark_fp8_gather(model: torch.nn.Module) -> int:
    """Mark the FP8 linears and FP8 routed experts whose weights ZeRO-3 gathers in FP8
    (`fp8_gather`); returns how many modules. A tensor-parallel linear (parallel/tensor.py)
    runs FP8 through its pluggable GEMM (lowp's FP8LinearFn), which gets a wrapper passing
    the gathered weight along. Routed experts (tensorwise: the per-expert loop of
    lowp/experts.py) take each expert's gathered weight from `fp8_experts`."""
    count = 0
    for module in model.modules():
        fn = getattr(module, "linear_fn", None)
        if isinstance(module, (FP8LinearMixin, FP8ExpertsMixin)):
            module.fp8_gather = True
        elif isinstance(fn, FP8LinearFn):
            module.linear_fn = _GatheredWeightFn(module, fn.recipe)
            module.fp8_gather = True
        else:
            continue
        count += 1
    return count


def gathered_params(module: torch.nn.Module) -> list[tuple[str, torch.Tensor, int]]:
    """(attribute, parameter, weights in it) of a module marked `fp8_gather`: a linear's
    weight (one), or a routed-experts module's three stacked (E, N, K) weights, E each: one
    tensorwise scale per expert's weight, as the loop's FP8 linear of each expert casts it."""
    if isinstance(module, FP8ExpertsMixin):
        return [(name, getattr(module, name), getattr(module, name).shape[0])
                for name in EXPERT_WEIGHTS]
    return [("weight", module.weight, 1)]


@dataclass
class GatheredWeight(FP8Tensor):
    """A weight gathered in FP8, and the amax of this rank's piece of it (0 where it holds
    none, NaN as inf): delayed scaling's W record (lowp/delayed.py `record_gathered`)."""

    record: torch.Tensor | None = None


class _GatheredWeightFn:
    """A tensor-parallel linear's FP8 GEMM that takes its module's gathered FP8 weight."""

    def __init__(self, module: torch.nn.Module, recipe):
        self.module, self.recipe = module, recipe

    def __call__(self, x, weight, bias=None):
        state = (delayed.state_of(self.module) if self.recipe.scaling == "delayed" else None)
        return fp8_linear(x, weight, bias, self.recipe, getattr(self.module, "fp8_weight", None),
                          state)

    def __repr__(self) -> str:
        return f"FP8LinearFn({self.recipe.name}, FP8-gathered weight)"


class FP8UnitGather:
    """How one unit (segment) whose FP8 weights gather in FP8 packs and unpacks its messages.
    Rank r owns [r·per, (r+1)·per) of the segment, which cuts it into pieces, each in one
    weight (a linear's, or one expert's (N, K) slice of a stacked expert weight: each is
    contiguous, so each rank holds at most one piece of it) or in another parameter. Rank r's
    message: the bytes of its other pieces (at an offset aligned to their dtype), then the FP8
    codes of its weight pieces; all slices, no index maps. `views`: (module, slot) per
    gathered parameter; `entries`: per weight (one scale each), (view, expert or -1, start in
    the segment, numel, shape)."""

    def __init__(self, layout, seg, weights: list, rank: int, device: torch.device,
                 dtype: torch.dtype):
        self.layout, self.seg, self.rank = layout, seg, rank
        shards, per = layout.shards, seg.size // layout.shards
        self.first = rank * per  # where this rank's part starts in the segment
        self.es = es = torch.empty((), dtype=dtype).element_size()  # a non-FP8 element's
        self.views = [(module, slot) for slot, module, _ in weights]
        self.names = [name for _, _, name in weights]
        self.entries = []
        for j, (slot, _, _) in enumerate(weights):
            experts = len(slot.shape) == 3  # stacked (E, N, K): one weight per expert
            count = slot.shape[0] if experts else 1
            numel = slot.numel // count
            for e in range(count):
                self.entries.append((j, e if experts else -1, slot.start - seg.start + e * numel,
                                     numel, tuple(slot.shape[1:] if experts else slot.shape)))
        spans = sorted((lo, lo + numel, k) for k, (_, _, lo, numel, _) in enumerate(self.entries))
        self.pieces = []  # per rank: [(k or -1, lo, hi, byte offset in its message)]
        longest = 0
        for r in range(shards):
            cuts, at = [], r * per
            for lo, hi, k in spans:
                lo, hi = max(lo, r * per), min(hi, (r + 1) * per)
                if lo < hi:
                    if at < lo:
                        cuts.append((-1, at, lo))
                    cuts.append((k, lo, hi))
                    at = hi
            if at < (r + 1) * per:
                cuts.append((-1, at, (r + 1) * per))
            offset, pieces = 0, []
            for k, lo, hi in sorted(cuts, key=lambda c: c[0] >= 0):  # others first
                pieces.append((k, lo, hi, offset))
                offset += (hi - lo) * (es if k < 0 else 1)
            self.pieces.append(pieces)
            longest = max(longest, offset)
        self.message = -(-longest // es) * es  # ranks' messages start aligned to the dtype
        # the rows of numerics/fp8_gather.py: this rank's pack, every rank's unpack
        self.pack_rows = [(lo - self.first, at, hi - lo, k)
                          for k, lo, hi, at in self.pieces[rank]]
        self.unpack_rows = [(r * self.message + at, lo, hi - lo, k)
                            for r, pieces in enumerate(self.pieces) for k, lo, hi, at in pieces]
        # the fused kernels' tables, (table, blocks) each: made here, not in a step (the
        # copy to the device would be one more transfer in the first gather)
        self.tables = (fp8_gather.table(self.pack_rows, es, 2, device),
                       fp8_gather.table(self.unpack_rows, es, 1, device))
        self.bytes = torch.zeros(seg.size, dtype=torch.uint8, device=device)
        n = len(self.entries)
        self.mult = torch.ones(n, dtype=torch.float32, device=device)
        self.scales = torch.ones(n, dtype=torch.float32, device=device)
        self.records = torch.zeros(n, dtype=torch.float32, device=device)
        self.bytes.untyped_storage().resize_(0)

    def local_amax(self, shard: torch.Tensor) -> torch.Tensor:
        """Per weight, the amax of this rank's piece of it (0 where it holds none; NaN if
        the piece holds a NaN, so that the weight's scale is NaN as the cast's would be)."""
        local, first = self.layout.segment_shard(shard, self.seg), self.first
        amax = torch.zeros(len(self.entries), dtype=torch.float32, device=shard.device)
        for k, lo, hi, _ in self.pieces[self.rank]:
            if k >= 0:
                amax[k] = tensor_amax(local[lo - first:hi - first])
        return amax

    def set_amax(self, amax: torch.Tensor, local: torch.Tensor) -> None:
        """The amaxes the weights' scales come from (the whole weights', all-reduced, or
        their delayed histories'): their multipliers and scales; `local`: this rank's
        pieces' amaxes, the weights' delayed records."""
        self.mult.copy_(amax_to_scale(amax, E4M3))
        self.scales.copy_(self.mult.reciprocal())
        self.records.copy_(local.nan_to_num(nan=float("inf")))

    def start(self, full: torch.Tensor, shard: torch.Tensor, group: comm.Group):
        """Cast this rank's pieces and start the unit's gather: a handle whose wait() also
        fills `full` (the unit's buffer, storage allocated) and the FP8 bytes."""
        local = self.layout.segment_shard(shard, self.seg)
        if fused(local):
            (pack, blocks), _ = self.tables
            send = fp8_gather.fp8_gather_pack(local, pack, blocks, self.mult, self.message)
        else:  # numerics.fp8.quantize's tensorwise cast, with the whole weight's scale
            send = fp8_gather.pack_eager(local, self.pack_rows, self.mult, self.message)
        out = torch.empty(self.message * group.size, dtype=torch.uint8, device=local.device)
        handle = comm.all_gather(out, send, group, async_op=True)
        return _Pending(self, handle, full, out, send)

    def finish(self, full: torch.Tensor, out: torch.Tensor) -> None:
        self.bytes.untyped_storage().resize_(self.seg.size)
        with torch.no_grad():
            if fused(out):
                _, (unpack, blocks) = self.tables
                fp8_gather.fp8_gather_unpack(out, unpack, blocks, self.scales, self.bytes,
                                             full)
            else:
                fp8_gather.unpack_eager(out, self.unpack_rows, self.scales, self.bytes, full)
        experts: dict = {}
        for k, (j, e, lo, numel, shape) in enumerate(self.entries):
            module = self.views[j][0]
            data = self.bytes[lo:lo + numel].view(E4M3.dtype).view(shape)
            weight = GatheredWeight(data, self.scales[k].clone(), "tensorwise", E4M3,
                                    record=self.records[k].clone())
            if e < 0:
                module.fp8_weight = weight
            else:  # an expert's weight: the experts' loop takes it (lowp/experts.py)
                experts.setdefault(id(module), (module, {}))[1].setdefault(
                    self.names[j], []).append(weight)
        for module, gathered in experts.values():
            module.fp8_experts = gathered

    def free(self) -> None:
        self.bytes.untyped_storage().resize_(0)
        for module, _ in self.views:  # a GEMM's saved copy (for backward) stays valid
            module.fp8_weight = module.fp8_experts = None


class _Pending:
    """An FP8 unit's gather in flight: wait() waits for it and unpacks the message."""

    def __init__(self, unit: FP8UnitGather, handle, full, out, send):
        self.unit, self.handle, self.full, self.out, self.send = unit, handle, full, out, send

    def wait(self) -> bool:
        self.handle.wait()
        self.unit.finish(self.full, self.out)
        self.out = self.send = None
        return True


def _delayed_state(unit: FP8UnitGather, j: int, e: int) -> delayed.DelayedState | None:
    """The delayed-scaling state of a unit's weight: a linear's (e < 0), or expert e's
    projection of a routed-experts module (its own history, lowp/delayed.py
    `expert_state`); None under dynamic scaling."""
    module = unit.views[j][0]
    if e < 0:
        return delayed.state_of(module)
    if getattr(module, delayed.BUFFER, None) is None:
        return None
    return delayed.expert_state(module, e, EXPERT_WEIGHTS.index(unit.names[j]))


def refresh_scales(units: dict, shard: torch.Tensor, group: comm.Group, watchdog) -> None:
    """Every FP8-gathered weight's scale from the current weights: the local amaxes of all
    units in one all_reduce(max) (torchao's precompute_float8_dynamic_scale_for_fsdp); under
    delayed scaling from each weight's history, with no all-reduce once every history's W
    row holds a record (which rows do is host state every rank shares)."""
    order = sorted(units)
    local = torch.cat([units[u].local_amax(shard) for u in order])
    states = [_delayed_state(units[u], j, e) for u in order for j, e, *_ in units[u].entries]
    history = [s is not None and s.filled[delayed.ROW["weight"]] for s in states]
    amax = local
    if not all(history):
        amax = local.clone()
        watchdog.wait(comm.all_reduce(amax, group, op="max", async_op=True),
                      "FP8 weight amax all-reduce")
    if any(history):  # max(history) of the W rows, as lowp/delayed.py's cast takes it
        row = delayed.ROW["weight"]
        kept = torch.stack([s.history[row].max() if h else a
                            for s, h, a in zip(states, history, amax)])
        amax = kept
    at = 0
    for u in order:
        n = len(units[u].entries)
        units[u].set_amax(amax[at:at + n], local[at:at + n])
        at += n
