"""How many graphs `train.compile` makes, and that it makes no more after the first step.

Full recomputation (`--train.recompute full`): the checkpoint wrapper sets the replay tape, a
`ContextVar` dynamo cannot trace; compiling the block's call graph-broke there (torch 2.13:
0 graphs, 4 breaks over 3 steps of 2 blocks, the blocks eager). The block's own forward is
compiled inside the checkpoint instead (parallel/recompute.py `compile_inside`): one graph
shared by the blocks, no break, and the losses and gradient norms bit-equal to the compiled
run without recomputation (the same compiled forward runs again in backward).

Selective recomputation (`--train.recompute selective`): the attention core's checkpoint is
traced into the compiled block (torch's checkpoint becomes a region the partitioner
recomputes), without the tape; before, 5 graphs and 6 breaks over 3 steps of 2 blocks.
`recompute = auto`'s per-operator policies likewise, a graph per policy (before: an
InternalTorchDynamoError on the checkpoint's `context_fn`).

Routed experts: the per-expert loops (the FP8 experts', and the plain loop a trace in fp32
or fp16 takes) run eagerly (`torch.compiler.disable`), since their rows per expert change
every step. Before, FP8 tensorwise compiled 12, 13, 17, 18 graphs after steps 1-4 (a
graph for new expert sizes, step after step), and an fp32 model failed to compile at all
(the grouped matmul's meta kernel is bf16-only). Now the graph count is fixed after the
first step: the routing's `bincount` and the dispatch still break the graph (data-dependent
sizes), the same breaks every step."""

from collections import Counter
from pathlib import Path

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


def _run(tmp_path, *overrides, steps=3, compile_flag="true", saved=None, keep=None):
    """Per step: (loss, grad_norm, graphs compiled so far, graph breaks so far). With a
    Counter `saved`: after the steps, what one more micro-batch's forward saves for backward,
    as (shape, dtype) -> count, the parameters left out. With `keep`: keep(trainer) last."""
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
        if saved is not None:
            _count_saved(trainer, saved)
            out.append(counters["stats"]["unique_graphs"])  # no graph for the extra forward
        if keep is not None:  # whatever else the caller reads from the trainer after the steps
            out.append(keep(trainer))
    finally:
        trainer.close()
        torch._dynamo.reset()
    return out, checkpointed


def _count_saved(trainer, saved) -> None:
    params = {p.untyped_storage()._cdata for _, p in trainer.model.named_parameters()}

    def pack(t):
        if t.untyped_storage()._cdata not in params:
            saved[(tuple(t.shape), t.dtype)] += 1
        return t

    tokens = torch.arange(32).remainder(7)[None]  # one micro-batch: 1 x seq_len, as trained
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = trainer.model.chunks[0](tokens, tokens)
    loss.backward()  # frees what the forward saved


@pytest.fixture(scope="module")
def plain_fp32(tmp_path_factory):
    """fp32 compiled without recomputation: its steps and what its forward saves."""
    saved = Counter()
    plain, checkpointed = _run(tmp_path_factory.mktemp("plain"), saved=saved)
    assert checkpointed == [False, False]
    assert [(g, b) for _, _, g, b in plain[:3]] == [(1, 0)] * 3 and plain[3] == 1, plain
    return plain[:3], saved


