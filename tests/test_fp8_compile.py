"""FP8 under torch.compile on a CPU (inductor's C++ kernels): the FP8 linear compiles and
computes what it computes eagerly; `train.compile = true` with the tensorwise and rowwise
recipes trains with eager's losses. Blockwise is refused on a CPU (tests/test_fp8_train.py).

Before the GEMMs became custom ops (numerics/fp8_ops.py) the compile failed:
InductorError `_scaled_mm: mat_b must be col_major`."""

import math

import pytest
import torch
from common import small_config

from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.train.trainer import Trainer


def _linear(f, recipe):
    torch.manual_seed(0)
    x = (torch.randn(64, 128) * torch.logspace(-2, 1, 128)).to(torch.bfloat16)
    w = (torch.randn(256, 128) / 8).to(torch.bfloat16).requires_grad_()
    g = torch.randn(64, 256).to(torch.bfloat16)
    x.requires_grad_()
    y = f(x, w, recipe)
    y.backward(g)
    return y.detach(), x.grad, w.grad


def _eager(x, w, recipe):
    return fp8_linear(x, w, None, recipe)


@pytest.mark.parametrize("name", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_fp8_linear_compiled_is_bit_equal_to_eager(name):
    """bf16 in, one FP8 linear forward and backward, compiled against eager: the output and
    both gradients bit-equal. No tolerance: the compiled graph computes the amax (exact),
    the multiplier in float64, x · m in float32 and the cast as eager does, and each GEMM is
    the same opaque custom op."""
    torch._dynamo.reset()
    recipe = FP8Recipe.from_name(name)
    eager = _linear(_eager, recipe)
    compiled = _linear(torch.compile(_eager), recipe)
    torch._dynamo.reset()
    for what, a, b in zip(("y", "dx", "dW"), eager, compiled):
        assert torch.equal(a, b), (name, what, float((a.float() - b.float()).abs().max()))


def _steps(tmp_path, name, compile_flag, steps=3):
    cfg = small_config(tmp_path, "--train.compile", compile_flag, "--train.precision", "fp8",
                       "--train.fp8_recipe", name, "--model.hidden_size", "128",
                       "--model.intermediate_size", "256")
    trainer = Trainer(cfg, quiet=True)
    return [trainer.train_step() for _ in range(steps)]


def loss_tolerance(tokens: int, depth: int) -> float:
    """Compiled against eager with inductor's defaults. Inductor keeps a fused kernel's
    bf16 intermediates in float32 and rounds once; eager rounds after every op: tensors
    entering an FP8 cast differ by up to one bf16 rounding, relative d = 2^-8. An E4M3 code
    (relative spacing q = 2^-3) then flips with probability ~ d/q, by q: per element a
    relative error of RMS sqrt(d·q) = 2^-5.5. A GEMM's output carries it norm-wise (its K
    terms' errors are independent; tests/tolerances.py item 2), and the `depth` FP8 GEMMs
    between the input and the logits add in quadrature. A token's loss moves by at most
    its logits' relative error at this scale (logits of a fresh model are far below its
    loss ~ ln V), the mean over `tokens` averages independent terms, λ = 2, √2 for two
    runs, and Adam's gain of 2 (tests/tolerances.py item 3) for the steps after the first."""
    per_element = math.sqrt(2.0**-8 * 2.0**-3)
    return 2 * math.sqrt(2) * 2 * per_element * math.sqrt(depth / tokens)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tensorwise", "rowwise"])
def test_fp8_trains_compiled_with_eagers_losses(tmp_path, monkeypatch, name):
    """`--train.compile true --train.precision fp8 --train.fp8_recipe NAME` on a CPU, 3 steps
    of 4 x 32 tokens through 2 blocks, against eager:
      - with inductor's `emulate_precision_casts` (bf16 intermediates rounded as eager
        rounds them) every loss and gradient norm is bit-equal: the compiled FP8 path is
        the same arithmetic;
      - with inductor's defaults (tensorwise) the losses are within `loss_tolerance` (8 FP8
        GEMMs deep: q/k/v, o, gate/up, down per block)."""
    import torch._inductor.config as inductor_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core machine: no OpenMP threads spinning
    try:
        eager = _steps(tmp_path / "eager", name, "false")
        torch._dynamo.reset()
        # inductor's defaults: tensorwise only (a compile is tens of seconds on 2 cores;
        # rowwise's is measured in docs/fp8.md)
        compiled = _steps(tmp_path / "compiled", name, "true") if name == "tensorwise" else eager
        torch._dynamo.reset()
        monkeypatch.setattr(inductor_config, "emulate_precision_casts", True)
        emulated = _steps(tmp_path / "emulated", name, "true")
        torch._dynamo.reset()
    finally:
        torch.set_num_threads(threads)
    tol = loss_tolerance(4 * 32, 8)
    for a, b, c in zip(eager, compiled, emulated):
        assert (a["loss"], a["grad_norm"]) == (c["loss"], c["grad_norm"]), (name, a, c)
        assert abs(a["loss"] - b["loss"]) / a["loss"] <= tol, (name, a["loss"], b["loss"], tol)
