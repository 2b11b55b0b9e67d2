"""FP8 training under data parallelism with ZeRO-3, tensor (with and without SP), pipeline,
context and expert parallelism tracks the single-process FP8 run of the same config (same
seed, same global batch).

Why the tolerances differ by layout:
- dp2 + ZeRO-3, pp2, ep2: every micro-batch is the one the single process runs, so every
  FP8 group (a token's 1x128 tile, a weight block, a tensor) holds the same values and
  quantises the same way; what differs is only the order of bf16/fp32 sums (gradient
  reductions over ranks, gathered parameters). Tolerance: loss 1e-4 relative per step,
  gradient norm 3e-3 relative (bf16 rounding of gradients summed in another order;
  measured here: loss <= 2.2e-5, gradient norm <= 7e-4).
- tp2 (rowwise): a row-parallel linear (o_proj, down_proj) quantises its local half of K,
  so a token's row scale is the amax of half its channels, not all of them: other
  roundings, by design (the issue: "FP8 block boundaries under TP change rounding").
  Tolerance: loss 3e-4 relative per step, gradient norm 1e-2 relative (measured: loss
  <= 3.2e-5, gradient norm <= 1.4e-3 over the 3 steps).
- cp2 (blockwise): each rank holds half of every sequence, so the weight gradient's
  1x128 tiles along the tokens group other tokens than the single process's (then the
  ranks' gradients are summed). Tolerance: loss 1e-4, gradient norm 5e-3 (measured: loss
  <= 1.2e-5, gradient norm <= 1.5e-3). tp2 with SP: as tp2 (the same numbers measured).
- tp2 (blockwise, widths whose shards are whole 128-blocks): a row-parallel linear's
  local K is exactly one tile wide and a column-parallel one keeps whole weight blocks, so
  every FP8 group is the single process's; but each rank's partial output of a row-parallel
  linear is rounded to bf16 before the all-reduce sums it (the single process rounds the
  whole sum once), as in any bf16 TP run. Tolerance: loss 1e-3 relative per step, gradient
  norm 1e-2 (measured: loss <= 2.4e-4, gradient norm <= 2.5e-3).
Blockwise under tp2 with the small model (hidden 32) is refused: its shards would cut blocks.
"""

import pathlib

import pytest
import torch
from common import small_config
from harness import run_ranks

from fivefold.config import ConfigError
from fivefold.lowp import delayed
from fivefold.lowp.delayed import histories
from fivefold.lowp.experts import FP8ExpertsMixin
from fivefold.lowp.linear import FP8LinearMixin, FP8Recipe
from fivefold.parallel.mesh import ParallelDims
from fivefold.plan.comm import ledger_volume
from fivefold.plan.inputs import training_plan_inputs
from fivefold.train.trainer import Trainer

BASE = ["--train.precision", "fp8", "--train.gbs", "8", "--parallel.mbs", "2",
        "--train.lr", "1e-3"]
