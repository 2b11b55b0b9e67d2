"""Delayed tensorwise scaling (lowp/delayed.py) and the rowwise_gw_hp recipe.

Delayed scaling has no outside oracle on a CPU (Transformer Engine is CUDA-only); its
oracles are the references written from the definition:
  - bytes: numerics.fp8.quantize_with_amax (multiply by fmt.max / max(history) in float32,
    clamp, cast) given the same history, and the GEMMs on those operands: bit-equal;
  - float64: each operand quantised with its history's amax and dequantised in float64,
    multiplied in float64: within fp32 accumulation error (1e-5 relative, as the blockwise
    test in tests/test_fp8_linear.py);
  - the first call (no record yet) is dynamic tensorwise, bit for bit.
`end_step` (the trainer's, once per optimizer step) pushes a step's record into the history;
here each `_step` is one optimizer step.
"""

import math

import pytest
import torch
from common import small_config

from fivefold.cli import main
from fivefold.lowp.delayed import add_history, end_step, histories
from fivefold.lowp.linear import FP8Linear, FP8Recipe, fp8_linear
from fivefold.numerics.formats import E4M3, E5M2
from fivefold.numerics.fp8 import fp8_mm, quantize_with_amax
from fivefold.train.trainer import Trainer

DELAYED = FP8Recipe.from_name("tensorwise", scaling="delayed", history_len=4)


def _linear(k=96, n=80, dtype=torch.bfloat16, recipe=DELAYED):
    torch.manual_seed(0)
    m = FP8Linear(k, n, bias=False).to(dtype)
    m.fp8_recipe = recipe
    if recipe.scaling == "delayed":
        add_history(m, recipe.history_len)
    return m


def _step(m, x, g, end=True):
    """One forward and backward; with `end`, the end of an optimizer step (its record
    pushed into the history)."""
    x = x.detach().clone().requires_grad_()
    m.weight.grad = None
    y = m(x)
    y.backward(g)
    if end:
        end_step([m])
    return y.detach(), x.grad, m.weight.grad.clone()


def _amax(t):
    return t.detach().float().abs().max()


def test_first_call_is_dynamic_tensorwise_and_records_each_operand():
    m = _linear()
    x = torch.randn(40, 96).bfloat16() * 3
    g = torch.randn(40, 80).bfloat16() * 1e-4
    y, gx, gw = _step(m, x, g)
    w = m.weight.detach().clone().requires_grad_()
    xd = x.clone().requires_grad_()
    yd = fp8_linear(xd, w, None, FP8Recipe.from_name("tensorwise"))
    yd.backward(g)
    assert torch.equal(y, yd) and torch.equal(gx, xd.grad) and torch.equal(gw, w.grad)
    h = m.fp8_amax_history
    assert h[:, 0].tolist() == [_amax(x).item(), _amax(m.weight).item(), _amax(g).item()]
    assert not h[:, 1:].any()  # newest first; the rest still empty


def test_later_calls_cast_with_the_history_byte_for_byte():
    """Three more steps, one with x four times larger than anything recorded (its codes
    saturate at ±448): outputs and gradients bit-equal to the GEMMs of
    quantize_with_amax's operands, each scale from the history as the cast saw it."""
    m = _linear()
    torch.manual_seed(1)
    hist = [[], [], []]  # the reference's own records
    for step, scale in enumerate((1.0, 1.0, 4.0, 0.5)):
        x = (torch.randn(40, 96) * scale).bfloat16()
        g = (torch.randn(40, 80) * 1e-4).bfloat16()
        w = m.weight.detach()
        y, gx, gw = _step(m, x, g)
        if step == 0:
            amax_x, amax_w, amax_g = _amax(x), _amax(w), _amax(g)  # dynamic on the first
        else:
            amax_x, amax_w, amax_g = (torch.stack(r[-4:]).max() for r in hist)
        xq, wq = quantize_with_amax(x, amax_x), quantize_with_amax(w, amax_w)
        assert torch.equal(y, fp8_mm(xq, wq, torch.bfloat16)), step
        hist[0].append(_amax(x))
        hist[1].append(_amax(w))
        gq = quantize_with_amax(g, amax_g, E5M2)
        wt = quantize_with_amax(w.t(), amax_w)  # the forward's scale: W's codes, moved
        assert torch.equal(gx, fp8_mm(gq, wt, torch.bfloat16)), step
        assert torch.equal(gw, fp8_mm(gq.t(), xq.t(), torch.bfloat16)), step
        hist[2].append(_amax(g))
        if scale == 4.0:
            assert xq.data.float().abs().max() == 448 and (xq.data.float().abs() == 448).sum() > 1
    expected = torch.stack([torch.stack(r[::-1]) for r in hist])  # newest first
    assert torch.equal(m.fp8_amax_history, expected)


