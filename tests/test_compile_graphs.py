"""How many graphs `train.compile` makes, and that it makes no more after the first step.

Full recomputation (`--train.recompute full`): the checkpoint wrapper sets the replay tape, a
`ContextVar` dynamo cannot trace; compiling the block's call graph-broke there (torch 2.13:
0 graphs, 4 breaks over 3 steps of 2 blocks, the blocks eager). The block's own forward is
compiled inside the checkpoint instead (parallel/recompute.py `compile_inside`): one graph
shared by the blocks, no break, and the losses and gradient norms bit-equal to the compiled
run without recomputation (the same compiled forward runs again in backward).

Routed experts: the per-expert loops (the FP8 experts', and the plain loop a trace in fp32
or fp16 takes) run eagerly (`torch.compiler.disable`), since their rows per expert change
every step. Before, FP8 tensorwise compiled 12, 13, 17, 18 graphs after steps 1-4 (a
graph for new expert sizes, step after step), and an fp32 model failed to compile at all
(the grouped matmul's meta kernel is bf16-only). Now the graph count is fixed after the
first step: the routing's `bincount` and the dispatch still break the graph (data-dependent
sizes), the same breaks every step."""

import pytest
import torch
from common import small_config
from test_fp8_compile import loss_tolerance
from tolerances import loss_rtol, trained_rtol, within
from torch._dynamo.utils import counters

from fivefold.train.trainer import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")


MOE = ("--model.preset", "tiny-moe", "--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "32")


def _run(tmp_path, *overrides, steps=3, compile_flag="true"):
    """Per step: (loss, grad_norm, graphs compiled so far, graph breaks so far)."""
    torch._dynamo.reset()
    counters.clear()
    trainer = Trainer(small_config(tmp_path, "--train.compile", compile_flag, *overrides),
                      quiet=True)
    out = []
    try:
        for _ in range(steps):
            m = trainer.train_step()
            out.append((m["loss"], m["grad_norm"], counters["stats"]["unique_graphs"],
                        sum(counters["graph_break"].values())))
        blocks = list(trainer.model.chunks[0].layers)
        checkpointed = [hasattr(b.__dict__.get("forward"), "checkpointed_forward")
                        for b in blocks]
    finally:
        trainer.close()
        torch._dynamo.reset()
    return out, checkpointed


def test_full_recompute_compiles_one_graph_with_the_same_losses(tmp_path):
    full, checkpointed = _run(tmp_path / "full", "--train.recompute", "full")
    assert [(g, b) for _, _, g, b in full] == [(1, 0)] * 3, full  # none after step 1 either
    assert checkpointed == [True, True]  # still recomputed: the wrapper stays
    plain, checkpointed = _run(tmp_path / "plain")
    assert checkpointed == [False, False]
    assert [(g, b) for _, _, g, b in plain] == [(1, 0)] * 3, plain
    assert [(loss, norm) for loss, norm, _, _ in full] == \
        [(loss, norm) for loss, norm, _, _ in plain]


def test_moe_fp32_compiles_a_fixed_number_of_graphs(tmp_path):
    """fp32, 2 MoE blocks of 4 experts: the graphs and breaks of step 1 are all there are;
    losses within loss_rtol of eager and gradient norms within trained_rtol (tests/
    tolerances.py: inductor fuses the dense parts' float32 sums in another order; per block
    q/k/v, o, the router, gate/up and down in the forward's depth)."""
    compiled, _ = _run(tmp_path / "compiled", *MOE)
    graphs, breaks = compiled[0][2:]
    assert graphs > 0 and [(g, b) for _, _, g, b in compiled] == [(graphs, breaks)] * 3, \
        compiled
    eager, _ = _run(tmp_path / "eager", *MOE, compile_flag="false")
    loss_tol, trained_tol = loss_rtol(4 * 32, 5 * 2), trained_rtol(4 * 32, 5 * 2)
    for (a, na, _, _), (b, nb, _, _) in zip(eager, compiled):
        assert within(abs(a - b) / a, loss_tol, "compiled moe loss"), (a, b)
        assert within(abs(na - nb) / na, trained_tol, "compiled moe grad norm"), (na, nb)


@pytest.mark.slow
def test_moe_fp8_compiles_a_fixed_number_of_graphs(tmp_path):
    """FP8 tensorwise experts (loop, dynamic scaling): no graph compiled after step 1. Before:
    12, 13, 17, 18 graphs after steps 1-4 (delayed scaling 12, 15, 18, 19; the same
    compiler.disable on the experts' forward fixes both, delayed compiled is
    tests/test_fp8_delayed_compile.py's). Losses within tests/test_fp8_compile.py
    `loss_tolerance` of eager (8 FP8 GEMMs deep, as there)."""
    fp8 = ("--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
           "--model.hidden_size", "128", "--model.intermediate_size", "256", *MOE)
    compiled, _ = _run(tmp_path / "compiled", *fp8, steps=3)
    graphs, breaks = compiled[0][2:]
    assert graphs > 0 and [(g, b) for _, _, g, b in compiled] == [(graphs, breaks)] * 3, \
        compiled
    eager, _ = _run(tmp_path / "eager", *fp8, steps=3, compile_flag="false")
    tol = loss_tolerance(4 * 32, 8)
    for (a, _, _, _), (b, _, _, _) in zip(eager, compiled):
        assert abs(a - b) / a <= tol, (a, b, tol)
