"""Blockwise FP8 on cuBLASLt's scaled matmul (numerics/fp8_kernel.py), proven as far as a
CPU can, and on the GPU where one is there.

On CPU: the exact operands the kernel path passes (FP8 data, scale tensors with their
strides, the L4 padding, the token padding) are
  - accepted by torch's own shape/stride checks of `_scaled_mm_v2` (its meta function, run
    on fake CUDA tensors), while the block scales without the L4 padding are refused;
  - multiplied by a float64 reading of the kernel's contract that takes each scale from its
    storage by the kernel's leading dimension: equal to the emulation and to a float64
    product of the dequantised operands;
  - driven through the FP8 linear's forward, input gradient and weight gradient with that
    reading standing in for the kernel call: within bf16 output rounding of the float64
    reference of tests/test_fp8_linear.py.
On a GPU with the kernel (compute capability 9.x): the same float64 reference test with the
real kernel (skipped elsewhere, with the reason; bench/gpu.py runs it as an item).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_fp8_linear import _blocks64, _tiles64

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.lowp import convert
from fivefold.lowp.linear import FP8Recipe, fp8_linear
from fivefold.numerics import fp8_kernel
from fivefold.numerics.formats import E4M3
from fivefold.numerics.fp8 import blockwise_mm, quantize
from fivefold.numerics.scaling import expand_scale

# bf16 output rounding: the kernel path asks for bf16 output, unit roundoff 2^-8 per
# element, so at most 2^-8 in relative norm; plus fp32 accumulation (~sqrt(K)·2^-24 per
# dot product, under 1e-5 here) and the tensor core's promotion every 128 products.
BF16_OUT_TOL = 2.0**-8 + 1e-4


def _operands(m, k, n, b_kind, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(m, k) * torch.logspace(-2, 2, k)  # channels of very different ranges
    w = torch.randn(n, k)
    return quantize(x, E4M3, "tiles"), quantize(w, E4M3, b_kind)


# (M, K, N): forward-like (tiles x blocks, K/128 = 3: L4 pads to 4; 150 tokens padded to
# 256), and weight-gradient-like (tiles x tiles, K = 150 tokens padded to 256)
CASES = [(150, 384, 256, "blocks"), (256, 150, 384, "tiles")]


@pytest.mark.parametrize("m,k,n,b_kind", CASES)
def test_kernel_operands_have_the_documented_layout(m, k, n, b_kind):
    a, b = _operands(m, k, n, b_kind)
    ops = fp8_kernel.kernel_operands(a, b)
    mp, kp = math.ceil(m / 128) * 128, math.ceil(k / 128) * 128
    kb, l4 = kp // 128, math.ceil(kp // 128 / 4) * 4
    assert ops["mat_a"].shape == (mp, kp) and ops["mat_a"].stride() == (kp, 1)  # row-major
    assert ops["mat_b"].shape == (kp, n) and ops["mat_b"].stride() == (1, kp)  # column-major
    assert ops["scale_a"].shape == (mp, kb) and ops["scale_a"].stride() == (1, mp)
    if b_kind == "blocks":
        assert ops["scale_b"].shape == (l4, n // 128) and ops["scale_b"].stride() == (1, l4)
        assert torch.equal(ops["scale_b"][:kb], b.scale.t())  # the weight's block scales
        assert (ops["scale_b"][kb:] == 1.0).all()  # the padding rows
    else:
        assert ops["scale_b"].shape == (n, kb) and ops["scale_b"].stride() == (1, n)
    # padded tokens are zero FP8 rows/columns: they add nothing to any product
    assert not ops["mat_a"][m:].float().any() and not ops["mat_a"][:, k:].float().any()


def _dequantize64(q) -> torch.Tensor:
    return q.data.double() * expand_scale(q.scale, q.shape, q.granularity).double()


@pytest.mark.parametrize("m,k,n,b_kind", CASES)
def test_kernel_contract_equals_the_emulation_and_float64(m, k, n, b_kind):
    a, b = _operands(m, k, n, b_kind, seed=1)
    ops = fp8_kernel.kernel_operands(a, b)
    kernel = fp8_kernel.reference_scaled_mm(ops)[:m]
    exact = _dequantize64(a) @ _dequantize64(b).t()
    emulated = blockwise_mm(a, b).double()
    # both float64 with the same scales: only summation order differs
    assert ((kernel - exact).norm() / exact.norm()).item() < 1e-13
    # the emulation sums 128 products in fp32 per slice: ~sqrt(128)·2^-24 relative
    assert ((kernel - emulated).norm() / exact.norm()).item() < 1e-6


def test_block_scales_without_l4_padding_are_caught_twice():
    a, b = _operands(128, 384, 256, "blocks", seed=2)  # K/128 = 3, L4 = 4
    ops = fp8_kernel.kernel_operands(a, b)
    ops["scale_b"] = b.scale.t()  # (3, 2) with strides (1, 3): what the padding replaces
    with pytest.raises(ValueError, match="read past"):  # the kernel would read other memory
        fp8_kernel.reference_scaled_mm(ops)
    if fp8_kernel.scaled_mm_api() != "F.scaled_mm":
        pytest.skip(f"torch {torch.__version__} has no F.scaled_mm for its own layout check")
    with pytest.raises(RuntimeError, match="L4"):
        _fake_cuda_call(ops)


def _fake_cuda_call(ops: dict) -> torch.Tensor:
    """The kernel call on fake CUDA tensors of the same shapes, strides and dtypes: torch's
    meta function for _scaled_mm_v2 checks them as the CUDA op would, without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = {key: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                if isinstance(t, torch.Tensor) else t for key, t in ops.items()}
        return fp8_kernel.call_scaled_mm(fake)