def test_full_recompute_compiles_one_graph_with_the_same_losses(tmp_path, plain_fp32):
    full, checkpointed = _run(tmp_path / "full", "--train.recompute", "full")
    assert [(g, b) for _, _, g, b in full] == [(1, 0)] * 3, full  # none after step 1 either
    assert checkpointed == [True, True]  # still recomputed: the wrapper stays
    assert [(loss, norm) for loss, norm, _, _ in full] == \
        [(loss, norm) for loss, norm, _, _ in plain_fp32[0]]


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp8", marks=pytest.mark.slow)])
def test_selective_recompute_compiles_without_breaks_and_saves_less(tmp_path, precision,
                                                                    request):
    """`--train.recompute selective`: the attention core's checkpoint is traced into the
    block's one graph (parallel/recompute.py); before, the replay tape's `ContextVar` broke
    it: 5 graphs, 6 breaks over 3 steps (fp32 and FP8 alike). The same losses and gradient
    norms, bit for bit, as compiled without recomputation: the same compiled forward, and
    the backward recomputes SDPA on the same inputs, a kernel that gives the same bits.
    Memory: per block the compiled forward no longer saves the attention's output and its
    log-sum-exp (1 x heads x 32 tokens; the output in the activations' dtype, the
    log-sum-exp in float32), and saves one CPU generator state (5,056 bytes) instead: torch
    tags SDPA as a random op (its dropout), so the partitioner keeps the state to replay it,
    as eager's checkpoint keeps it too (outside the saved-tensor hooks). At these tiny
    shapes that state outweighs the 4.5 KiB dropped; at a real layer's it is noise.
    FP8: tensorwise, dynamic scaling, hidden 128."""
    over = ("--train.recompute", "selective")
    if precision == "fp8":
        over += ("--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
                 "--model.hidden_size", "128", "--model.intermediate_size", "256")
    kept, dropped = Counter(), Counter()
    sel, checkpointed = _run(tmp_path / "selective", *over, saved=dropped)
    assert checkpointed == [False, False]  # the core is checkpointed, not the block
    assert [(g, b) for _, _, g, b in sel[:3]] == [(1, 0)] * 3 and sel[3] == 1, sel
    if precision == "fp32":
        plain, kept = request.getfixturevalue("plain_fp32")
    else:
        plain, _ = _run(tmp_path / "plain", *over[2:], saved=kept)
        assert [(g, b) for _, _, g, b in plain[:3]] == [(1, 0)] * 3 and plain[3] == 1, plain
    assert [(loss, norm) for loss, norm, _, _ in sel[:3]] == \
        [(loss, norm) for loss, norm, _, _ in plain[:3]]
    heads, width = 4, 128 if precision == "fp8" else 32
    dtype = torch.bfloat16 if precision == "fp8" else torch.float32
    rng = tuple(torch.get_rng_state().shape)
    assert kept - dropped == Counter({((1, heads, 32, width // heads), dtype): 2,
                                      ((1, heads, 32), torch.float32): 2}), kept - dropped
    assert dropped - kept == Counter({(rng, torch.uint8): 2}), dropped - kept


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


@pytest.mark.parametrize("recompute", ["none", pytest.param("full", marks=pytest.mark.slow)])
def test_moe_bf16_compiles_one_graph_and_counts_each_token_once(tmp_path, recompute):
    """bf16, 2 MoE blocks of 4 experts (the grouped matmul, traced): one graph, no break.
    Before (f9d3bbc), 10 graphs and 6 breaks over 3 steps: the routing's `bincount` (a
    data-dependent length, now a fixed-length scatter-add, models/moe.py
    `expert_counts`), the grouped matmul's probe
    filling its cache inside the trace (the next block's graph compiled again; now probed
    before compiling) and the statistics asking whether this forward is a recomputation
    (`torch._C._current_graph_task_id`, untraceable; a layer outside any checkpoint skips
    it). Under full recomputation it still asks (the recomputation must run the graph its
    forward ran): 5 graphs, 4 breaks (before: 10, 6). Either way each step's statistics
    count every token's k copies once per layer (4 x 32 tokens, k = 2), none twice in the
    recomputation."""
    compiled, _ = _run(tmp_path, "--train.precision", "bf16", "--train.recompute", recompute,
                       *MOE, keep=lambda trainer: [
                           float(b.mlp.tokens_per_expert.sum())
                           for b in trainer.model.chunks[0].layers])
    want = (1, 0) if recompute == "none" else (5, 4)
    assert [(g, b) for _, _, g, b in compiled[:3]] == [want] * 3, compiled
    assert compiled[3] == [4 * 32 * 2.0] * 2, compiled[3]


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


def _auto_blocks(policies, saved=None):
    """The tests' tiny model (2 blocks) under `policies` (recompute = auto's per-layer
    choices), its blocks compiled as train.compile does: one forward and backward of a
    1 x 32 micro-batch; its loss, parameter gradients, graphs, breaks, and per block what
    the block's forward saves for backward (parameters left out)."""
    from fivefold.models.init import build_model
    from fivefold.models.presets import preset
    from fivefold.parallel.apply import compile_blocks
    from fivefold.parallel.recompute import apply_layer_policies

    torch._dynamo.reset()
    counters.clear()
    cfg = preset("tiny").replace(hidden_size=32, intermediate_size=64, num_layers=2,
                                 num_heads=4, num_kv_heads=2)
    model = build_model(cfg, 0)
    if policies:
        apply_layer_policies(model, policies)
    compile_blocks([model])
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    tokens = torch.arange(32).remainder(7)[None]
    h = model.embed_tokens(tokens)
    cos, sin = model.rotary(torch.arange(32), h.dtype)
    per_block = []
    for block in model.layers:
        per_block.append(Counter())

        def pack(t, into=per_block[-1]):
            if t.untyped_storage()._cdata not in params:
                into[(tuple(t.shape), t.dtype)] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = block(h, cos, sin)
    loss = model.loss_fn(model.norm(h), model.output_weight(), tokens)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    out = (float(loss), grads, counters["stats"]["unique_graphs"],
           sum(counters["graph_break"].values()), per_block)
    torch._dynamo.reset()
    return out


def test_auto_keep_policies_compile_and_keep_what_they_name():
    """recompute = auto's per-operator policies (`keep S`: the block checkpointed, the
    outputs of the operators S kept) under train.compile. Before, dynamo failed on the
    checkpoint's `context_fn` (InternalTorchDynamoError: a closure, not a partial), and a
    partial holding the policy closure let a block of another policy reuse the first
    block's graph. Now: a graph per policy, no break; loss and gradients bit-equal to the
    compiled blocks without recomputation (the same ops; the backward recomputes the rest);
    and each block saves its inputs (x, cos, sin), the generator state (see
    `test_selective_recompute...`) and the outputs of exactly the matrix products it keeps:
    v (32 tokens x 16), q (32 x 32), up (32 x 64)."""
    from types import SimpleNamespace as Policy

    loss, grads, graphs, breaks, _ = _auto_blocks(None)
    assert (graphs, breaks) == (1, 0)
    got = _auto_blocks([Policy(kind="keep", kept=("v",)), Policy(kind="keep", kept=("q", "up"))])
    assert got[2:4] == (2, 0), got[2:4]
    assert got[0] == loss
    assert all(torch.equal(got[1][n], g) for n, g in grads.items())
    rng = tuple(torch.get_rng_state().shape)
    common = Counter({((1, 32, 32), torch.float32): 1, ((32, 8), torch.float32): 2,
                      (rng, torch.uint8): 1})
    assert got[4][0] == common + Counter({((32, 16), torch.float32): 1}), got[4][0]
    assert got[4][1] == common + Counter({((32, 32), torch.float32): 1,
                                          ((32, 64), torch.float32): 1}), got[4][1]


@pytest.mark.parametrize("layer", ["expert_all_to_all", "fp8_linear"])
def test_a_keep_policy_that_cannot_be_traced_leaves_the_block_eager(layer):
    """A block whose checkpoint must replay what expert parallelism's all-to-alls received
    (the replay tape, which dynamo cannot trace), or that holds FP8 linears (torch 2.13
    failed to trace their autograd function inside the policy's checkpoint:
    InternalTorchDynamoError), is not compiled under a keep policy: compile_inside takes it
    (True) and leaves it as it is; the other block goes to block.compile() (False)."""
    from types import SimpleNamespace as Policy

    from fivefold.models.init import build_model
    from fivefold.models.presets import preset
    from fivefold.parallel.recompute import apply_layer_policies, compile_inside

    cfg = preset("tiny").replace(hidden_size=32, intermediate_size=64, num_layers=2,
                                 num_heads=4, num_kv_heads=2)
    model = build_model(cfg, 0)
    if layer == "expert_all_to_all":
        model.layers[1].mlp.dispatcher = Policy(replays_tape=True)  # as parallel/expert.py's
    else:
        from fivefold.lowp.convert import apply_fp8

        cfg_fp8 = small_config(Path("unused"), "--train.precision", "fp8")
        apply_fp8(model.layers[1], cfg_fp8.train, torch.device("cpu"))
        assert any(getattr(m, "fp8_recipe", None) for m in model.layers[1].modules())
    apply_layer_policies(model, [Policy(kind="keep", kept=("v",))] * 2)
    assert [compile_inside(b) for b in model.layers] == [False, True]
