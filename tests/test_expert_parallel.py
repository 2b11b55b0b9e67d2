"""Expert parallelism: the all-to-all dispatcher reproduces the local one.

A stand-in MoE layer (softmax router, top-2 of 4 SwiGLU experts stacked as the engine's
`w_gate`/`w_up`/`w_down`, a local dispatcher that permutes, runs and combines) computes the
reference on one process; at ep 2 and ep 4 each rank routes its own slice of the tokens.
Outputs and input gradients ≤ 1e-6, parameter gradients ≤ 1e-5, relative (‖a − b‖ / ‖b‖;
experts: each rank's block; router: summed over the ranks). Under full recomputation the all-to-alls
are replayed, not sent again: the ledger is the same as without it.
"""

import torch
import torch.nn.functional as F
from harness import run_ranks
from torch import nn

from fivefold.parallel.expert import apply_expert_parallel
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.recompute import _checkpointed

E, H, INTER, K = 4, 8, 16, 2


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.num_experts = E
        self.w_gate = nn.Parameter(torch.randn(E, INTER, H) * 0.3)
        self.w_up = nn.Parameter(torch.randn(E, INTER, H) * 0.3)
        self.w_down = nn.Parameter(torch.randn(E, H, INTER) * 0.3)

    def forward(self, x, counts):
        outs = []
        for e, rows in enumerate(x.split(counts.tolist())):
            h = F.silu(rows @ self.w_gate[e].t()) * (rows @ self.w_up[e].t())
            outs.append(h @ self.w_down[e].t())
        return torch.cat(outs)


def local_dispatch(x, expert_idx, weights, experts):
    t, k = expert_idx.shape
    order = torch.argsort(expert_idx.flatten(), stable=True)
    counts = torch.bincount(expert_idx.flatten(), minlength=experts.num_experts)
    y = experts(x[order // k], counts)
    y = torch.empty_like(y).index_copy(0, order, y).view(t, k, -1)
    return (y.float() * weights[..., None]).sum(1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = Experts()
        self.dispatcher = local_dispatch

    def forward(self, x):
        flat = x.reshape(-1, H)
        weights, expert_idx = self.router(flat).float().softmax(-1).topk(K, -1)
        return self.dispatcher(flat, expert_idx, weights, self.experts).view(x.shape)


def layer_and_tokens():
    torch.manual_seed(0)
    return MoE(), torch.randn(4, 6, H)


def loss_of(y):  # position-dependent, so every output element's gradient differs
    return (y * torch.arange(y.numel()).view_as(y)).sum()


def ep_rank(rank, world, recompute):
    layer, x = layer_and_tokens()
    dims = ParallelDims(dp=world, ep=world, rank=rank)
    dims.build_groups()
    dims.ledger.enabled = True
    apply_expert_parallel(layer, dims)
    mine = x.chunk(world)[rank].clone().requires_grad_()
    y = (_checkpointed(layer.forward) if recompute else layer.forward)(mine)
    loss_of(y).backward()
    ledger = [(e.op, e.group, e.dtype, e.bytes) for e in dims.ledger.entries]
    return y.detach(), mine.grad, {n: p.grad for n, p in layer.named_parameters()}, ledger


def close(a, b, tol):
    return float((a - b).norm() / b.norm()) <= tol


def test_all_to_all_dispatch_matches_local_experts():
    for world in (2, 4):
        layer, x = layer_and_tokens()
        x.requires_grad_()
        pieces = [layer(c) for c in x.chunk(world)]
        sum(loss_of(y) for y in pieces).backward()
        ledgers, tokens = {}, x.shape[0] * x.shape[1] // world
        for recompute in (False, True):
            results = run_ranks(ep_rank, world, recompute)
            assert close(torch.cat([r[0] for r in results]), torch.cat(pieces).detach(), 1e-6)
            assert close(torch.cat([r[1] for r in results]), x.grad, 1e-6)
            for name, p in layer.named_parameters():
                if "experts" in name:  # rank r holds experts [r·E/ep, (r+1)·E/ep)
                    got = torch.cat([r[2][name] for r in results])
                else:
                    got = sum(r[2][name] for r in results)
                assert close(got, p.grad, 1e-5), (world, name)
            ledgers[recompute] = [r[3] for r in results]
            for ledger in ledgers[recompute]:
                # counts, dispatch, combine; in backward the combine's and dispatch's reverse
                assert [(op, g, dtype) for op, g, dtype, _ in ledger] == (
                    [("all_to_all", "ep", "int64")] + [("all_to_all", "ep", "float32")] * 4)
                assert ledger[0][3] == E * 8
                assert ledger[1][3] == ledger[3][3] == tokens * K * H * 4  # own routed rows
            combined = sum(ledger[2][3] for ledger in ledgers[recompute])
            assert combined == world * tokens * K * H * 4  # the experts' rows: all, once
        assert ledgers[True] == ledgers[False]  # recomputation sends nothing again
