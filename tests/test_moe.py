"""The mixture-of-experts block on one process: router, grouped experts, dispatch, losses."""

import pytest
import torch
import torch.nn.functional as F

from fivefold.models.init import build_model
from fivefold.models.moe import (
    GroupedExperts,
    MoE,
    Router,
    capacity_mask,
    grouped_mm_available,
    moe_layers,
    set_aux_grad_scale,
    update_expert_bias,
)
from fivefold.models.presets import preset
from fivefold.parallel.recompute import apply_recompute


def nano_moe(**kw):
    base = dict(num_experts=4, experts_top_k=2, moe_intermediate_size=16)
    return preset("nano").replace(**{**base, **kw})


def dense_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Σ_k w_k · expert_k(x) token by token, straight from the definition."""
    flat = x.reshape(-1, x.shape[-1])
    _, _, idx, w = moe.router(flat)
    ex = moe.experts
    rows = []
    for t in range(flat.shape[0]):
        acc = torch.zeros(flat.shape[1])
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = F.silu(ex.w_gate[e] @ flat[t]) * (ex.w_up[e] @ flat[t])
            acc = acc + w[t, j] * (ex.w_down[e] @ h)
        rows.append(acc)
    out = torch.stack(rows)
    if moe.shared_expert is not None:
        shared = moe.shared_expert(flat)
        if moe.shared_expert_gate is not None:
            shared = torch.sigmoid(moe.shared_expert_gate(flat)) * shared
        out = out + shared
    return out.view_as(x)


def test_router_ties_go_to_the_lower_expert_and_weights_renormalise():
    r = Router(4, 6, 3, norm_topk_prob=True)
    with torch.no_grad():
        r.weight.zero_()  # every score equal: a pure tie
    _, scores, idx, w = r(torch.randn(5, 4))
    assert idx.tolist() == [[0, 1, 2]] * 5
    assert torch.allclose(w, torch.full_like(w, 1 / 3))
    r.norm_topk_prob = False
    assert torch.allclose(r(torch.randn(5, 4))[3], torch.full((5, 3), 1 / 6))


def test_expert_bias_changes_the_choice_not_the_weights():
    torch.manual_seed(0)
    r = Router(8, 4, 1, score_func="sigmoid", norm_topk_prob=False, scaling_factor=2.5)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(6, 8)
    _, scores, idx, w = r(x)
    assert torch.equal(w, 2.5 * scores.gather(1, idx))
    r.expert_bias[3] = 10.0  # expert 3 wins every token, weighted by its unbiased score
    _, scores, idx, w = r(x)
    assert idx.flatten().tolist() == [3] * 6
    assert torch.equal(w[:, 0], 2.5 * scores[:, 3])


def test_group_limited_routing_picks_only_from_the_best_groups():
    torch.manual_seed(1)
    r = Router(8, 8, 2, score_func="sigmoid", num_groups=4, topk_groups=1)
    torch.nn.init.normal_(r.weight)
    x = torch.randn(20, 8)
    _, scores, idx, _ = r(x)
    best_group = scores.view(20, 4, 2).sum(-1).argmax(-1)  # top-2 of a pair = the pair's sum
    assert torch.equal(idx // 2, best_group[:, None].expand(20, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_equals_the_per_expert_loop_forward_and_backward(dtype):
    if not grouped_mm_available(torch.zeros(1, dtype=dtype), 8, 16):
        pytest.skip(f"this torch has no grouped matmul for {dtype} on CPU")
    torch.manual_seed(0)
    ex = {impl: GroupedExperts(4, 8, 16, impl) for impl in ("grouped_mm", "loop")}
    ex["loop"].load_state_dict(ex["grouped_mm"].state_dict())
    for e in ex.values():
        for p in e.parameters():
            torch.nn.init.normal_(p)
        e.load_state_dict(ex["grouped_mm"].state_dict())
        e.to(dtype)
    counts = torch.tensor([3, 0, 5, 2])  # an expert with no token
    x = torch.randn(10, 8, dtype=dtype)
    out = {}
    for impl, e in ex.items():
        xi = x.clone().requires_grad_()
        y = e(xi, counts)
        y.sum().backward()  # an expanded (stride-0) incoming gradient
        out[impl] = (y, xi.grad, *(p.grad for p in e.parameters()))
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # summation order; bf16: its rounding
    for a, b in zip(out["grouped_mm"], out["loop"]):
        assert float((a - b).detach().float().norm() / b.detach().float().norm()) <= tol
    assert torch.count_nonzero(ex["grouped_mm"].w_gate.grad[1]) == 0


@pytest.mark.parametrize("shared_gate", [False, True])
def test_moe_block_equals_the_definition(shared_gate):
    cfg = nano_moe(shared_expert_intermediate_size=24, shared_expert_gate=shared_gate)
    model = build_model(cfg, seed=0)
    moe = model.layers[1].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(2, 7, cfg.hidden_size)
    with torch.no_grad():
        assert torch.allclose(moe(x), dense_reference(moe, x), atol=1e-6, rtol=0)


def test_which_layers_are_moe():
    cfg = nano_moe(num_layers=6, moe_first_dense=1, moe_layer_freq=2)
    kinds = [isinstance(b.mlp, MoE) for b in build_model(cfg, 0).layers]
    assert kinds == [False, True, False, True, False, True]
    assert cfg.num_moe_layers == 3


def test_expert_init_is_per_expert_and_layout_free():
    a = build_model(nano_moe(), 5).layers[0].mlp.experts.w_gate
    b = build_model(nano_moe(num_experts=6), 5).layers[0].mlp.experts.w_gate
    assert torch.equal(a, b[:4])  # expert j is drawn from its own name


def test_balance_loss_is_one_when_even_and_split_invariant():
    """The per-sequence aux losses over a batch equal the sum over any split of it, and so do
    their gradients when each part is weighted by loss_scale / sequences of the whole batch."""
    cfg = nano_moe(aux_loss_coeff=0.1, z_loss_coeff=0.01)
    torch.manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (4, 16))

    def run(parts):
        model = build_model(cfg, seed=1)
        set_aux_grad_scale(model, 1.0 / 4)
        for p in parts:
            (model(p, p) / tokens.numel()).backward()
        return model

    whole, split = run([tokens]), run(list(tokens.split(1)))
    for (n, p), q in zip(whole.named_parameters(), split.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-7), n
    for a, b in zip(moe_layers(whole), moe_layers(split)):
        assert torch.allclose(a.aux_sums, b.aux_sums, rtol=1e-6)
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
    router_grad = whole.layers[0].mlp.router.weight.grad
    no_aux = build_model(cfg.replace(aux_loss_coeff=0.0, z_loss_coeff=0.0), seed=1)
    (no_aux(tokens, tokens) / tokens.numel()).backward()
    assert not torch.allclose(router_grad, no_aux.layers[0].mlp.router.weight.grad)

    moe = MoE(cfg)
    e, k, s = cfg.num_experts, cfg.experts_top_k, 8
    idx = torch.arange(s * k).view(s, k) % e  # every expert gets s·k/e copies
    scores = torch.full((s, e), 1 / e)
    balance, _ = moe._losses(torch.zeros(s, e), scores, idx, 1, s)
    assert float(balance) == pytest.approx(1.0)


def test_full_recomputation_counts_tokens_once_and_keeps_gradients():
    cfg = nano_moe(aux_loss_coeff=0.1)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    plain, recomputed = build_model(cfg, 2), apply_recompute(build_model(cfg, 2), "full")
    for m in (plain, recomputed):
        m(tokens, tokens).backward()
    for p, q in zip(plain.parameters(), recomputed.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-6, atol=1e-8)
    for a, b in zip(moe_layers(plain), moe_layers(recomputed)):
        assert torch.equal(a.tokens_per_expert, b.tokens_per_expert)
        assert float(a.tokens_per_expert.sum()) == tokens.numel() * cfg.experts_top_k


def test_eval_forward_records_nothing():
    model = build_model(nano_moe(), 0).eval()
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long))
    assert all(float(m.tokens_per_expert.sum()) == 0 for m in moe_layers(model))


def test_capacity_keeps_the_heaviest_copies_per_sequence_and_expert():
    idx = torch.tensor([[0, 1], [0, 1], [0, 2], [0, 3]])  # expert 0 gets 4 copies
    w = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.7, 0.3], [0.5, 0.5]])
    keep = capacity_mask(idx, w, seq_len=4, num_experts=4, factor=1.0)  # capacity 2
    assert keep[:, 0].tolist() == [False, True, True, False]  # 0.9 and 0.7; the tie loses
    assert keep[:, 1].all()


def test_expert_bias_update_moves_load_to_the_idle_experts():
    layer = MoE(nano_moe())
    layer.reset_buffers()
    update_expert_bias([layer], torch.tensor([[10.0, 0.0, 5.0, 5.0]]), rate=0.01)
    assert layer.router.expert_bias.tolist() == pytest.approx([-0.01, 0.01, 0.0, 0.0])
