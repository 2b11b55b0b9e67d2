"""fivefold's optimizers against their oracles: torchao's AdamW8bit and AdamW4bit, torch's
Adafactor and Muon, on the same weights and gradients, step by step.

Where the algorithm is the same operation for operation the updates are bit-equal (asserted
with `torch.equal`): torchao's step run eagerly (its torch.compile disabled: inductor may fuse
and reorder the fp32 arithmetic, which is a compiler's freedom, not a different algorithm),
torch's Adafactor and Muon (single-tensor, no foreach). Muon's AdamW part is torch's AdamW.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fivefold.config.optim import OptimSection
from fivefold.numerics.optim_states import QuantState, dynamic_map
from fivefold.parallel.optim_base import PieceInfo
from fivefold.parallel.optimizers import build_piece_optimizer

SHAPES = {"a.weight": (64, 128), "b.weight": (96, 64), "norm.weight": (64,),
          "c.weight": (8, 16)}  # 8192 and 6144 values: quantised; 64 and 128: fp32 states
STEPS = 4


def _tr(**kw):
    base = dict(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
    return SimpleNamespace(**{**base, **kw})


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    weights = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    grads = [{n: torch.randn(s, generator=g) * 10 ** (-i) for n, s in SHAPES.items()}
             for i in range(STEPS)]
    return weights, grads


def _ours(name, weights, grads, oc=None, decay=lambda n: True, tr=None):
    masters = [w.clone() for w in weights.values()]
    infos = [PieceInfo(i, n, m, 0, m.numel(), decay(n)) for i, (n, m) in
             enumerate(zip(weights, masters))]
    opt = build_piece_optimizer(name, masters, infos, tr or _tr(), oc or OptimSection())
    for step in grads:
        for m, n in zip(masters, weights):
            m.grad = step[n].clone()
        opt.step()
    return masters, opt


def _theirs(opt, weights, grads):
    params = list(weights.values())
    for step in grads:
        for p, n in zip(params, weights):
            p.grad = step[n].clone()
        opt.step()
    return params


def test_dynamic_maps_are_torchaos():
    from torchao.optim.quant_utils import create_dynamic_map

    assert dynamic_map(True) == create_dynamic_map(True)
    assert dynamic_map(False) == create_dynamic_map(False)
    assert dynamic_map(True, 3, 4) == create_dynamic_map(True, 3, 4)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantise_matches_torchao_and_round_trip_error(bits):
    """Codes and scales equal torchao's; the round trip is within half the widest gap of
    the map (or, for 4-bit's zero-free map, its smallest point) times the block's absmax,
    with 1e-3 relative slack for the fp32 division by the scale."""
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    x = torch.randn(8192, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 0,
                                                                                       8192)
    for signed in (True, False):
        values = x if signed else x.abs()
        ours = QuantState.zeros(x.numel(), bits, signed, "cpu")
        ours.quantize_(values)
        cls = OptimState8bit if bits == 8 else OptimState4bit
        theirs = cls.zeros(x.shape, signed)
        theirs.copy_(values)
        assert torch.equal(ours.codes, theirs.codes) and torch.equal(ours.scale, theirs.scale)
        table = ours.table()
        worst = max(float((table[1:] - table[:-1]).max()) / 2, float(table.abs().min()))
        block = 256 if bits == 8 else 128
        bound = worst * values.view(-1, block).abs().amax(1, keepdim=True)
        assert ((ours.dequantize() - values).abs().view(-1, block) <= bound * (1 + 1e-3)).all()


@pytest.mark.parametrize("name", ["adamw8bit", "adamw4bit"])
def test_lowbit_adamw_is_torchaos_bit_for_bit(name, monkeypatch):
    from torchao.optim import AdamW4bit, AdamW8bit

    weights, grads = _setup()
    ours, opt = _ours(name, weights, grads)
    cls = AdamW8bit if name == "adamw8bit" else AdamW4bit
    theirs_w = {n: w.clone() for n, w in weights.items()}
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # its step, run eagerly
    oracle = cls(list(theirs_w.values()), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                 weight_decay=0.1)
    theirs = _theirs(oracle, theirs_w, grads)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    quantised = [m for m in opt.masters if isinstance(opt.state[m]["exp_avg"], QuantState)]
    assert len(quantised) == 2  # the two big matrices; norm and c keep fp32 states


# torch's Adafactor takes the relative step only (fivefold's default is the absolute one)
RELATIVE = OptimSection(adafactor_relative_step=True)


def test_adafactor_is_torchs_bit_for_bit():
    weights, grads = _setup(1)
    ours, _ = _ours("adafactor", weights, grads, oc=RELATIVE)
    theirs_w = {n: w.clone() for n, w in weights.items()}
    oracle = torch.optim.Adafactor(list(theirs_w.values()), lr=1e-2, weight_decay=0.1)
    for a, b in zip(ours, _theirs(oracle, theirs_w, grads)):
        assert torch.equal(a, b)


def test_stacked_experts_adafactor_is_torchs_on_each_expert_bit_for_bit():
    """A stacked expert weight [E, A, B] is E matrices: R, C, α and the clipping per expert,
    as torch's Adafactor on each expert kept as its own weight (the experts' gradients of
    different scales, so one RMS over the stack would clip them differently)."""
    g = torch.Generator().manual_seed(3)
    weights = torch.randn(4, 16, 24, generator=g)
    scales = torch.tensor([1.0, 10.0, 0.1, 3.0]).view(-1, 1, 1)
    grads = [{"experts.w": torch.randn(4, 16, 24, generator=g) * scales} for _ in range(STEPS)]
    (ours,), _ = _ours("adafactor", {"experts.w": weights}, grads, oc=RELATIVE)
    theirs = {f"e{j}": weights[j].clone() for j in range(4)}
    oracle = torch.optim.Adafactor(list(theirs.values()), lr=1e-2, weight_decay=0.1)
    per_expert = [{f"e{j}": step["experts.w"][j] for j in range(4)} for step in grads]
    for j, b in enumerate(_theirs(oracle, theirs, per_expert)):
        assert torch.equal(ours[j], b), j


def test_muon_is_torchs_muon_plus_adamw_bit_for_bit():
    weights, grads = _setup(2)
    oc = OptimSection(muon_exclude="norm", muon_adjust_lr="original")
    ours, opt = _ours("muon", weights, grads, oc=oc, decay=lambda n: "norm" not in n)
    theirs_w = {n: w.clone() for n, w in weights.items()}
    matrices = [w for n, w in theirs_w.items() if "norm" not in n]
    muon = torch.optim.Muon(matrices, lr=1e-2, weight_decay=0.1, adjust_lr_fn="original")
    adamw = torch.optim.AdamW([theirs_w["norm.weight"]], lr=1e-2, betas=(0.9, 0.95),
                              eps=1e-8, weight_decay=0.0, foreach=True)
    for step in grads:
        for n, w in theirs_w.items():
            w.grad = step[n].clone()
        muon.step()
        adamw.step()
    for a, b in zip(ours, theirs_w.values()):
        assert torch.equal(a, b)
    assert opt.adamw is not None and len(opt.masters) == 3


def test_muon_without_nesterov_leaves_its_momentum_alone():
    """Without Nesterov the update is the momentum itself; Newton-Schulz in fp32 once
    normalised it in place (to norm 1), so one device and a gathering layout differed."""
    weights, grads = _setup(4)
    oc = OptimSection(muon_nesterov=False, muon_ns_dtype="fp32", muon_exclude="norm")
    _, opt = _ours("muon", weights, grads[:1], oc=oc)
    for m, name in zip(opt.masters, [n for n in weights if "norm" not in n]):
        momentum = opt.state[m]["momentum"].view(grads[0][name].shape)
        assert torch.equal(momentum, torch.zeros_like(momentum).lerp_(grads[0][name], 0.05))


# --- bad input: one line, exit 2 ------------------------------------------------------------
@pytest.mark.parametrize("overrides, words", [
    (["--train.optimizer", "adam8bit"], "train.optimizer = 'adam8bit' is not one of"),
    (["--optim.muon_momentum", "0.9"], "optim.muon_momentum is a key of muon"),
    (["--train.optimizer", "muon", "--optim.adafactor_clip", "2"], "is a key of adafactor"),
    (["--train.optimizer", "adafactor", "--train.beta2", "0.99"], "train.beta2 does not apply"),
    (["--train.optimizer", "muon", "--optim.muon_ns_coefficients", "1,2,nan"],
     "must be three finite numbers"),
    (["--train.optimizer", "muon", "--optim.muon_ns_coefficients", "-inf,2,3"],
     "must be three finite numbers"),
    (["--train.optimizer", "adamw8bit", "--parallel.offload", "nvme", "--parallel.zero", "1",
      "--parallel.offload_dir", "runs/offload"],
     "offload = cpu"),
])
def test_bad_optimizer_keys_are_one_line(overrides, words):
    from fivefold.config import ConfigError, load

    with pytest.raises(ConfigError) as e:
        load(None, overrides)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_muon_without_a_matrix_is_refused():
    from fivefold.config import ConfigError
    from fivefold.parallel.optimizers import check_muon_matrices

    named = [("layers.0.mlp.up_proj.weight", torch.zeros(4, 4)), ("norm.weight", torch.zeros(4))]
    check_muon_matrices(named, OptimSection())  # takes up_proj
    with pytest.raises(ConfigError, match="finds no matrix it can take"):
        check_muon_matrices(named, OptimSection(muon_exclude="proj,norm"))


def test_cli_unknown_optimizer_exits_2_in_one_line():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--train.optimizer",
                          "lion"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "train.optimizer = 'lion'" in run.stderr
