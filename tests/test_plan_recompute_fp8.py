"""recompute = auto under precision = fp8 and on MoE layers (plan/recompute_plan.py
`op_table`, `layer_choices`; plan/recompute_costs.py), against the engine.

What a recomputed FP8 block runs again: the trace on the meta device (fivefold.trace, as an
H100 runs it) of one engine Block (models/llama.py) converted to FP8, forward + backward,
under the per-layer policies parallel/recompute.py applies for auto. A kept projection's
GEMM is not run again (its output is kept, as a bf16 mm's); every FP8 cast of the forward
is: the recomputed forward casts each FP8 linear's input again (the codes its backward
takes) and its weight (lowp/linear.py keeps no cast weight), whatever the policy keeps.

Error model for the casts: the traced bytes of the block's kernels other than GEMMs under a
policy, beyond the same block's without recomputation, less the bf16 block's same excess
(the re-run norms, RoPE, SwiGLU, adds: `elementwise_seconds`' kernels, not the FP8 ones),
are the re-run casts; the planner counts them as the layer's forward casts
(`rank_dense_cast_bytes`, held to the trace in tests/test_plan_fp8_dense.py) and leaves out
what that leaves out: <= 256 fp32 amax partials written and read per tensorwise amax pass
(x, o's input, the MLP's two inputs and the 7 weights: 11), nothing for the others.

MoE layers: the per-operator table's projections, summed over the layers, are the step
time's forward GEMM seconds (plan/timing.py `rank_compute`, `gemm_fwd`: the MoE block's
FLOPs of `moe_params(active=True)` at the grouped GEMMs' rate), to rounding.
"""

import dataclasses
import functools

import pytest
import torch

from fivefold.models.presets import preset
from fivefold.plan.fp8_linears import layers_fp8_linears
from fivefold.plan.hardware import get_hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.trace import trace_callable
from tests.test_fp8_trace import recipe_of

CFG = dataclasses.replace(preset("tiny"), hidden_size=1024, intermediate_size=2048,
                          num_heads=16, num_kv_heads=8)
BATCH, SEQ = 2, 256
PROJECTIONS = frozenset({"q", "k", "v", "o", "gate", "up", "down"})
POLICIES = {"full": frozenset(), "projections": PROJECTIONS, "q,gate": frozenset({"q", "gate"})}
GEMM_OPS = ("fivefold.fp8_scaled_mm.default", "fivefold.fp8_blockwise_scaled_mm.default",
            "aten.mm.default")


@functools.cache
def traced(recipe: str | None, kept: frozenset | None) -> tuple[float, int]:
    """(bytes of the block's non-GEMM kernels, its projections' GEMMs), forward + backward,
    under recompute = auto's policy keeping `kept` (None: no recomputation)."""
    from fivefold.lowp.convert import convert_to_fp8
    from fivefold.models.llama import Block
    from fivefold.parallel.recompute import apply_layer_policies
    from fivefold.plan.recompute_plan import LayerChoice

    with torch.device("meta"):
        block = Block(CFG).to(torch.bfloat16)
    if recipe is not None:
        convert_to_fp8(block, recipe_of(recipe)[0])
    if kept is not None:
        apply_layer_policies(block, [LayerChoice("keep", kept)])
    x = torch.empty(BATCH, SEQ, CFG.hidden_size, device="meta", dtype=torch.bfloat16,
                    requires_grad=True)
    cos = torch.empty(SEQ, CFG.dim_per_head, device="meta")
    g = torch.empty_like(x, requires_grad=False)
    events = [e for e in trace_callable(lambda: block(x, cos, cos).backward(g),
                                        gpu="h100").events if e.kind == "kernel"]
    return (sum(e.bytes_read + e.bytes_written for e in events if not e.flops),
            sum(1 for e in events if e.name in GEMM_OPS))


@pytest.mark.parametrize("recipe", (None, "tensorwise", "blockwise"))
def test_a_kept_projection_is_not_run_again(recipe):
    """Keeping every projection's output: their GEMMs run once forward and twice backward
    (21), none again, in FP8 as in bf16 (the FP8 GEMM ops were not keepable: all 7 ran
    again); full recomputation runs them again, but for bf16's down projection (the
    checkpoint stops early: nothing saved comes after it; an FP8 linear saves its input's
    codes after its GEMM)."""
    assert traced(recipe, None)[1] == 21
    assert traced(recipe, PROJECTIONS)[1] == 21, recipe
    assert traced(recipe, frozenset())[1] == (27 if recipe is None else 28)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("recipe", ("tensorwise", "tensorwise_delayed", "rowwise",
                                    "blockwise"))
