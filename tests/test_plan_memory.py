"""Planner memory: model states (ZeRO paper), activations (Korthikanti et al. 2022), pipelines."""

import pytest

from fivefold.models.presets import preset
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.hardware import Assumptions
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import memory_items
from fivefold.plan.model_states import (
    bytes_per_param,
    model_state_bytes,
    rank_param_counts,
    shard_model_states,
)
from fivefold.plan.placement import inflight_microbatches

GB = 1e9


# ---- model states ---------------------------------------------------------------------


@pytest.mark.parametrize("zero, paper_gb, exact_gb", [
    (0, 120.0, 120.0),  # (2 + 2 + 12)Ψ
    (1, 31.4, 31.40625),  # 4Ψ + 12Ψ/64
    (2, 16.6, 16.640625),  # 2Ψ + 14Ψ/64
    (3, 1.9, 1.875),  # 16Ψ/64
])
def test_zero_paper_figure_1(zero, paper_gb, exact_gb):
    """Rajbhandari et al. 2020, Fig. 1: Ψ = 7.5B, N_d = 64, K = 12, GB = 1e9."""
    states = shard_model_states(7.5e9, bytes_per_param("bf16", "adamw"), zero, 64)
    assert states.total / GB == pytest.approx(exact_gb, rel=1e-12)
    assert states.total / GB == pytest.approx(paper_gb, abs=0.05)  # the paper's rounding


def test_bytes_per_param_layouts():
    assert bytes_per_param("bf16").total == 16
    assert bytes_per_param("bf16", grad_dtype_bytes=4).total == 18  # Megatron
    assert bytes_per_param("bf16", fp32_grad_accum=True).total == 20  # nanotron
    fp32 = bytes_per_param("fp32")
    assert (fp32.param, fp32.grad, fp32.master, fp32.optimizer) == (4, 4, 0, 8)
    assert bytes_per_param("bf16").describe(1, 64).endswith("ZeRO-1 over 64: 4.19 B/param")


def test_rank_params_add_up_to_the_model():
    """Summed over pipeline and tensor ranks, the shards are the whole (untied) model."""
    model = preset("llama-3.1-70b")
    for layout in (Layout(pp=4), Layout(pp=5, tp=4), Layout(pp=2, schedule="interleaved",
                                                             virtual_stages=4, tp=8)):
        total = sum(sum(rank_param_counts(model, layout, r).values()) for r in range(layout.pp))
        # RMSNorm weights (2 per layer and the final one) are replicated on every tp rank
        replicated_norms = (2 * model.num_layers + 1) * model.hidden_size * (layout.tp - 1)
        assert total * layout.tp - replicated_norms == model.num_params()


def test_model_state_bytes_per_rank():
    model = preset("llama-3.1-8b")
    n = model.num_params()
    plain = model_state_bytes(model)
    got = (plain.params, plain.grads, plain.master, plain.optimizer)
    assert got == (2 * n, 2 * n, 4 * n, 8 * n)
    z3 = model_state_bytes(model, dp=4, cp=2, zero=3)  # sharded over dp·cp = 8
    assert z3.total == pytest.approx(16 * n / 8, rel=1e-12)
    off = model_state_bytes(model, dp=8, zero=1, offload=True)
    assert off.master == off.optimizer == 0 and off.cpu == pytest.approx(12 * n / 8)


# ---- activations: Korthikanti et al. 2022, Table 2, GPT-3 (a=96, h=12288, s=2048) -------

GPT3 = preset("gpt3-175b")
S, B_, H, A = 2048, 1, 12288, 96
SBH = S * B_ * H


def korthikanti(tp=1, sp=False, recompute="none", flash=False):
    # The paper's Megatron keeps the sequence shard of column-parallel inputs under SP.
    act = activation_bytes_per_microbatch(GPT3, B_, S, tp=tp, sp=sp, recompute=recompute,
                                          dtype_bytes=2, flash=flash, dropout=True,
                                          sp_saves_gathered=False)
    return act.layer - act.layer_terms.get("norm_stats", 0.0), act.layer


@pytest.mark.parametrize("tp, sp, recompute, formula", [
    (1, False, "none", SBH * (34 + 5 * A * S / H)),  # eq. 1
    (8, False, "none", SBH * (10 + 24 / 8 + 5 * A * S / (H * 8))),  # TP
    (8, True, "none", SBH / 8 * (34 + 5 * A * S / H)),  # TP + SP
    (8, False, "selective", SBH * (10 + 24 / 8)),  # TP + selective
    (8, True, "selective", 34 * SBH / 8),  # TP + SP + selective
    (1, False, "full", 2 * SBH),  # full recompute keeps the layer input
    (8, False, "full", 2 * SBH),
])
def test_korthikanti_table_2(tp, sp, recompute, formula):
    without_stats, with_stats = korthikanti(tp, sp, recompute)
    assert without_stats == pytest.approx(formula, rel=1e-12)
    # the fp32 LayerNorm statistics the paper leaves out are < 0.1% of the layer
    assert with_stats == pytest.approx(formula, rel=1e-3)


