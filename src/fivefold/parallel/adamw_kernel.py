"""AdamW over fp32 masters from compute-dtype gradients, one pass: a torch custom op.

torch's fused AdamW takes params, grads and moments of one dtype (its CUDA kernel checks
every list against the params' scalar type: aten/src/ATen/native/cuda/fused_adam_utils.cuh;
on a CPU, torch 2.13: "expected scalar type Float but found BFloat16"). With bf16 gradients
and fp32 masters the step then reads an fp32 copy of each gradient (made: 2 + 4 bytes a
value, read: 4) and copies the masters into the bf16 parameters afterwards (4 + 2): 42 bytes
a parameter with the norm's 2, where AdamW needs 28 (read master, bf16 gradient, both
moments; write them and the bf16 parameter). `adamw_mixed_` reads the gradient in its own
dtype, multiplies it by the step's pending factors (1/loss scale, the clipping coefficient:
parallel/step_grads.py, in that order, each product rounded to fp32 as the copy's are) and,
given the parameter, writes it too: 28 bytes a value, 30 with the norm.

The update is AdamW's (Loshchilov & Hutter 2019) as torch's fused kernel orders it
(fused_adam_utils.cuh `adam_math`, ADAMW):

    p ← p − lr·λ·p;   m ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²
    p ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + ε)

in fp32, each scalar (lr, β, 1 − β, lr·λ, ε: formed in double on the host) rounded to fp32
once (torch's kernel forms some products with its double arguments in double: a value may
differ from it in its last bits; tests/test_adamw_kernel.py holds the difference to that
error model). The step count t is the state's fp32 `step`, incremented here unless the step
is skipped (`found_inf` 1.0: nothing else is written either, as torch's kernel skips).

Where: a CUDA device with Triton, or Triton's interpreter (`TRITON_INTERPRET=1`, fp32 and
fp16 gradients: its bf16 arithmetic is broken), eager; without Triton the op runs the same
arithmetic in torch ops. The meta device's trace (fivefold.trace) sees one op. A CPU step
keeps torch's fused AdamW (step_grads.step_torch), so its results stay bit for bit.
"""

from __future__ import annotations

import torch

from fivefold.numerics.kernel_support import triton_usable

try:  # Triton is optional (see models/loss_kernel.py)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the installation
    triton = None

# The one-pass step where it applies; False: torch's fused AdamW on fp32 copies (a GPU
# benchmark's "before").
FUSED_ON_DEVICE = True
BLOCK = 1024


if triton is not None:

    @triton.jit
    def _adamw_kernel(master_ptr, grad_ptr, avg_ptr, avg_sq_ptr, param_ptr, step_ptr,
                      f1_ptr, f2_ptr, skip_ptr, logs_ptr, n, lr, beta1, beta2, rest1, rest2,
                      decay, eps, WRITE_PARAM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        mask = inside & (tl.load(skip_ptr + offs * 0, mask=inside, other=1.0) == 0.0)
        t = tl.load(step_ptr).to(tl.float64)  # already counted (the op adds 1 first)
        # β^t in float64 from log β in float64 (`logs`: a Python float would arrive as fp32)
        bc1 = (1.0 - tl.exp(t * tl.load(logs_ptr))).to(tl.float32)
        bc2 = (1.0 - tl.exp(t * tl.load(logs_ptr + 1))).to(tl.float32)
        step_size = tl.div_rn(lr, bc1)  # IEEE division and square root, no contraction:
        bc2_sqrt = tl.sqrt_rn(bc2)  # each operation rounds once, as written
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = g * tl.load(f1_ptr)
        g = g * tl.load(f2_ptr)
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
        m = tl.load(avg_ptr + offs, mask=mask, other=0.0)
        v = tl.load(avg_sq_ptr + offs, mask=mask, other=0.0)
        p = p - decay * p
        m = beta1 * m + rest1 * g
        v = beta2 * v + rest2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(avg_ptr + offs, m, mask=mask)
        tl.store(avg_sq_ptr + offs, v, mask=mask)
        if WRITE_PARAM:
            tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)


_LOGS: dict = {}


def log_betas(beta1: float, beta2: float, device: torch.device) -> torch.Tensor:
    """[log β1, log β2] in float64 on `device`, made once (no copy to the device a step)."""
    key = (beta1, beta2, str(device))
    if key not in _LOGS:
        _LOGS[key] = torch.tensor([beta1, beta2], dtype=torch.float64).log().to(device)
    return _LOGS[key]


def adamw_reference_(master, grad, exp_avg, exp_avg_sq, param, step, f1, f2, found_inf,
                     lr: float, beta1: float, beta2: float, weight_decay: float,
                     eps: float) -> None:
    """The op's arithmetic in torch ops (the kernel's oracle, and its path without Triton)."""
    keep = found_inf > 0
    t, logs = step.double(), log_betas(beta1, beta2, step.device)
    bc1 = (1 - torch.exp(t * logs[0])).float()
    bc2 = (1 - torch.exp(t * logs[1])).float()
    f32 = torch.float32
    g = grad.float() * f1.to(f32) * f2.to(f32)
    p = master - torch.tensor(lr * weight_decay, dtype=f32) * master
    m = torch.tensor(beta1, dtype=f32) * exp_avg + torch.tensor(1 - beta1, dtype=f32) * g
    v = torch.tensor(beta2, dtype=f32) * exp_avg_sq + torch.tensor(1 - beta2, dtype=f32) * g * g
    # whole divisors: torch divides by a broadcast value as a multiplication by its reciprocal
    # (another rounding), which the kernel does not
    denom = v.sqrt() / bc2.sqrt().expand_as(v).contiguous() + torch.tensor(eps, dtype=f32)
    step_size = torch.tensor(lr, dtype=f32).expand_as(m) / bc1.expand_as(m).contiguous()
    p = p - step_size * m / denom
    master.copy_(torch.where(keep, master, p))
    exp_avg.copy_(torch.where(keep, exp_avg, m))
    exp_avg_sq.copy_(torch.where(keep, exp_avg_sq, v))
    if param is not None:
        param.copy_(torch.where(keep, param, p.to(param.dtype)))


