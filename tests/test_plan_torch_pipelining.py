"""What torch.distributed.pipelining and FSDP2 hold on a pipeline rank, and the fp32 buffers of
DTensor's loss-parallel backward (plan/torch_pipelining.py, plan/activations.py), each pinned
to a hand computation from its definition in the torch source."""

import dataclasses

from fivefold.models.presets import preset
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.comm_buffers import dp_comm_buffer_bytes
from fivefold.plan.conventions import get_convention
from fivefold.plan.hardware import Assumptions
from fivefold.plan.layout import Layout, Workload, check_layout
from fivefold.plan.memory import memory_items
from fivefold.plan.torch_pipelining import stage_buffer_bytes

LLAMA8B = preset("llama-3.1-8b")


def test_loss_parallel_backward_holds_three_fp32_vocabulary_buffers():
    """`(zeros_like(x) + exp(x)) * grad_output` beside the saved log-softmax x: zeros, exp and
    their sum, 3·T·V/tp·4 bytes. Llama 3.1 70B at mbs 16, seq 8192, tp 8: T = 131,072 tokens,
    V/tp = 128,256/8 = 16,032. Plain F.cross_entropy (or tp 1) keeps two."""
    model = preset("llama-3.1-70b")
    kw = {"tp": 8, "sp": True, "recompute": "full", "chunked_loss": False}
    parallel = activation_bytes_per_microbatch(model, 16, 8192, loss_parallel=True, **kw)
    plain = activation_bytes_per_microbatch(model, 16, 8192, **kw)
    assert parallel.loss_backward == 3 * 131_072 * 16_032 * 4 == 25_216_155_648
    assert plain.loss_backward == 2 * 131_072 * 16_032 * 4
    assert parallel.logits == plain.logits  # the saved output is the same
    one_rank = {"recompute": "full", "chunked_loss": False}
    assert (activation_bytes_per_microbatch(model, 1, 8192, loss_parallel=True, **one_rank)
            .loss_backward == activation_bytes_per_microbatch(model, 1, 8192, **one_rank)
            .loss_backward)


def test_torchtitan_convention_plans_loss_parallel_and_torch_pipelining():
    work = get_convention("torchtitan").apply_workload(Workload(LLAMA8B, 4096, 16))
    assert work.loss_parallel and work.pp_runtime == "torch"
    assert not Workload(LLAMA8B, 4096, 16).loss_parallel  # fivefold's engine: chunked loss
    assert Workload(LLAMA8B, 4096, 16).pp_runtime == "engine"


# Llama 3.1 8B, seq 4096, pp 4 under 1F1B, mbs 1, gbs 8: m = 8 micro-batches, no TP, so a
# stage's boundary tensor is 1 · 4096 · 4096 · 2 bytes; a micro-batch's logits 4096 · 128,256
# · 2. Alive at the peak under 1F1B: min(m, p − r).
B = 4096 * 4096 * 2
LOGITS = 4096 * 128_256 * 2


def _buffers(runtime: str, rank: int) -> float:
    work = Workload(LLAMA8B, 4096, 8, pp_runtime=runtime)
    lay = Layout(pp=4, mbs=1)
    return stage_buffer_bytes(work, lay, rank, (float(min(8, 4 - rank)),))


def test_stage_buffers_at_the_runs_torch():
    """torch 1963fc8: per micro-batch an activation receive buffer (not the first stage), a
    gradient receive buffer (not the last), every output kept (logits on the last) and every
    input gradient (not the first) until the step ends; the alive micro-batches' receive
    buffers are their first layer's saved input, already counted."""
    assert _buffers("torch-2412", 0) == (8 + 8) * B  # gradient buffers, outputs
    assert _buffers("torch-2412", 1) == (5 + 8 + 8 + 5) * B  # alive 3
    assert _buffers("torch-2412", 3) == (7 + 7) * B + 8 * LOGITS  # alive 1
    assert _buffers("engine", 1) == 0.0


def test_stage_buffers_at_todays_torch():
    """torch 2.13: the receive buffers as before, outputs kept until their backward (the last
    stage's logits until the step ends), input gradients released after their send."""
    assert _buffers("torch", 0) == (8 + 4) * B
    assert _buffers("torch", 1) == (5 + 8 + 3) * B
    assert _buffers("torch", 3) == 7 * B + 8 * LOGITS


def test_stage_buffers_replace_the_engines_two_receive_buffers():
    """In the itemised peak the pipelining buffers take the place of the engine's one
    activation and one gradient receive buffer (no ZeRO here, so nothing else differs)."""
    lay = Layout(pp=4, mbs=1)
    items = {rt: memory_items(Workload(LLAMA8B, 4096, 8, pp_runtime=rt), lay, Assumptions(),
                              1)[0]["comm_buffers"] for rt in ("engine", "torch-2412")}
    assert items["torch-2412"] - items["engine"] == 26 * B - 2 * B


def test_deferred_fsdp_sync_passes_one_units_bf16_gradient():
    """Parameters kept gathered and FSDP's sync deferred to the last micro-batch: per unit only
    its bf16 gradient passes before FSDP2 adds it to the fp32 accumulator. Llama 3.1 8B, dp 2,
    pp 2: a block has 4096·(2·4096 + 2·1024) + 3·4096·14336 + 2·4096 = 218,112,000
    parameters; rank 0's largest unit is the embedding, 128,256·4096 = 525,336,576; rank 1's
    the final norm and head, 4,096 + 525,336,576."""
    conv = get_convention("torchtitan")
    work = conv.apply_workload(Workload(LLAMA8B, 4096, 16))
    lay = conv.apply_layout(Layout(dp=2, pp=2, mbs=2))
    assert dp_comm_buffer_bytes(work, lay, 0) == 2 * 525_336_576
    assert dp_comm_buffer_bytes(work, lay, 1) == 2 * (4_096 + 525_336_576)
    engine = dataclasses.replace(work, pp_runtime="engine")  # fivefold's ZeRO-3 units
    assert dp_comm_buffer_bytes(engine, lay, 0) > dp_comm_buffer_bytes(work, lay, 0)


def test_pipelined_fsdp_accumulates_fp32_gradients_even_with_one_microbatch():
    """The stage defers the sync for every backward and runs FSDP's post-backward after the
    last, so even one micro-batch leaves the stage's unsharded gradient upcast to fp32: rank 0
    of Llama 3.1 8B at pp 2 holds 16 blocks and the embedding, 16·218,112,000 + 525,336,576
    = 4,015,128,576 parameters, 4 bytes each. fivefold's engine reduce-scatters a single
    micro-batch's gradients bucket by bucket instead."""
    conv = get_convention("torchtitan")
    work = conv.apply_workload(Workload(LLAMA8B, 4096, 16))
    lay = conv.apply_layout(Layout(dp=2, pp=2, mbs=8))  # m = 1
    assert work.num_microbatches(lay) == 1
    assert memory_items(work, lay, Assumptions(), 0)[0]["grad_buffer"] == 4_015_128_576 * 4
    engine = dataclasses.replace(work, pp_runtime="engine")
    assert memory_items(engine, lay, Assumptions(), 0)[0]["grad_buffer"] == 0.0


def test_unknown_pp_runtime_is_refused():
    bad = check_layout(Workload(LLAMA8B, 4096, 16, pp_runtime="deepspeed"), Layout())
    assert bad == ["pp_runtime = 'deepspeed' is not one of engine, torch, torch-2412"]