def test_evaluation_under_no_grad_leaves_the_history():
    m = _linear()
    _step(m, torch.randn(8, 96).bfloat16(), torch.randn(8, 80).bfloat16())
    before = m.fp8_amax_history.clone()
    with torch.no_grad():
        m(torch.randn(8, 96).bfloat16() * 10)
    assert torch.equal(m.fp8_amax_history, before)


def _q64(t, amax, fmt, pow2=False):
    """Quantise t (any shape) with the multiplier of `amax`, saturate, dequantise: float64."""
    mult = fmt.max / max(amax, 1e-12)
    if pow2:
        mult = 2.0 ** math.floor(math.log2(mult))
    q = (t.double() * mult).clamp(-fmt.max, fmt.max).float().to(fmt.dtype)
    return q.double() / mult


def test_delayed_linear_matches_float64_reference():
    """fp32 in: the second step of a delayed linear against the definition in float64."""
    m = _linear(160, 144, torch.float32)
    torch.manual_seed(2)
    x1, g1 = torch.randn(50, 160), torch.randn(50, 144) * 1e-3
    _step(m, x1, g1)
    x = torch.randn(50, 160) * torch.logspace(-2, 1, 160)  # past x1's amax: saturates
    g = torch.randn(50, 144) * 1e-3
    w = m.weight.detach().clone()
    y, gx, gw = _step(m, x, g)
    ax, aw, ag = (_amax(t).item() for t in (x1, w, g1))
    xq, wq, gq = _q64(x, ax, E4M3), _q64(w, aw, E4M3), _q64(g, ag, E5M2)
    for name, ours, ref in [("y", y, xq @ wq.t()), ("grad_x", gx, gq @ wq),
                            ("grad_w", gw, gq.t() @ xq)]:
        rel = (ours.double() - ref).norm() / ref.norm()
        assert rel < 1e-5, f"{name}: relative error {rel:.2e} against the float64 reference"


def test_rowwise_gw_hp_matches_float64_reference():
    """fp32 in: rows of x and W (power-of-two scales), ∂y by rows and Wᵀ with one
    power-of-two scale for the input gradient; the weight gradient unquantised."""
    torch.manual_seed(3)
    x = torch.randn(70, 160) * torch.logspace(-2, 2, 160)
    w = (torch.randn(96, 160) / 12).requires_grad_()
    g = torch.randn(70, 96) * 1e-3
    xg = x.clone().requires_grad_()
    y = fp8_linear(xg, w, None, FP8Recipe.from_name("rowwise_gw_hp"))
    y.backward(g)

    def rows(t, fmt=E4M3):
        return torch.stack([_q64(r, _amax(r).item(), fmt, pow2=True) for r in t])

    refs = {"y": rows(x) @ rows(w.detach()).t(),
            "grad_x": rows(g) @ _q64(w.detach(), _amax(w).item(), E4M3, pow2=True),
            "grad_w": g.double().t() @ x.double()}
    for name, ours in (("y", y), ("grad_x", xg.grad), ("grad_w", w.grad)):
        rel = (ours.double() - refs[name]).norm() / refs[name].norm()
        assert rel < 1e-5, f"{name}: relative error {rel:.2e} against the float64 reference"


