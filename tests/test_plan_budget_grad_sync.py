"""`fivefold plan --model ... --layout ...,recompute=auto`: the memory budget is checked
against the gradients grad_sync = auto resolves to for the layout (plan/grad_sync.py
`resolve_grad_sync`), as the --config path checks it. Llama-3.1-8B on 32 H100s, ZeRO-2,
8 micro-batches: auto reduce-scatters once per step (per micro-batch would be much slower
across nodes), so every rank holds the whole bf16 gradient (15 GiB) and full
recomputation's peak is 36.9 GiB, not the 22.0 GiB of per micro-batch. A 30 GiB budget is
refused in one line on stderr, exit 2, by both paths, before any plan is printed."""

import re

import pytest

from fivefold.models.presets import preset
from fivefold.plan.cli_entry import main
from fivefold.plan.grad_sync import fit_grad_sync, resolve_grad_sync
from fivefold.plan.hardware import get_hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import minimum_budget

LAYOUT = "dp=32,zero=2,mbs=1,recompute=auto"
MODEL = ["--model", "llama-3.1-8b", "--gpus", "32", "--gpu", "h100", "--seq-len", "4096",
         "--gbs", "256", "--layout", LAYOUT]


def _minimums():
    hw, assume = get_hardware("h100")
    work = Workload(model=preset("llama-3.1-8b"), seq_len=4096, gbs=256, precision="bf16",
                    grad_sync="auto", memory_budget_gib=30.0)
    layout = Layout(dp=32, zero=2, mbs=1, recompute="auto")
    resolved = resolve_grad_sync(work, layout, hw, assume)
    assert resolved.grad_sync == "step"
    return (minimum_budget(fit_grad_sync(work, layout), layout),
            minimum_budget(resolved, layout))


def _config(tmp_path, budget):
    path = tmp_path / "train.toml"
    path.write_text('[model]\npreset = "llama-3.1-8b"\n[parallel]\ndp = 32\nzero = 2\n'
                    'mbs = 1\ngrad_sync = "auto"\n[train]\ngbs = 256\nseq_len = 4096\n'
                    f'precision = "bf16"\nrecompute = "auto"\nmemory_budget_gib = {budget}\n')
    return ["--config", str(path), "--gpu", "h100"]


@pytest.mark.parametrize("path", ("model", "config"))
def test_a_budget_below_the_resolved_minimum_is_refused(path, tmp_path, capsys):
    per_microbatch, per_step = _minimums()
    assert per_microbatch < 30 < per_step  # 22.0 and 36.9 GiB
    argv = MODEL + ["--memory-budget-gib", "30"] if path == "model" else _config(tmp_path, 30)
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and "below full recomputation's peak" in err, err
    # the minimum it names is once-per-step's (the CLI sizes the loss's chunks by the GPU's
    # memory, the Workload here by default: a few MiB of logits apart)
    named = float(re.search(r"([0-9.]+) GiB", err).group(1))
    assert named == pytest.approx(per_step, rel=0.01), (err, per_step)


@pytest.mark.parametrize("path", ("model", "config"))
def test_a_budget_above_it_plans(path, tmp_path, capsys):
    argv = MODEL + ["--memory-budget-gib", "40"] if path == "model" else _config(tmp_path, 40)
    code = main(argv)
    out = capsys.readouterr().out
    assert "recompute auto under 40 GiB (minimum, full recomputation: 36.9 GiB)" in out
    assert "nothing fits" not in out and code in (0, 1)