@pytest.mark.parametrize("m,k,n,b_kind", CASES)
def test_kernel_call_passes_torchs_own_checks(m, k, n, b_kind):
    if fp8_kernel.scaled_mm_api() != "F.scaled_mm":
        pytest.skip(f"torch {torch.__version__} has no F.scaled_mm (meta check not run)")
    ops = fp8_kernel.kernel_operands(*_operands(m, k, n, b_kind))
    out = _fake_cuda_call(ops)
    assert tuple(out.shape) == (ops["mat_a"].shape[0], n) and out.dtype == torch.bfloat16


def test_feature_detection(monkeypatch):
    ok, why = fp8_kernel.kernel_support(torch.device("cpu"))
    assert not ok and "CUDA-only" in why
    if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"):  # torch 2.10+
        assert fp8_kernel.scaled_mm_api() == "F.scaled_mm"
    monkeypatch.delattr(F, "scaled_mm", raising=False)  # a torch without the public API
    if hasattr(torch, "_scaled_mm_v2"):
        assert fp8_kernel.scaled_mm_api() == "torch._scaled_mm_v2"
        monkeypatch.delattr(torch, "_scaled_mm_v2")
    assert fp8_kernel.scaled_mm_api() is None
    # on CUDA the missing API is the reason, found before any device query
    ok, why = fp8_kernel.kernel_support(torch.device("cuda"))
    assert not ok and "has neither F.scaled_mm nor _scaled_mm_v2" in why
    with pytest.raises(ValueError, match="not a multiple of 128"):
        fp8_kernel.kernel_operands(*_operands(128, 256, 192, "blocks"))
    assert fp8_kernel.kernel_shape_problem(256, 384) is None
    assert "(256, 320)" in fp8_kernel.kernel_shape_problem(256, 320)


def test_probe_accepts_the_contract_and_rejects_a_wrong_result(monkeypatch):
    """The probe's own logic on CPU: with the float64 contract (rounded to bf16, as the
    kernel writes) in place of cuBLASLt it says yes; with a kernel that reads the block
    scales in another order, or raises, it says no, in one line."""
    probe, cpu = fp8_kernel._probe.__wrapped__, torch.device("cpu")

    def contract(ops, out_dtype=torch.bfloat16):
        return fp8_kernel.reference_scaled_mm(ops).to(out_dtype)

    monkeypatch.setattr(fp8_kernel, "call_scaled_mm", contract)
    assert probe(cpu)[0]

    def misread(ops, out_dtype=torch.bfloat16):  # block scales read row by row
        sb = ops["scale_b"]
        wrong = sb.as_strided(sb.shape, (sb.shape[1], 1)).clone()  # the values misplaced
        return fp8_kernel.reference_scaled_mm(
            ops | {"scale_b": wrong.t().contiguous().t()}).to(out_dtype)

    monkeypatch.setattr(fp8_kernel, "call_scaled_mm", misread)
    ok, why = probe(cpu)
    assert not ok and "off by" in why

    def raises(ops, out_dtype=torch.bfloat16):
        raise RuntimeError("CUDA error: no kernel image\nsecond line")

    monkeypatch.setattr(fp8_kernel, "call_scaled_mm", raises)
    assert probe(cpu) == (False, "the blockwise scaled_mm probe failed: RuntimeError: CUDA "
                                 "error: no kernel image")


def _linear_against_float64(kernel: str, device: str, t=150, k=384, n=256):
    """Forward, input and weight gradient of the blockwise FP8 linear against the float64
    reference from the definition (as tests/test_fp8_linear.py); returns relative errors."""
    torch.manual_seed(1)
    x = torch.randn(t, k) * torch.logspace(-2, 2, k)
    w = torch.randn(n, k) / math.sqrt(k)
    g = torch.randn(t, n) * 1e-4
    xd = x.to(device).requires_grad_()
    wd = w.to(device).requires_grad_()
    recipe = replace(FP8Recipe.from_name("blockwise"), kernel=kernel)
    y = fp8_linear(xd, wd, None, recipe)
    y.backward(g.to(device))
    xq = _tiles64(x)
    refs = {"y": xq @ _blocks64(w).t(), "grad_x": _tiles64(g) @ _blocks64(w.t()).t(),
            "grad_w": _tiles64(g.t()) @ _tiles64(xq.float().t()).t()}
    ours = {"y": y, "grad_x": xd.grad, "grad_w": wd.grad}
    return {name: ((ours[name].detach().cpu().double() - ref).norm() / ref.norm()).item()
            for name, ref in refs.items()}


