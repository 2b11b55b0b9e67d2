"""AdamW over fp32 masters from compute-dtype gradients in one pass (parallel/adamw_kernel.py):
the Triton kernel in the interpreter against its torch arithmetic and against torch's fused
AdamW, its skip, and the bytes a traced step moves with it and without it."""

import textwrap

import torch
from common import run_interpreted

from fivefold.parallel import adamw_kernel

# Three steps of one tensor with weight decay, the two pending factors (1/loss scale, then a
# clipping coefficient), a gradient of each dtype the interpreter handles (fp32, fp16; its
# bf16 is broken), the parameter written in the gradient's dtype; then a skipped step.
KERNEL_CHECK = textwrap.dedent("""
    import json, torch
    from fivefold.parallel import adamw_kernel as K
    torch.manual_seed(0)
    lr, b1, b2, wd, eps = 1e-3, 0.9, 0.95, 0.1, 1e-8
    f1, f2 = torch.tensor(2.0**-3), torch.tensor(0.3719)
    out = {}
    for dtype in (torch.float32, torch.float16):
        n = 5000  # five programs, the last one partly masked
        master = torch.randn(n)
        states = {k: [master.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())]
                  for k in ("kernel", "reference", "torch")}
        param = master.to(dtype)
        ok = torch.tensor(0.0)
        worst, ulps, moments_equal = 0.0, 0.0, True
        for step in range(1, 4):
            g = (torch.randn(n) * 8e-2 * torch.logspace(-4, 0, n)).to(dtype)
            for k, (p, m, v, t) in states.items():
                if k == "torch":  # torch's fused AdamW on the fp32 copy the step made before
                    t += 1
                    copy = g.float() * f1 * f2
                    torch._fused_adamw_([p], [copy], [m], [v], [], [t], lr=lr, beta1=b1,
                                        beta2=b2, weight_decay=wd, eps=eps, amsgrad=False,
                                        maximize=False)
                    continue
                t += 1
                fn = K.adamw_mixed_ if k == "kernel" else K.adamw_reference_
                fn(p, g, m, v, param if k == "kernel" else None, t, f1, f2, ok,
                   lr, b1, b2, wd, eps)
            kern, ref, tor = states["kernel"], states["reference"], states["torch"]
            # the interpreter's numpy against torch's ops: the same operations in the same
            # order, each rounded once; a quotient may still land one ulp apart
            moments_equal &= all(torch.equal(a, b) for a, b in zip(kern[1:], ref[1:]))
            ulps = max(ulps, float(((kern[0] - ref[0]).abs()
                                    / (2.0**-23 * ref[0].abs() + 2.0**-24 * lr)).max()))
            # |kernel - torch| in units of (2 ulp of p + 2^-20 lr) after each step
            unit = 2.0**-22 * tor[0].abs() + 2.0**-20 * lr
            worst = max(worst, float(((kern[0] - tor[0]).abs() / unit).max()))
        r = {"moments_equal_reference": moments_equal, "ulps_vs_reference": ulps,
             "worst_vs_torch": worst,
             "param_is_master": torch.equal(param, states["kernel"][0].to(dtype)),
             # in ulps of the larger term each moment adds up (β·m or (1 - β)·g)
             "moments_vs_torch": max(
                 float(((kern[i] - tor[i]).abs() / (2.0**-24 * scale)).max())
                 for i, scale in ((1, tor[1].abs() + copy.abs()),
                                  (2, tor[2].abs() + copy.square())))}
        p, m, v, t = (x.clone() for x in states["kernel"])
        before = [p.clone(), m.clone(), v.clone(), param.clone()]
        g = torch.full((n,), float("nan")).to(dtype)
        K.adamw_mixed_(p, g, m, v, param, t, f1, f2, torch.tensor(1.0), lr, b1, b2, wd, eps)
        r["skip_leaves_all"] = all(torch.equal(a, b) for a, b in zip(before, [p, m, v, param]))
        out[str(dtype)] = r
    print(json.dumps(out))
""")


def test_kernel_in_the_interpreter():
    """Against the torch arithmetic it stands for (`adamw_reference_`, the path without
    Triton): the moments bit for bit, the master within 2 units of 2^-23·|p| + 2^-24·lr a
    step (a quotient of the interpreter's numpy may round apart from torch's, and the
    difference carries into the next step): 6 after 3. Against torch's fused AdamW on the
    fp32 copy of the same gradient, within the error model: torch forms some products in
    double and in another order, and each step's final subtraction rounds, so a step may
    move p by up to 2 ulps of p plus a few ulps of the update (|update| ≤ lr·(1 + λ|p|),
    its relative error a few 2^-24): after 3 steps 3 units of 2^-22·|p| + 2^-20·lr; the
    moments within 6 half-ulps of |m| + |g| (|v| + g²) a step, 18 after 3 (torch's CPU
    kernel contracts or lerps where this one rounds each product). The parameter written
    is the master rounded to its dtype, and a step with found_inf = 1.0 writes nothing."""
    result = run_interpreted(["-c", KERNEL_CHECK], timeout=300)
    for dtype, r in result.items():
        assert r["moments_equal_reference"] and r["ulps_vs_reference"] <= 6.0, (dtype, r)
        assert r["worst_vs_torch"] <= 3.0, (dtype, r)
        assert r["moments_vs_torch"] <= 18, (dtype, r)
        assert r["param_is_master"] and r["skip_leaves_all"], (dtype, r)


def test_the_cpu_keeps_torchs_fused_adamw():
    """A CPU step never takes the one-pass kernel (its results stay torch's, bit for bit)."""
    from fivefold.parallel.step_grads import StepGrads

    master = torch.zeros(8, requires_grad=True)
    opt = torch.optim.AdamW([master], fused=True)
    grads = StepGrads([torch.zeros(8, dtype=torch.bfloat16)], torch.device("cpu"), copy=True,
                      masters=[master])
    assert not adamw_kernel.applies(opt, grads)