MOE = ["--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "16"]
# Widths whose tp2 shards are whole 128-blocks (q, k/v: 128 per rank, MLP: 256 per rank)
ALIGNED = ["--model.hidden_size", "256", "--model.intermediate_size", "512",
           "--model.num_kv_heads", "4"]
STEPS = 3
CASES = {  # name: (reference args, layout args, loss tol, grad-norm tol)
    "dp2-zero3": (["--train.fp8_recipe", "blockwise"],
                  ["--parallel.dp", "2", "--parallel.zero", "3"], 1e-4, 3e-3),
    "pp2": (["--train.fp8_recipe", "blockwise"], ["--parallel.pp", "2"], 1e-4, 3e-3),
    "tp2-rowwise": (["--train.fp8_recipe", "rowwise"], ["--parallel.tp", "2"], 3e-4, 1e-2),
    "tp2-sp-rowwise": (["--train.fp8_recipe", "rowwise"],
                       ["--parallel.tp", "2", "--parallel.sp", "true"], 3e-4, 1e-2),
    # rowwise_gw_hp: rowwise's forward and input gradient (the same cut row scales), the
    # weight gradient in bf16 from the whole local shard
    "tp2-rowwise_gw_hp": (["--train.fp8_recipe", "rowwise_gw_hp"], ["--parallel.tp", "2"],
                          3e-4, 1e-2),
    "cp2": (["--train.fp8_recipe", "blockwise"], ["--parallel.cp", "2"], 1e-4, 5e-3),
    "tp2-blockwise": (["--train.fp8_recipe", "blockwise", *ALIGNED], ["--parallel.tp", "2"],
                      1e-3, 1e-2),
}
MOE_CASES = {
    "ep2": (["--train.fp8_recipe", "blockwise", *MOE],
            ["--parallel.dp", "2", "--parallel.ep", "2"], 1e-4, 3e-3),
    # rowwise experts run grouped (lowp/experts.py): each rank's local experts as groups
    "ep2-rowwise": (["--train.fp8_recipe", "rowwise", *MOE],
                    ["--parallel.dp", "2", "--parallel.ep", "2"], 1e-4, 3e-3),
}


def train(rank, world, tmp, args):
    cfg = small_config(pathlib.Path(tmp), *BASE, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    fp8 = [m for chunk in trainer.model.chunks for m in chunk.modules()
           if isinstance(m, (FP8LinearMixin, FP8ExpertsMixin)) or getattr(m, "linear_fn", None)]
    assert len(fp8) >= 4, "the layout runs without FP8 GEMMs"
    records = [trainer.train_step() for _ in range(STEPS)]
    trainer.close()
    return [(r["loss"], r["grad_norm"]) for r in records]


def every_case(rank, world, tmp, cases):
    return {name: train(rank, world, f"{tmp}/{name}", ref + layout)
            for name, (ref, layout, _, _) in cases.items()}


def rel(a, b):
    return abs(a - b) / abs(b)


def _check(cases, tmp_path):
    refs = {}  # one single-process run per distinct reference config
    for name, (ref, _, _, _) in cases.items():
        if tuple(ref) not in refs:
            refs[tuple(ref)] = train(0, 1, str(tmp_path / f"ref-{name}"), ref)
    for rank_result in run_ranks(every_case, 2, str(tmp_path), cases):
        for name, steps in rank_result.items():
            ref, _, loss_tol, norm_tol = cases[name]
            for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(
                    zip(steps, refs[tuple(ref)])):
                assert rel(loss, ref_loss) <= loss_tol, (name, step, loss, ref_loss)
                assert rel(norm, ref_norm) <= norm_tol, (name, step, norm, ref_norm)


def test_fp8_dp_zero3_pp_tp_track_the_single_process_fp8_run(tmp_path):
    _check(CASES, tmp_path)


def test_fp8_expert_parallel_tracks_the_single_process_fp8_run(tmp_path):
    _check(MOE_CASES, tmp_path)


def test_blockwise_tp_cut_inside_a_block_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="cutting a 128-wide FP8 block"):
        small_config(tmp_path, *BASE, "--parallel.tp", "2")



def zero3_tensorwise(rank, world, tmp, fp8_allgather, extra=()):
    """dp2 + ZeRO-3 tensorwise over STEPS steps: losses and gradient norms; the quantisations
    of weights the GEMMs did themselves; the FP8 linears (count, local weight elements); and
    of the last step the dp all-gather and all-reduce bytes of the ledger and of the
    planner, the amax all-reduces, and the padding of the FP8 gather's messages (each rank's
    to the longest rank's); the states FP8 units were in when needed."""
    cfg = small_config(pathlib.Path(tmp), *BASE, "--train.fp8_recipe", "tensorwise",
                       "--parallel.dp", "2", "--parallel.zero", "3",
                       "--parallel.fp8_allgather", str(fp8_allgather).lower(),
                       # one gradient sync for both runs: `auto` weighs each run's own
                       # predicted step time, and the FP8 gather's extra calls can tip it
                       "--parallel.grad_sync", "step", *extra)
    dims = ParallelDims.from_config(cfg.parallel)
    trainer = Trainer(cfg, dims, quiet=True)
    quantized = [0]  # weights the GEMMs quantise themselves
    quantize_weight = FP8Recipe.quantize_weight

    def counting(recipe, w):
        quantized[0] += 1
        return quantize_weight(recipe, w)

    FP8Recipe.quantize_weight = counting  # this forked rank's copy of the class only
    delayed_weight = delayed.weight  # delayed scaling's own casts of W and Wᵀ

    def counting_delayed(w, state, transposed=False):
        quantized[0] += 1
        return delayed_weight(w, state, transposed)

    delayed.weight = counting_delayed
    linears = [m for chunk in trainer.model.chunks for m in chunk.modules()  # tp: local shards
               if isinstance(m, FP8LinearMixin) or getattr(m, "linear_fn", None) is not None]
    experts = [m for chunk in trainer.model.chunks for m in chunk.modules()
               if isinstance(m, FP8ExpertsMixin)]  # routed: one weight per expert and matrix
    expert_numel = sum(m.w_gate.numel() + m.w_up.numel() + m.w_down.numel() for m in experts)
    # ZeRO-3 over dp_cp; under expert parallelism the experts' own over edp (each gatherer
    # its own units, amax all-reduce and messages)
    parts = getattr(trainer.optimizer, "parts", [trainer.optimizer])
    gatherers = [part.gatherer for part in parts]
    groups = ("dp_cp", "edp") if len(parts) > 1 else ("dp_cp",)
    padding = 0  # bytes per gather of every unit, beyond 1 per FP8 element and 2 per other
    states = set()  # an FP8 unit's state when it is needed
    for gatherer in gatherers:
        for unit in gatherer.fp8.values():
            fp8_in_unit = sum(numel for _, _, _, numel, _ in unit.entries)
            padding += (gatherer.group.size * unit.message
                        - (fp8_in_unit + 2 * (unit.seg.size - fp8_in_unit)))

        def watching(u, gatherer=gatherer, ensure=gatherer.ensure):
            if u in gatherer.fp8:  # (gatherer, unit, forward?, state)
                states.add((gatherers.index(gatherer), u, torch.is_grad_enabled(),
                            gatherer.state[u]))
            ensure(u)

        gatherer.ensure = watching
    met = set()  # (step, experts module, expert) that met tokens on this rank
    for i, m in enumerate(experts):
        def forward(x, counts, m=m, i=i, inner=m.forward):
            met.update((len(records), i, e) for e, c in enumerate(counts.tolist()) if c)
            return inner(x, counts)
        m.forward = forward
    dims.ledger.enabled = True
    records = []
    for _ in range(STEPS):  # the ledger keeps the last step
        records.append(trainer.train_step())
    totals = dims.ledger.totals()
    ledger = {op: sum(totals.get((g, op), {"bytes": 0})["bytes"] for g in groups)
              for op in ("all_gather", "all_reduce")}
    amax_calls = sum(1 for e in dims.ledger.entries
                     if e.group in groups and e.op == "all_reduce" and e.elements > 1)
    world_reduce = sum(e.bytes for e in dims.ledger.entries
                       if (e.group, e.op) == ("stage", "all_reduce"))  # every rank: no pp
    kept = {k: h.clone() for k, h in histories(trainer.model.chunks[0]).items()}
    trainer.close()
    work, layout = training_plan_inputs(cfg)
    volume = ledger_volume(work, layout)
    planned = {op: sum(volume.get(g, {}).get(op, 0) for g in groups)
               for op in ("all_gather", "all_reduce")}
    gathers = 2 * work.num_microbatches(layout)  # forward and backward, per micro-batch
    FP8Recipe.quantize_weight, delayed.weight = quantize_weight, delayed_weight
    return {"histories": kept, "world_reduce": world_reduce,
            "planned_world": ledger_volume(work, layout).get("stage", {}).get("all_reduce", 0),
            "runs": [(r["loss"], r["grad_norm"]) for r in records], "ledger": ledger,
            "planned": planned, "linears": len(linears), "gathers": gathers,
            "gatherers": len(gatherers),
            "scales": len(linears) + sum(3 * m.w_gate.shape[0] for m in experts),
            "experts": len(experts),
            "numel": sum(m.weight.numel() for m in linears) + expert_numel,
            "padding": padding * gathers,
            "quantized": quantized[0], "amax_calls": amax_calls, "fp8_states": states,
            "met": met}


# A dense first layer, then a MoE layer with a shared expert (FP8, gathered in FP8) and its
# gate (kept out of FP8: bf16); the routed experts gather in FP8 too, one scale per expert's
# weight (the per-expert loop's tensorwise cast of it).
MOE_SHARED = (*MOE, "--model.moe_first_dense", "1", "--model.shared_expert_intermediate_size",
              "24", "--model.shared_expert_gate", "true")


@pytest.mark.parametrize("world,extra,pad", [
    pytest.param(2, (), 0.02, id="dp2"),
    pytest.param(2, MOE_SHARED, 0.05, id="dp2-moe-shared", marks=pytest.mark.slow),
    # every layer MoE: the routed experts' weights gathered in FP8 over dp; under ep2 (4
    # ranks: dp4 x ep2) over the expert-data-parallel group edp by the experts' own gatherer
    pytest.param(2, MOE, 0.05, id="dp2-moe"),
    pytest.param(4, (*MOE, "--parallel.dp", "4", "--parallel.ep", "2"), 0.05, id="dp4-ep2",
                 marks=pytest.mark.slow),
    pytest.param(4, ("--parallel.tp", "2"), 0.02, id="dp2-tp2", marks=pytest.mark.slow),
    # train.fp8_keep_out: those linears' weights (a whole block, every o_proj; a layer's
    # routed experts and every k_proj) gather in bf16, and their amaxes leave the all-reduce
    pytest.param(2, ("--train.fp8_keep_out", "layers.0,*.o_proj"), 0.05, id="dp2-keep-out"),
    pytest.param(2, (*MOE_SHARED, "--train.fp8_keep_out", "layers.1.mlp.experts,k_proj"),
                 0.05, id="dp2-moe-keep-out", marks=pytest.mark.slow)])
def test_zero3_fp8_allgather_gives_the_same_run_at_half_the_weight_bytes(tmp_path, world,
                                                                          extra, pad):
    """The FP8 all-gather's bytes of a weight are those of the tensorwise cast of the whole
    weight (one all-reduced amax per weight, an elementwise cast), so the GEMMs see the same
    operands: losses and gradient norms are bit-equal (tolerance 0), and no FP8 linear
    quantises its weight itself (each did twice per micro-batch without the option: forward
    and input gradient). The ledger's all-gather bytes drop by exactly one byte per
    FP8-linear weight element per gather (half of bf16's two) less the messages' padding,
    and the planner's bytes equal the ledger's less that padding (counted exactly here; a
    few % at these tiny widths). One all_reduce(max) per step carries every weight's fp32
    amax; the planner counts it. Under tp2, ZeRO-3 shards each rank's tp slice of a weight
    over dp and the FP8 linear's tensorwise scale is that slice's (TP itself never gathers
    weights): the dp amax all-reduce gives exactly it, so tp2 is bit-equal too. Routed
    experts (tensorwise: the per-expert loop, each expert's weight cast on its own) gather
    in FP8 with one scale per expert's weight from the same all-reduce: bit-equal, no
    expert casts its weights itself, 4 amax bytes per expert's weight; under ep2 the
    experts' gatherer over edp does the same with its own one all-reduce."""
    off = run_ranks(zero3_tensorwise, world, str(tmp_path / "off"), False, extra)
    on = run_ranks(zero3_tensorwise, world, str(tmp_path / "on"), True, extra)
    for a, b in zip(off, on):
        assert b["runs"] == a["runs"]
        own = a["gathers"] * STEPS  # 2 per micro-batch (forward, input gradient), each step
        # routed experts: each expert with tokens casts its three weights twice per
        # micro-batch without the option (how many have tokens depends on the routing)
        casts = a["quantized"] - a["linears"] * own
        assert a["linears"] > 0 and b["quantized"] == 0
        assert casts > 0 if a["experts"] else casts == 0
        assert a["padding"] == 0 and a["numel"] > 0
        saved = a["numel"] * a["gathers"]
        assert a["ledger"]["all_gather"] - b["ledger"]["all_gather"] == saved - b["padding"]
        assert 0 <= b["padding"] < pad * b["ledger"]["all_gather"]
        assert a["planned"]["all_gather"] == a["ledger"]["all_gather"]
        assert b["planned"]["all_gather"] == b["ledger"]["all_gather"] - b["padding"]
        # The scales: one all_reduce(max) per step of every FP8 linear's fp32 amax, beside
        # the gradient norm's one scalar.
        assert (a["amax_calls"], b["amax_calls"]) == (0, b["gatherers"])
        # Prefetched: every FP8 unit's gather was in flight before the unit was needed; but
        # the experts' own gatherer under ep (no rest unit ahead of its blocks) gathers its
        # first unit in forward and its last in backward when they are needed, FP8 or not.
        assert not a["fp8_states"] and b["fp8_states"]
        for g, u, forward, state in b["fp8_states"]:
            edge = g == 1 and u == (0 if forward else max(
                v for h, v, _, _ in b["fp8_states"] if h == 1))
            assert state == ("free" if edge else "gathering"), (g, u, forward, state)
        assert b["ledger"]["all_reduce"] - a["ledger"]["all_reduce"] == 4 * a["scales"]
        assert b["planned"]["all_reduce"] == b["ledger"]["all_reduce"]
        assert a["planned"]["all_reduce"] == a["ledger"]["all_reduce"]


@pytest.mark.parametrize("moe", [(), MOE], ids=["dense", "moe"])
def test_zero3_fp8_allgather_under_full_recompute_gives_the_same_run(tmp_path, moe):
    """Full recomputation runs each block's forward again inside backward, on the unit
    gathered again in FP8 (the routed experts' weights too): bit-equal to the run without
    the option (tolerance 0)."""
    extra = ("--train.recompute", "full", *moe)
    off = run_ranks(zero3_tensorwise, 2, str(tmp_path / "off"), False, extra)
    on = run_ranks(zero3_tensorwise, 2, str(tmp_path / "on"), True, extra)
    for a, b in zip(off, on):
        assert b["runs"] == a["runs"]
        assert b["quantized"] == 0 < a["quantized"]


def test_fp8_allgather_needs_zero3_and_tensorwise(tmp_path):
    for args in (["--train.fp8_recipe", "rowwise", "--parallel.zero", "3"],
                 ["--train.fp8_recipe", "tensorwise", "--parallel.zero", "1"]):
        with pytest.raises(ConfigError, match="parallel.fp8_allgather = true needs"):
            small_config(tmp_path, *BASE, "--parallel.dp", "2", *args,
                         "--parallel.fp8_allgather", "true")


DELAYED = ("--train.fp8_scaling", "delayed", "--train.fp8_history_len", "4")
# 8 experts, top-1, one micro-batch of 64 tokens per rank: in each of the 3 steps some
# expert meets tokens on one rank and none on the other (the test checks that it does)
MOE_SPARSE = ("--model.num_experts", "8", "--model.experts_top_k", "1",
              "--model.moe_intermediate_size", "16", "--train.gbs", "4")


@pytest.mark.parametrize("world,extra,casts", [  # casts: W's per micro-batch without it
    pytest.param(2, DELAYED, 2, id="dp2"),
    pytest.param(2, (*DELAYED, "--train.recompute", "full"), 3, id="dp2-recompute",
                 marks=pytest.mark.slow),
    pytest.param(4, (*DELAYED, "--parallel.tp", "2"), 2, id="dp2-tp2", marks=pytest.mark.slow),
    # every layer MoE: each routed expert's weight gathered in FP8 with its own history's
    # multiplier; under ep2 (dp4 x ep2) by the experts' own gatherer over edp
    pytest.param(2, (*DELAYED, *MOE_SPARSE), 2, id="dp2-moe"),
    pytest.param(4, (*DELAYED, *MOE, "--parallel.dp", "4", "--parallel.ep", "2"), 2,
                 id="dp4-ep2", marks=pytest.mark.slow)])
def test_zero3_fp8_allgather_under_delayed_scaling_gives_the_same_run(tmp_path, world, extra,
                                                                       casts):
    """Delayed scaling with the FP8 all-gather: each weight's shard is cast before the
    gather with the multiplier of its W history (lowp/delayed.py; on the first step its own
    amax, from the gather's one all-reduce of shard amaxes), the bytes the linear's own
    delayed cast of the gathered bf16 weight writes; Wᵀ is those codes transposed, as the
    delayed cast's is. Each rank folds its shard's amax into the W record and the step's one
    all_reduce(max) of the records makes it the whole weight's. Same arithmetic, so losses,
    gradient norms and every amax history are bit-equal (tolerance 0); no linear casts its
    weight itself (twice per micro-batch without the option). After the first step the
    scales come from the histories: no amax all-reduce of the gather's own (the ledger's
    last step has none, and the planner counts none); the delayed records' all-reduce is
    the same with and without the option. All-gather bytes as in the dynamic case.
    Routed experts: each expert's weight casts with its own W history's multiplier (the
    first step with the all-reduced amax); each rank folds its piece's amax into the
    expert's W record, also where the expert met no token on that rank (without raising
    its flag), so where another rank met tokens the reduced record is the whole weight's,
    the record that rank's own cast of the gathered bf16 weight makes without the option:
    every expert history bit-equal too."""
    off = run_ranks(zero3_tensorwise, world, str(tmp_path / "off"), False, extra)
    on = run_ranks(zero3_tensorwise, world, str(tmp_path / "on"), True, extra)
    for a, b in zip(off, on):
        assert b["runs"] == a["runs"]
        assert a["histories"].keys() == b["histories"].keys() and a["histories"]
        for name, h in a["histories"].items():
            assert torch.equal(b["histories"][name], h), name
            w = h[1] if h.dim() == 2 else h[:, :, 1]  # an expert's: (E, 3, 3, H)
            assert (w[..., :STEPS] > 0).all()  # the W row recorded every step
        micro = a["gathers"] // 2
        expert_casts = a["quantized"] - a["linears"] * casts * micro * STEPS
        assert a["linears"] > 0 and (expert_casts > 0 if a["experts"] else expert_casts == 0)
        assert b["quantized"] == 0
    if world == 2 and on[0]["experts"]:  # an expert met tokens on one rank only, each step
        one_rank = on[0]["met"] ^ on[1]["met"]
        assert {step for step, _, _ in one_rank} == set(range(STEPS))
        saved = a["numel"] * a["gathers"]
        assert a["ledger"]["all_gather"] - b["ledger"]["all_gather"] == saved - b["padding"]
        assert b["planned"]["all_gather"] == b["ledger"]["all_gather"] - b["padding"]
        assert a["planned"]["all_gather"] == a["ledger"]["all_gather"]
        assert (a["amax_calls"], b["amax_calls"]) == (0, 0)
        assert b["ledger"]["all_reduce"] == a["ledger"]["all_reduce"]
        assert b["planned"]["all_reduce"] == b["ledger"]["all_reduce"]
        assert b["world_reduce"] == a["world_reduce"] == b["planned_world"] > 0