def test_recomputed_forward_casts_match_the_trace(recipe, policy):
    from fivefold.plan.recompute_costs import recompute_cast_seconds
    from fivefold.plan.recompute_plan import (
        elementwise_seconds,
        layer_choices,
        layer_kind,
        op_table,
    )

    kept = POLICIES[policy]
    got = ((traced(recipe, kept)[0] - traced(recipe, None)[0])
           - (traced(None, kept)[0] - traced(None, None)[0]))
    name, scaling = recipe.removesuffix("_delayed"), ("delayed" if "delayed" in recipe
                                                      else "dynamic")
    work = Workload(model=CFG, seq_len=SEQ, gbs=BATCH, precision="fp8", fp8_recipe=name,
                    fp8_scaling=scaling)
    layout = Layout(mbs=BATCH)
    hw, assume = get_hardware("h100")
    hbm = hw.hbm_tbps * 1e12 * assume.hbm_efficiency
    assert layer_kind(work, 0) == (False, layers_fp8_linears(work, 0, 1))
    casts = recompute_cast_seconds(work, layout, hw, assume, *reversed(layer_kind(work, 0)))
    planned = casts * hbm
    slack = 2 * 4 * 256 * 11 if recipe == "tensorwise" else 0
    assert 0 <= got - planned <= slack, (recipe, policy, got, planned)
    # the knapsack's choice costs them: the layer's elementwise kernels, its FP8 casts and
    # the operators it does not keep
    ops = op_table(work, layout, hw, assume)
    want = (elementwise_seconds(work, layout, hw, assume) + casts
            + sum(t[2] for op, t in ops.items() if op not in kept))
    match = [c for c in layer_choices(work, layout, hw, assume)
             if c.kind == "keep" and c.kept == kept]
    assert match or policy == "q,gate"  # (pruned here: another choice dominates it)
    assert not match or match[0].seconds == pytest.approx(want, rel=1e-12)


MOE_CASES = {  # model, train.fp8_keep_out (a MoE layer's experts, a shared expert's up)
    "mixtral": ("mixtral-8x7b", "layers.1.mlp.experts"),
    "deepseek-v3-shaped": ("deepseek-v3-shaped", "layers.4.mlp.experts,*.shared_expert.up_proj"),
    "olmoe": ("olmoe-1b-7b", "layers.1.mlp.experts"),
}


@pytest.mark.parametrize("precision", ("bf16", "fp8", "fp8 keep-out"))
@pytest.mark.parametrize("case", MOE_CASES)
def test_moe_layers_recompute_at_the_step_times_cost(case, precision):
    """The per-operator table's projections (q, k, v, o, gate, up, down), summed over every
    layer of its kind, are plan/timing.py's forward GEMM seconds (times its overhead
    factor): a MoE layer's gate, up and down cost the MoE block's forward (router, top-k
    routed experts of their own width, shared expert, at the grouped GEMMs' rate), not a
    dense MLP of the model's ffn width. Mixtral (all MoE), DeepSeek-V3's shape (3 dense
    layers, a shared expert, 256 thin experts) and OLMoE; FP8 with some experts and the
    shared experts' up kept in bf16. The two sides are the same sums in another order:
    rel 1e-12."""
    from fivefold.plan.recompute_plan import layer_fp8_ops, layer_kind, op_table
    from fivefold.plan.timing import rank_compute

    name, keep_out = MOE_CASES[case]
    mc = preset(name)
    work = Workload(model=mc, seq_len=4096, gbs=64, precision=precision.split()[0],
                    fp8_keep_out=keep_out if "keep-out" in precision else "")
    layout = Layout(dp=8, mbs=1)
    hw, assume = get_hardware("h100")
    total = 0.0
    for i in range(mc.num_layers):
        moe = layer_kind(work, i)[0]
        assert moe == mc.is_moe_layer(i)
        table = op_table(work, layout, hw, assume, layer_fp8_ops(work, i), moe)
        total += sum(t[2] for op, t in table.items() if op != "core")
    gemm = rank_compute(work, layout, hw, assume, 0).gemm_fwd
    assert total * (1 + assume.compute_overhead) == pytest.approx(gemm, rel=1e-12)


def test_a_moe_layers_mlp_is_its_experts_work():
    """Mixtral: a MoE layer's gate, up and down carry 2 (top-2) experts' FLOPs of width
    14336 and the router's, so they cost more than the dense MLP of width 14336 the table
    priced before, at the same rate (8 experts of 4096·2/8 = 1024 rows each: 1024 / 1152 of
    the large-GEMM rate, the dense 4096 / 4224): bf16, one micro-batch of 4096 tokens."""
    from fivefold.plan.recompute_plan import op_table

    hw, assume = get_hardware("h100")
    work = Workload(model=preset("mixtral-8x7b"), seq_len=4096, gbs=64, precision="bf16")
    layout = Layout(dp=8, mbs=1)
    moe, dense = (op_table(work, layout, hw, assume, None, m) for m in (True, False))
    h, f, tokens = 4096, 14336, 4096
    peak = hw.peak_flops("bf16") * hw.matmul_efficiency
    expert_rate, dense_rate = peak * 1024 / 1152, peak * 4096 / 4224
    assert dense["up"][2] == pytest.approx(tokens * 2 * h * f / dense_rate, rel=1e-12)
    assert moe["up"][2] == pytest.approx(tokens * 2 * 2 * h * f / expert_rate, rel=1e-12)
    assert moe["gate"][2] == pytest.approx(
        tokens * (2 * 2 * h * f + 2 * h * 8) / expert_rate, rel=1e-12)
    assert moe["q"] == dense["q"] and moe["core"] == dense["core"]
