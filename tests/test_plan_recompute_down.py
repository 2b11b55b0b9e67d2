"""Which projections a checkpointed block runs again (parallel/recompute.py, full and
recompute = auto's per-operator policies) against what the planner charges
(plan/recompute_plan.py `op_table`, `rerun_down`; plan/timing.py's full recomputation).

The oracle: the trace on the meta device (fivefold.trace, as an H100 runs it) of one engine
Block (models/llama.py), forward + backward, with and without the policy. torch's
checkpoint stops its re-run once every saved tensor is back: a dense block's bf16 down
projection (an mm, whose autograd saves its inputs before it runs) is never run again; an
FP8 linear saves its codes after its GEMM, so its down projection is. The re-run GEMMs'
FLOPs are exact on both sides (2·tokens·in·out each), so the tolerance is 0.
"""

import dataclasses
import functools

import pytest
import torch

from fivefold.models.presets import preset
from fivefold.plan.hardware import get_hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.trace import trace_callable
from tests.test_fp8_trace import recipe_of

SWIGLU = dataclasses.replace(preset("tiny"), hidden_size=1024, intermediate_size=2048,
                             num_heads=16, num_kv_heads=8)
GELU = dataclasses.replace(SWIGLU, mlp="gelu", norm="layernorm", num_kv_heads=16)
BATCH, SEQ = 2, 256
MODELS = {"swiglu": SWIGLU, "gelu": GELU}
GEMM_OPS = ("fivefold.fp8_scaled_mm.default", "aten.mm.default", "aten.addmm.default")
FULL = frozenset()
CASES = {  # model, recipe (None: bf16), train.fp8_keep_out, kept operators
    "bf16 full": (SWIGLU, None, "", FULL),
    "bf16 q,gate": (SWIGLU, None, "", frozenset({"q", "gate"})),
    "bf16 keep down": (SWIGLU, None, "", frozenset({"down"})),
    "gelu bf16 full": (GELU, None, "", FULL),
    "fp8 full": (SWIGLU, "tensorwise", "", FULL),
    "fp8 q,gate": (SWIGLU, "tensorwise", "", frozenset({"q", "gate"})),
    "fp8 down kept out": (SWIGLU, "tensorwise", "*.down_proj", FULL),
}


@functools.cache
def traced_gemm_flops(model, recipe, keep_out, kept) -> float:
    from fivefold.lowp.convert import convert_to_fp8
    from fivefold.models.llama import Block
    from fivefold.parallel.recompute import apply_layer_policies
    from fivefold.plan.recompute_plan import LayerChoice

    cfg = MODELS[model]
    with torch.device("meta"):
        block = Block(cfg).to(torch.bfloat16)
    if recipe is not None:
        convert_to_fp8(block, recipe_of(recipe)[0], [keep_out] if keep_out else [])
    if kept is not None:
        apply_layer_policies(block, [LayerChoice("keep", kept)])
    x = torch.empty(BATCH, SEQ, cfg.hidden_size, device="meta", dtype=torch.bfloat16,
                    requires_grad=True)
    cos = torch.empty(SEQ, cfg.dim_per_head, device="meta")
    events = trace_callable(lambda: block(x, cos, cos).backward(torch.empty_like(x)),
                            gpu="h100").events
    return sum(e.flops for e in events if e.kind == "kernel" and e.name in GEMM_OPS)


def _work(cfg, recipe, keep_out):
    if recipe is None:
        return Workload(model=cfg, seq_len=SEQ, gbs=BATCH)
    return Workload(model=cfg, seq_len=SEQ, gbs=BATCH, precision="fp8", fp8_recipe=recipe,
                    fp8_keep_out=keep_out)