def test_q_k_v_share_one_delayed_cast_of_their_input():
    """The first linear to read x casts and records it; the others reuse that cast (one
    saved FP8 copy, as dynamic scaling keeps) and leave their input row empty."""
    a, b = _linear(), _linear()
    x = torch.randn(16, 96).bfloat16().requires_grad_()
    (a(x).sum() + b(x).sum()).backward()
    end_step([a, b])
    assert a.fp8_amax_history[0, 0] > 0 and not b.fp8_amax_history[0].any()
    assert b.fp8_amax_history[1, 0] > 0 and b.fp8_amax_history[2, 0] > 0


SMALL = ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise", "--train.fp8_scaling",
         "delayed", "--train.fp8_history_len", "3", "--train.gbs", "2", "--train.seq_len", "16"]


def test_resume_keeps_the_amax_histories_bit_exact(tmp_path):
    """4 steps straight against 2 steps, a checkpoint, and 2 resumed steps: the same losses
    and gradient norms bit for bit, and the same histories (they are in the checkpoint)."""
    straight = Trainer(small_config(tmp_path / "a", *SMALL, "--train.steps", "4"), quiet=True)
    want = [straight.train_step() for _ in range(4)]
    want_hist = {k: v.clone() for k, v in histories(straight.model.chunks[0]).items()}
    straight.close()
    first = Trainer(small_config(tmp_path / "b", *SMALL, "--train.steps", "4"), quiet=True)
    [first.train_step() for _ in range(2)]
    first.save_checkpoint()
    first.close()
    resumed = Trainer(small_config(tmp_path / "b", *SMALL, "--train.steps", "4",
                                   "--checkpoint.resume", "latest"), quiet=True)
    assert resumed.step == 2
    got = [resumed.train_step() for _ in range(2)]
    got_hist = histories(resumed.model.chunks[0])
    resumed.close()
    for a, b in zip(want[2:], got):
        assert (a["loss"], a["grad_norm"]) == (b["loss"], b["grad_norm"])
    assert want_hist.keys() == got_hist.keys() and len(want_hist) == 14  # 7 linears x 2
    assert all(torch.equal(want_hist[k], got_hist[k]) for k in want_hist)
    # training state only: an inference load of the same checkpoint leaves them unread
    from fivefold.train.checkpoint import load_model_for_inference

    model, _, _ = load_model_for_inference(str(tmp_path / "b" / "ckpt"))
    assert not histories(model)


@pytest.mark.slow
def test_rowwise_gw_hp_compiled_on_a_cpu_is_bit_equal_to_eager():
    """torch.compile of one rowwise_gw_hp linear, three steps: outputs and gradients
    bit-equal to eager. (Three training steps of the tiny Llama, compiled per block with
    inductor's emulate_precision_casts, gave eager's losses and gradient norms bit for bit
    too; docs/fp8.md. Delayed scaling compiled: tests/test_fp8_delayed_compile.py.)"""
    recipe = FP8Recipe.from_name("rowwise_gw_hp")
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        m = _linear(128, 64, recipe=recipe)
        f = torch.compile(m) if compiled else m
        out = []
        for step in range(3):
            torch.manual_seed(step)
            x = (torch.randn(32, 128) * torch.logspace(-2, 1, 128) * (step + 1)).bfloat16()
            out += list(_step(f, x, torch.randn(32, 64).bfloat16()))
        runs.append(out)
    torch._dynamo.reset()
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_bad_delayed_inputs_give_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    out = ["--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log"),
           "--model.preset", "tiny", "--train.steps", "1", "--train.precision", "fp8"]
    tw = ["--train.fp8_recipe", "tensorwise", "--train.fp8_scaling", "delayed"]
    cases = {
        "delayed rowwise": (["--train.fp8_recipe", "rowwise", "--train.fp8_scaling", "delayed"],
                            "for the tensorwise recipe only"),
        "unknown scaling": (["--train.fp8_scaling", "late"], "train.fp8_scaling = 'late'"),
        "history of 0": ([*tw, "--train.fp8_history_len", "0"], "fp8_history_len = 0"),
        "history too long": ([*tw, "--train.fp8_history_len", "5000"], "1..1024"),
        "history with dynamic": (["--train.fp8_recipe", "tensorwise",
                                  "--train.fp8_history_len", "8"], "applies to"),
        "fp8_allgather without zero 3": ([*tw, "--parallel.fp8_allgather", "true"],
                                         "parallel.fp8_allgather = true needs"),
        "without fp8": (["--train.precision", "bf16", "--train.fp8_scaling", "delayed"],
                        "needs train.precision = 'fp8'"),
    }
    for name, (args, expected) in cases.items():
        code = main(["train", *out, *args])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (name, lines)
        assert len(lines) == 1 and expected in lines[0], (name, lines)
    assert not (tmp_path / "ck").exists() and not (tmp_path / "log").exists()