def test_kernel_path_of_the_linear_matches_float64_with_the_contract(monkeypatch):
    """The FP8 linear's three GEMMs through kernel_operands (token padding 150 -> 256, L4
    padding 3 -> 4) with the float64 contract standing in for cuBLASLt, rounded to bf16 as
    the kernel's output is."""
    calls = []

    def contract(ops, out_dtype=torch.bfloat16):
        calls.append((ops["kind_a"], ops["kind_b"]))
        return fp8_kernel.reference_scaled_mm(ops).to(out_dtype)

    monkeypatch.setattr(fp8_kernel, "call_scaled_mm", contract)
    errors = _linear_against_float64("scaled_mm", "cpu")
    assert sorted(calls) == sorted([("BlockWise1x128", "BlockWise128x128")] * 2
                                   + [("BlockWise1x128", "BlockWise1x128")])
    for name, rel in errors.items():
        assert rel < BF16_OUT_TOL, f"{name}: relative error {rel:.2e}"
    # and the rounding is really there: the emulation (fp32 out) is 100x closer
    emulated = _linear_against_float64("emulated", "cpu")
    assert max(emulated.values()) < 1e-5


def _gpu_kernel_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device: the cuBLASLt blockwise kernel runs on compute capability 9.x"
    ok, why = fp8_kernel.kernel_support(torch.device("cuda"))
    return None if ok else why


@pytest.mark.skipif(_gpu_kernel_reason() is not None, reason=str(_gpu_kernel_reason()))
def test_blockwise_kernel_on_the_gpu_matches_float64_reference():
    errors = _linear_against_float64("scaled_mm", "cuda")
    for name, rel in errors.items():
        assert rel < BF16_OUT_TOL, f"{name}: relative error {rel:.2e}"


def test_kernel_choice_and_refusals(monkeypatch, capsys):
    lin = torch.nn.Linear(256, 384, bias=False)
    odd = torch.nn.Linear(256, 320, bias=False)
    blockwise = FP8Recipe.from_name("blockwise")
    cpu = torch.device("cpu")
    kernel, line = convert.choose_kernel("auto", blockwise, [lin], cpu)
    assert kernel == "emulated" and "CUDA-only" in line
    assert convert.choose_kernel("auto", FP8Recipe.from_name("rowwise"), [lin], cpu) == (
        "emulated", "fp8: rowwise GEMMs on torch._scaled_mm (torch's cpu kernel)")
    with pytest.raises(ConfigError, match="fp8_kernel = 'scaled_mm' cannot run here"):
        convert.choose_kernel("scaled_mm", blockwise, [lin], cpu)
    # a device that has the kernel: whole blocks take it, a partial block does not
    monkeypatch.setattr(convert, "kernel_support", lambda device: (True, "the kernel"))
    assert convert.choose_kernel("auto", blockwise, [lin], cpu)[0] == "scaled_mm"
    assert convert.choose_kernel("emulated", blockwise, [lin], cpu)[0] == "emulated"
    kernel, line = convert.choose_kernel("auto", blockwise, [lin, odd], cpu)
    assert kernel == "emulated" and "(320, 256)" in line
    with pytest.raises(ConfigError, match=r"\(320, 256\)"):
        convert.choose_kernel("scaled_mm", blockwise, [odd], cpu)


def test_fp8_kernel_key_is_refused_in_one_line(tmp_path, capsys):
    base = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--train.steps", "1",
            "--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log"),
            "--train.precision", "fp8"]
    cases = {
        "value": (["--train.fp8_kernel", "cutlass"], "train.fp8_kernel = 'cutlass'"),
        "recipe": (["--train.fp8_recipe", "rowwise", "--train.fp8_kernel", "scaled_mm"],
                   "applies to fp8_recipe = 'blockwise' only"),
        "cpu": (["--train.fp8_kernel", "scaled_mm", "--train.device", "cpu"],
                "the blockwise FP8 kernel is CUDA-only"),
        "width": (["--train.fp8_kernel", "scaled_mm", "--model.hidden_size", "192",
                   "--model.intermediate_size", "256"],
                  "model.hidden_size = 192 is not a multiple of 128"),
    }
    for name, (args, expected) in cases.items():
        code = main(["train", *base, *args])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (name, lines)
        assert len(lines) == 1 and expected in lines[0], (name, lines)
    assert not (tmp_path / "ck").exists()