@pytest.mark.parametrize("case", CASES)
def test_the_planned_rerun_projections_are_the_traced_ones(case):
    from fivefold.plan.recompute_plan import layer_choices, layer_fp8_ops, op_table, rerun_down

    cfg, recipe, keep_out, kept = CASES[case]
    got = (traced_gemm_flops(cfg.mlp, recipe, keep_out, kept)
           - traced_gemm_flops(cfg.mlp, recipe, keep_out, None))
    work = _work(cfg, recipe, keep_out)
    hw, assume = get_hardware("h100")
    ops = op_table(work, Layout(mbs=BATCH), hw, assume, layer_fp8_ops(work, 0))
    h, q, kv, f = cfg.hidden_size, cfg.num_heads * cfg.dim_per_head, (
        cfg.num_kv_heads * cfg.dim_per_head), cfg.intermediate_size
    shapes = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, f),
              "up": (h, f), "down": (f, h)}
    tokens = BATCH * SEQ
    fp8_ops = layer_fp8_ops(work, 0)
    rerun = [op for op in shapes if op in ops and op not in kept
             and (op != "down" or rerun_down(work, fp8_ops, False))]
    planned = sum(2 * tokens * shapes[op][0] * shapes[op][1] for op in rerun)
    assert got == planned, (case, got, planned)
    # the down projection runs again exactly when it is an FP8 linear and not kept
    assert rerun_down(work, fp8_ops, False) == (recipe is not None and not keep_out), case
    # and the knapsack's choice costs those GEMMs (with the layer's elementwise kernels
    # and FP8 casts, the same for every choice)
    choices = {c.kept: c.seconds for c in layer_choices(work, Layout(mbs=BATCH), hw, assume)
               if c.kind == "keep"}
    if kept in choices and FULL in choices:  # (kept: unless another choice dominates it)
        want = choices[FULL] - sum(ops[op][2] for op in kept
                                   if op != "down" or rerun_down(work, fp8_ops, False))
        assert choices[kept] == pytest.approx(want, rel=1e-12), case


@pytest.mark.parametrize("case", ("bf16 full", "fp8 full", "fp8 down kept out"))
def test_full_recomputation_in_the_step_is_the_tables(case):
    """plan/timing.py's full recomputation (the layers' forward less what the re-run does
    not run) is the per-operator table's (`recompute_seconds` without a plan, at the same
    GPU) times the compute overhead, to rounding: both leave out a bf16 down projection."""
    from fivefold.plan.recompute_plan import recompute_seconds
    from fivefold.plan.timing import rank_compute

    cfg, recipe, keep_out, _ = CASES[case]
    work = _work(dataclasses.replace(cfg, num_layers=4), recipe, keep_out)
    hw, assume = get_hardware("h100")
    layout = Layout(mbs=BATCH, recompute="full")
    got = rank_compute(work, layout, hw, assume, 0).recompute
    want = recompute_seconds(work, layout, 0, hw, assume, None) * (1 + assume.compute_overhead)
    assert got == pytest.approx(want, rel=1e-9), (case, got, want)


def test_a_reentrant_checkpoint_runs_the_down_projection_again():
    """Megatron's, DeepSpeed's and nanotron's checkpoints are reentrant (the whole forward
    runs again, plan/conventions.py): their full recomputation charges every projection;
    torchtitan's non-reentrant checkpoint stops early, as fivefold's."""
    from fivefold.plan.conventions import get_convention
    from fivefold.plan.recompute_plan import rerun_down
    from fivefold.plan.timing import rank_compute

    work = _work(dataclasses.replace(SWIGLU, num_layers=4), None, "")
    hw, assume = get_hardware("h100")
    layout = Layout(mbs=BATCH, recompute="full")
    stops = {name: get_convention(name).apply_workload(work).recompute_early_stop
             for name in ("fivefold", "torchtitan", "megatron", "deepspeed", "nanotron")}
    assert stops == {"fivefold": True, "torchtitan": True, "megatron": False,
                     "deepspeed": False, "nanotron": False}
    reentrant = dataclasses.replace(work, recompute_early_stop=False)
    assert rerun_down(reentrant, None, False) and not rerun_down(work, None, False)
    full = rank_compute(reentrant, layout, hw, assume, 0).recompute
    early = rank_compute(work, layout, hw, assume, 0).recompute
    h, f, tokens = SWIGLU.hidden_size, SWIGLU.intermediate_size, BATCH * SEQ
    ratio = (full - early) / (4 * 2 * tokens * h * f)  # seconds per down FLOP, 4 layers
    up = rank_compute(work, Layout(mbs=BATCH), hw, assume, 0).gemm_fwd / (
        4 * 2 * tokens * (2 * h * h + 2 * h * SWIGLU.num_kv_heads * SWIGLU.dim_per_head
                          + 3 * h * f))  # the forward GEMMs' seconds per FLOP
    assert ratio == pytest.approx(up * (1 + assume.compute_overhead), rel=1e-9)