@pytest.mark.parametrize("name", ["tensorwise_delayed", "rowwise_gw_hp"])
def test_saved_activations_agree_with_the_planner(name):
    """One forward of the tiny Llama: the bytes saved for backward, bf16 against FP8, equal
    the planner's difference (plan/fp8.py) to the byte. Delayed tensorwise saves what
    dynamic tensorwise saves (q, k and v share one cast of their input); rowwise_gw_hp
    saves what bf16 saves (the input, for its bf16 weight gradient)."""
    from fivefold.lowp.convert import convert_to_fp8
    from fivefold.models.init import build_model
    from fivefold.models.presets import preset
    from fivefold.parallel.memory import SavedActivations
    from fivefold.plan.activations import activation_bytes_per_microbatch

    recipe = (FP8Recipe.from_name("tensorwise", scaling="delayed") if name.endswith("delayed")
              else FP8Recipe.from_name(name))
    plan_name = "tensorwise" if name.endswith("delayed") else name
    cfg = preset("tiny")
    tokens = torch.randint(0, cfg.vocab_size, (2, 64))
    saved = {}
    for precision in ("bf16", "fp8"):
        model = build_model(cfg, seed=0, dtype=torch.bfloat16)
        if precision == "fp8":
            convert_to_fp8(model, recipe)
        with SavedActivations(model.parameters()) as meter:
            model(tokens, tokens)
        saved[precision] = meter.bytes
    planned = {p: activation_bytes_per_microbatch(cfg, 2, 64, dtype_bytes=2, fp8_recipe=r)
               for p, r in (("bf16", ""), ("fp8", plan_name))}
    assert cfg.num_layers * (planned["bf16"].layer - planned["fp8"].layer) == (
        saved["bf16"] - saved["fp8"])
    assert (saved["bf16"] == saved["fp8"]) == (name == "rowwise_gw_hp")


def test_a_dynamic_checkpoint_resumes_under_delayed_scaling(tmp_path):
    """Switching to delayed scaling on resume: the dynamic run saved no histories, so they
    start empty (the first cast of each operand is dynamic, as on a fresh run); another
    history length than the checkpoint's is one ModelMismatch line naming the key to set."""
    from fivefold.train.checkpoint_planners import ModelMismatch

    dynamic = [a for a in SMALL if a not in ("delayed", "--train.fp8_scaling",
                                             "--train.fp8_history_len", "3")]
    first = Trainer(small_config(tmp_path / "b", *dynamic, "--train.steps", "4"), quiet=True)
    [first.train_step() for _ in range(2)]
    first.save_checkpoint()
    first.close()
    resumed = Trainer(small_config(tmp_path / "b", *SMALL, "--train.steps", "4",
                                   "--checkpoint.resume", "latest"), quiet=True)
    assert resumed.step == 2 and all(not h.any() for h in
                                     histories(resumed.model.chunks[0]).values())
    resumed.train_step()
    assert all(h.any() for h in histories(resumed.model.chunks[0]).values())
    resumed.save_checkpoint()
    resumed.close()
    longer = [a if a != "3" else "5" for a in SMALL]
    with pytest.raises(ModelMismatch, match="fp8_history_len = 3"):
        Trainer(small_config(tmp_path / "b", *longer, "--train.steps", "4",
                             "--checkpoint.resume", "latest"), quiet=True)
