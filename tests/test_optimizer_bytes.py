"""The optimizer phase's bytes, traced on the meta device (`fivefold trace`), against AdamW's
floor; and the trace's byte rules for the ops the phase is made of.

An 8B-shaped step (Llama-3.1-8B, 2 blocks, bf16 with fp32 masters, clipping on): N =
1,486,901,248 parameters. AdamW cannot move fewer than 28 bytes a parameter: read the fp32
master, the bf16 gradient (2), both fp32 moments; write the master, the bf16 parameter (2),
both moments (41.6 GB); a clipped step also reads every gradient once for the norm before
the update can start (2 more: 30, 44.6 GB). The step reaches it on the GPU's paths:

    _foreach_norm          read the bf16 gradients (float64 sums)                    2
    fivefold.adamw_mixed_  read master, bf16 gradient, moments; write them and the
                           bf16 parameter (parallel/adamw_kernel.py)               28
                                                                                   30 (44.6 GB)

On torch's fused AdamW (`adamw_kernel.FUSED_ON_DEVICE = False`, the GPU run's "before") it
is 42 (62.4 GB): torch's kernel takes params, grads and moments of one dtype (CPU: "expected
scalar type Float but found BFloat16"; CUDA: fused_adam_utils.cuh checks every list against
the params' scalar type), so the step casts each gradient to fp32 with the clipping
coefficient in the same pass (`mul`: 6), the kernel reads that copy (28 with the fp32 read)
and the masters are copied into the bf16 parameters (`_foreach_copy_`: 6). At rev a5f9755
it was 56 as the trace then counted (83.3 GB; 50 by the kernels' real traffic): the cast and
the clipping multiply were two passes (6 + 8)."""

import torch

from fivefold.trace import trace_callable, trace_step

EIGHT_B_TWO_BLOCKS = ["--model.preset", "llama-3.1-8b", "--model.num_layers", "2",
                      "--data.tokenizer", "byte", "--train.seq_len", "8192", "--train.gbs",
                      "1", "--parallel.mbs", "1"]
V, H, KV, FFN, LAYERS = 128256, 4096, 1024, 14336, 2
N = 2 * V * H + LAYERS * (2 * H * H + 2 * KV * H + 3 * H * FFN + 2 * H) + H
SCALARS = 4096  # the norm's float64 sums, the coefficient, the step counters: 2,304 bytes


def _optimizer_bytes(monkeypatch, one_pass: bool) -> tuple:
    from fivefold.parallel import adamw_kernel

    monkeypatch.setattr(adamw_kernel, "FUSED_ON_DEVICE", one_pass)
    t = trace_step(EIGHT_B_TWO_BLOCKS, steps=2, planner=False)
    by_op = {}
    for e in t.events:
        if e.kind == "kernel" and e.part == "optimizer":
            by_op[e.op] = by_op.get(e.op, 0) + e.bytes_read + e.bytes_written
    opt = t.part("optimizer")
    assert sum(by_op.values()) == opt.bytes and opt.syncs == 0
    return opt.bytes, by_op


def _within(by_op: dict, budget: dict) -> None:
    for op, per_param in budget.items():
        assert per_param * N <= by_op[op] <= per_param * N + SCALARS, (op, by_op[op] / N)
    # no gradient-sized pass beside those
    assert sum(b for op, b in by_op.items() if op not in budget) <= SCALARS, by_op


def test_optimizer_phase_bytes_budget(monkeypatch):
    total, by_op = _optimizer_bytes(monkeypatch, one_pass=True)
    _within(by_op, {"aten._foreach_norm": 2, "fivefold.adamw_mixed_": 28})
    assert 30 * N <= total <= 30 * N + SCALARS, total / N  # the floor of a clipped step


def test_optimizer_phase_bytes_on_torchs_fused_adamw(monkeypatch):
    total, by_op = _optimizer_bytes(monkeypatch, one_pass=False)
    _within(by_op, {"aten._foreach_norm": 2, "aten.mul": 6, "aten._fused_adamw_": 28,
                    "aten._foreach_copy_": 6})
    assert 42 * N <= total <= 42 * N + SCALARS, total / N


def _adamw_args(n=1000, dtype=torch.float32):
    def lst():
        return [torch.empty(n, device="meta", dtype=dtype)]
    steps = [torch.empty((), device="meta")]
    return lst(), lst(), lst(), lst(), steps


def test_fused_adamw_writes_its_gradients_only_when_it_unscales_them():
    """torch's CUDA kernel stores the gradients back only with a grad_scale (the unscaled
    values), though the op's schema marks them mutable either way."""
    p, g, m, v, steps = _adamw_args()
    kw = dict(lr=1e-3, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8, amsgrad=False,
              maximize=False)
    plain = trace_callable(lambda: torch._fused_adamw_(p, g, m, v, [], steps, **kw), gpu=None)
    scale = torch.ones((), device="meta")
    scaled = trace_callable(lambda: torch._fused_adamw_(p, g, m, v, [], steps, **kw,
                                                        grad_scale=scale), gpu=None)
    (a,), (b,) = [[e for e in t.events if e.kind == "kernel"] for t in (plain, scaled)]
    assert (a.bytes_read, a.bytes_written) == (4 * 4000 + 4, 3 * 4000)
    assert (b.bytes_read, b.bytes_written) == (4 * 4000 + 8, 4 * 4000)


def test_foreach_copy_writes_without_reading_its_targets():
    dst = [torch.empty(100, device="meta", dtype=torch.bfloat16) for _ in range(2)]
    src = [torch.empty(100, device="meta") for _ in range(2)]
    t = trace_callable(lambda: torch._foreach_copy_(dst, src), gpu=None)
    (e,) = [e for e in t.events if e.kind == "kernel"]
    assert (e.bytes_read, e.bytes_written) == (2 * 100 * 4, 2 * 100 * 2)


def test_the_one_pass_adamw_writes_its_parameter_without_reading_it():
    """`fivefold::adamw_mixed_` reads master, gradient (bf16) and moments and writes them
    and the parameter: 28 bytes a value of bf16 gradients and parameters."""
    from fivefold.parallel.adamw_kernel import adamw_mixed_

    n = 1000
    master, avg, avg_sq = (torch.empty(n, device="meta") for _ in range(3))
    grad, param = (torch.empty(n, device="meta", dtype=torch.bfloat16) for _ in range(2))
    scalars = [torch.empty((), device="meta") for _ in range(4)]  # step, f1, f2, found_inf
    t = trace_callable(lambda: adamw_mixed_(master, grad, avg, avg_sq, param, *scalars,
                                            1e-3, 0.9, 0.95, 0.1, 1e-8), gpu=None)
    (e,) = [e for e in t.events if e.kind == "kernel"]
    assert (e.bytes_read, e.bytes_written) == (14 * n + 16, 14 * n)