@torch.library.custom_op("fivefold::adamw_mixed_",
                         mutates_args=("master", "exp_avg", "exp_avg_sq", "param"))
def adamw_mixed_(master: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                 exp_avg_sq: torch.Tensor, param: torch.Tensor | None, step: torch.Tensor,
                 f1: torch.Tensor, f2: torch.Tensor, found_inf: torch.Tensor, lr: float,
                 beta1: float, beta2: float, weight_decay: float, eps: float) -> None:
    """One AdamW step of `master` (fp32, contiguous) from `grad` (any float dtype, its
    shape) times f1 then f2 (0-d fp32), with the fp32 moments; `param` (or None) gets the
    new master in its dtype (written only). `step` (0-d fp32): the step's number, counted
    by the caller (`step_mixed`); nothing is written where `found_inf` is 1.0."""
    if not (triton_usable(master.device) and master.is_contiguous()
            and grad.is_contiguous() and (param is None or param.is_contiguous())):
        return adamw_reference_(master, grad, exp_avg, exp_avg_sq, param, step, f1, f2,
                                found_inf, lr, beta1, beta2, weight_decay, eps)
    n = master.numel()
    if n:
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            master, grad, exp_avg, exp_avg_sq, param if param is not None else master, step,
            f1, f2, found_inf, log_betas(beta1, beta2, master.device), n, lr, beta1, beta2,
            1 - beta1, 1 - beta2, lr * weight_decay, eps,
            WRITE_PARAM=param is not None, BLOCK=BLOCK, enable_fp_fusion=False)


@adamw_mixed_.register_fake
def _(master, grad, exp_avg, exp_avg_sq, param, step, f1, f2, found_inf, lr, beta1, beta2,
      weight_decay, eps):
    return None


def applies(optimizer, grads) -> bool:
    """Whether `step_mixed` takes this step: torch's fused AdamW (decoupled decay, no
    amsgrad or maximize, a float lr) over fp32 masters on a device other than the CPU, whose
    gradients are copies (`grads.copy`) of sources on that device, at most two factors."""
    if not FUSED_ON_DEVICE or not grads.copy or grads.device.type == "cpu":
        return False
    if not isinstance(optimizer, torch.optim.AdamW) or len(grads.factors) > 2:
        return False
    if not all(isinstance(f, torch.Tensor) for f in grads.factors):
        return False
    for g in optimizer.param_groups:
        if not g.get("fused") or g.get("amsgrad") or g.get("maximize") or not isinstance(
                g["lr"], float):
            return False
    return all(s.device == grads.device for s in grads.sources) and all(
        m.dtype == torch.float32 and m.is_contiguous() for m in grads.masters)


def step_mixed(optimizer: torch.optim.AdamW, grads, found_inf: torch.Tensor | None) -> set:
    """One step of `optimizer` over its masters in `grads` (step_grads.StepGrads) by
    `adamw_mixed_`, the states torch's AdamW keeps (fp32 `step` on the device, `exp_avg`,
    `exp_avg_sq`), so checkpoints and a later torch step see no difference. Each master's
    parameter (`grads.params`, when given) is written too; returns their indices."""
    dev = grads.device
    ones = torch.ones((), device=dev)
    factors = [*grads.factors, ones, ones][:2]
    found = found_inf if found_inf is not None else torch.zeros((), device=dev)
    written = set()
    for group in optimizer.param_groups:
        mine = [(grads.index_of[id(m)], m) for m in group["params"] if id(m) in grads.index_of]
        steps = []
        for _, m in mine:
            state = optimizer.state[m]
            if not state:  # as torch's AdamW makes them (fused: the step on the device)
                state["step"] = torch.zeros((), dtype=torch.float32, device=m.device)
                state["exp_avg"] = torch.zeros_like(m, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(m, memory_format=torch.preserve_format)
            steps.append(state["step"])
        if not mine:
            continue
        # the group's steps counted in one launch, and a skipped one taken back in another,
        # as torch's fused AdamW counts them
        torch._foreach_add_(steps, 1.0)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))
        beta1, beta2 = group["betas"]
        for i, m in mine:
            state = optimizer.state[m]
            param = grads.params[i] if grads.params is not None else None
            adamw_mixed_(m, grads.sources[i], state["exp_avg"], state["exp_avg_sq"], param,
                         state["step"], factors[0], factors[1], found, group["lr"],
                         float(beta1), float(beta2), group["weight_decay"], group["eps"])
            if param is not None:
                written.add(i)
    return written