def test_korthikanti_attention_term_is_80_for_gpt3():
    """5as/h = 80 against 34 (Korthikanti §4.1): selective recompute saves 70%."""
    full, _ = korthikanti()
    selective, _ = korthikanti(recompute="selective")
    assert 5 * A * S / H == 80
    assert 1 - selective / full == pytest.approx(1 - 34 / 114, rel=1e-12)  # 70.2%


def test_flash_llama_is_linear_in_sequence_length_math_is_not():
    model = preset("llama-3.1-8b")
    for flash, ratio in ((True, 2.0), (False, None)):
        a1 = activation_bytes_per_microbatch(model, 1, 4096, flash=flash).layer
        a2 = activation_bytes_per_microbatch(model, 1, 8192, flash=flash).layer
        if ratio:
            assert a2 / a1 == pytest.approx(ratio, rel=1e-12)
        else:
            assert a2 / a1 > 2.5  # the s² scores dominate at 8k


def test_llama_terms_swiglu_gqa():
    """SwiGLU saves 4·T·f·B (gate in, SiLU out, up, product); K and V shrink by kv/heads."""
    model = preset("llama-3.1-8b")  # h 4096, f 14336, 32 heads, 8 kv heads
    t, B = 4096, 2
    act = activation_bytes_per_microbatch(model, 1, t, dtype_bytes=B, flash=True)
    assert act.layer_terms["mlp_hidden"] == 4 * t * 14336 * B
    assert act.layer_terms["k"] == act.layer_terms["q"] / 4
    assert act.layer_terms["attn_core"] == t * 4096 * B + t * 32 * 4  # output + fp32 lse
    # The chunked loss keeps the gradients of the head's input and weight, not T·V logits.
    assert act.logits == t * 4096 * B + model.vocab_size * 4096 * B
    tp8 = activation_bytes_per_microbatch(model, 1, t, tp=8, flash=True)
    assert tp8.layer_terms["k"] == t * 128 * B  # one kv head per rank at tp = kv heads


# ---- pipelines ------------------------------------------------------------------------


def test_inflight_microbatches():
    assert inflight_microbatches(Layout(pp=8, schedule="afab"), 32, 0) == 32
    assert inflight_microbatches(Layout(pp=8), 32, 0) == 8
    assert inflight_microbatches(Layout(pp=8), 32, 5) == 3
    assert inflight_microbatches(Layout(pp=8), 4, 0) == 4
    # Korthikanti §4.2.3: interleaving multiplies rank 0's activations by 1 + (p−1)/(p·v)
    lay = Layout(pp=8, schedule="interleaved", virtual_stages=4)
    assert inflight_microbatches(lay, 32, 0) == pytest.approx(8 * (1 + 7 / 32), rel=1e-12)


def test_logits_live_as_long_as_the_head_ranks_microbatches():
    """The last rank's logits: one micro-batch's under 1F1B, all m under AFAB (chunked loss);
    under ZB-H1 the split backward materialises them, and p micro-batches keep the fp32
    logits' gradient while their graph waits for W."""
    model = preset("llama-3.2-1b")
    work = Workload(model, seq_len=4096, gbs=32)
    act = activation_bytes_per_microbatch(model, 1, 4096)
    one = act.final_norm + act.logits + act.loss
    for schedule, live in (("1f1b", 1), ("afab", 32)):
        items, _ = memory_items(work, Layout(pp=4, schedule=schedule), Assumptions(), rank=3)
        assert items["logits_loss"] == pytest.approx(live * one + act.loss_backward), schedule
    items, _ = memory_items(work, Layout(pp=4, schedule="zb"), Assumptions(), rank=3)
    tokens, bf16 = 4096, 2
    split = act.final_norm + tokens * model.hidden_size * bf16 + tokens * model.vocab_size * 4
    assert items["logits_loss"] == pytest.approx(4 * split)


def test_first_stage_holds_all_layers_worth_under_1f1b():
    """Korthikanti eq. 5: with 1F1B, stage 0 holds p micro-batches × L/p layers = L layers."""
    model = preset("llama-3.1-70b")
    work = Workload(model, seq_len=4096, gbs=64)
    layout = Layout(pp=8, tp=8, sp=True, recompute="selective")
    items, _ = memory_items(work, layout, Assumptions(), rank=0)
    act = activation_bytes_per_microbatch(model, 1, 4096, tp=8, sp=True, recompute="selective")
    working_set = act.layer  # selective: the attention core of one layer (flash: out + lse)
    expected = act.layer * model.num_layers + 8 * (act.embedding + act.rope_tables)
    extra = items["activations"] - expected
    assert 0 < extra < working_set
