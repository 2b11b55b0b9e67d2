"""No host sync inside a steady-state training step (bf16, fp16 with loss scaling, ZeRO-1/3
at dp1), counted by `fivefold trace` on the GPU's code paths; a non-finite step is still
skipped and reported, its record read from the device when it is logged."""

import math

import pytest
import torch
from common import small_config

from fivefold.trace import trace_callable, trace_step
from fivefold.train.trainer import Trainer

# The tiny model, 2 blocks, the byte tokenizer: the trace runs the engine's own step on the
# meta device (every device.type != "cpu" branch takes its GPU path) in about a second.
TINY = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--model.num_layers", "2",
        "--train.seq_len", "64", "--train.gbs", "4", "--parallel.mbs", "2"]
LAYOUTS = {"bf16": ["--train.precision", "bf16"],
           "fp16": ["--train.precision", "fp16"],  # the loss scaler on
           "zero1": ["--train.precision", "bf16", "--parallel.zero", "1"],
           "zero3": ["--train.precision", "bf16", "--parallel.zero", "3"]}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_steady_state_step_has_no_host_sync(layout):
    """Step 3 of 3 (the optimizer's states exist from step 2; fp16's scale is on the
    device from step 2): not one `.item()`, device-to-host or blocking host-to-device copy,
    or data-dependent shape, clipping on (train.grad_clip's default, 1.0)."""
    t = trace_step([*TINY, *LAYOUTS[layout]], steps=3, planner=False)
    assert t.syncs_by_kind() == {"item": 0, "d2h": 0, "h2d": 0, "dynamic_shape": 0}, \
        {name: p.sync_ops for name, p in t.parts.items() if p.syncs}
    assert t.syncs == 0
    # the step ran the whole update: the optimizer's part launched the one-pass AdamW
    # (parallel/adamw_kernel.py) over the compute-dtype gradients
    assert t.part("optimizer").ops.get("fivefold.adamw_mixed_", 0) >= 1


@pytest.mark.parametrize("optimizer", ["adamw8bit", "adamw4bit", "muon"])
@pytest.mark.parametrize("zero", ["0", "1"])
def test_fivefolds_own_rules_skip_on_the_device_too(optimizer, zero):
    """AdamW 8-bit/4-bit and Muon (its other parameters on a fused AdamW) take the overflow
    flag themselves (optim_base.PieceOptimizer.kept): no host decision in their step.
    Adafactor still reads its skip on the host (its norms are host numbers)."""
    t = trace_step([*TINY, *LAYOUTS["bf16"], "--train.optimizer", optimizer,
                    "--parallel.zero", zero], steps=3, planner=False)
    assert t.syncs == 0, {name: p.sync_ops for name, p in t.parts.items() if p.syncs}
    assert t.part("optimizer").kernels > 20  # the update ran (not the skip's branch)


def test_adafactor_reads_its_flag_and_norms_on_the_host():
    """Adafactor still decides its skip on the host (one read of the flag) and reads each
    matrix's norm (its relative step and update clipping are host numbers); the traced step
    takes the update's branch (the flag, cast to a number, reads 0.0 on meta)."""
    t = trace_step([*TINY, *LAYOUTS["bf16"], "--train.optimizer", "adafactor"], steps=3,
                   planner=False)
    opt = t.part("optimizer")
    assert opt.kernels > 20 and opt.syncs > 1, (opt.kernels, opt.sync_ops)
    assert set(opt.sync_ops) == {"item aten._local_scalar_dense"}


def test_the_trace_counts_a_sync_put_back_into_the_step(monkeypatch):
    """The count above can fail: a `.item()` on the device is one sync in a traced callable,
    and one read of the loss put back into the trainer's step is counted in its trace."""
    x = torch.empty(8, device="meta")
    t = trace_callable(lambda: x.sum().item(), gpu=None)
    assert t.syncs_by_kind()["item"] == 1

    original = Trainer.global_loss_sum

    def reads_the_loss(self, local_sum):
        total = original(self, local_sum)
        float(total)  # the host waits for the step's loss, as the step once did
        return total

    monkeypatch.setattr(Trainer, "global_loss_sum", reads_the_loss)
    t = trace_step([*TINY, *LAYOUTS["bf16"]], steps=2, planner=False)
    assert t.syncs == 1 and t.syncs_by_kind()["item"] == 1


def _poisoned_run(tmp_path, precision: str, poison_at: set[int], *extra: str):
    """Three steps of a CPU run whose first parameter's gradient is NaN at `poison_at`."""
    cfg = small_config(tmp_path, "--train.precision", precision, "--train.steps", "3",
                       "--train.max_bad_steps", "3", *extra)
    t = Trainer(cfg, quiet=True)
    name, param = next(iter(t.model.named_parameters()))
    param.register_hook(lambda g: g * float("nan") if t.step + 1 in poison_at else g)
    records, weights = [], []
    for _ in range(3):
        weights.append({n: p.detach().clone() for n, p in t.model.named_parameters()})
        records.append(t.train_step())
    weights.append({n: p.detach().clone() for n, p in t.model.named_parameters()})
    return t, records, weights


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_non_finite_step_is_skipped_and_reported(tmp_path, precision):
    """Step 2's gradient is NaN: the step is skipped on the device (fused AdamW's found_inf:
    weights, masters and the step count unchanged), its record says so when read — skipped,
    a NaN gradient norm, "bad" unless fp16 (an fp16 overflow is the scaler's: the scale
    halves) — and steps 1 and 3 update the weights."""
    t, records, weights = _poisoned_run(tmp_path, precision, poison_at={2})
    assert not any(r.settled for r in records)  # nothing was read from the device yet
    skipped = [r["skipped"] for r in records]
    assert all(r.settled for r in records)  # one read settled every pending record
    assert skipped == [False, True, False]
    assert [r["bad"] for r in records] == [False, precision != "fp16", False]
    assert math.isnan(records[1]["grad_norm"])
    assert all(math.isfinite(records[i]["grad_norm"]) for i in (0, 2))
    assert all(math.isfinite(r["loss"]) for r in records)
    for name in weights[1]:  # step 2 left every weight as it was; steps 1 and 3 did not
        assert torch.equal(weights[1][name], weights[2][name]), name
    assert any(not torch.equal(weights[0][n], weights[1][n]) for n in weights[0])
    assert any(not torch.equal(weights[2][n], weights[3][n]) for n in weights[2])
    assert t.optimizer.step_count() == 2  # the skipped step did not count
    if precision == "fp16":
        assert [r["loss_scale"] for r in records] == [2.0**16, 2.0**16, 2.0**15]
        assert t.scaler.scale == 2.0**15 and t.scaler.skipped_steps == 1
    assert t.bad_steps == 0  # step 3 was good: no run of bad steps
    t.close()


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "muon"])
def test_a_skipped_step_leaves_the_run_as_if_it_had_not_been_asked(tmp_path, optimizer):
    """Bit for bit: a run whose step 2 is skipped ends, after step 3, with the weights and
    optimizer states of a run that took step 1 and then step 3's batch (the data position
    advances past the skipped batch in both), and the same step count: torch's fused AdamW
    and fivefold's own rules skip on the device (the bias corrections count the steps
    taken there)."""
    opt = ("--train.optimizer", optimizer)
    t, _, _ = _poisoned_run(tmp_path / "a", "bf16", {2}, *opt)
    assert t.optimizer.step_count() == 2
    cfg = small_config(tmp_path / "b", "--train.precision", "bf16", "--train.steps", "3",
                       "--train.max_bad_steps", "3", *opt)
    ref = Trainer(cfg, quiet=True)
    ref.train_step()
    ref.loader.next_batch()  # the skipped step's batch
    ref.step += 1  # the learning rate of step 3
    ref.train_step()
    got, want = t.logical_tensors(), ref.logical_tensors()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    t.close()
    ref.close()


def test_a_moe_step_leaves_its_expert_counts_on_the_device(tmp_path):
    """The MoE layers' global counts stay on the device after the step (train/moe_stats.py):
    a traced MoE step waits on nothing (the routing's counts have a fixed length, models/
    moe.py `expert_counts`; its `bincount`s were the step's last syncs); on a CPU run the
    step's record still gives the MoE metrics, made when the record is read."""
    t = trace_step(["--model.preset", "tiny-moe", "--model.num_layers", "2",
                    "--train.seq_len", "32", "--train.gbs", "1", "--parallel.mbs", "1"],
                   steps=2, planner=False)
    assert t.part("step").syncs == 0, t.part("step").sync_ops
    assert {k for p in t.parts.values() for k in p.sync_ops} == set()
    cfg = small_config(tmp_path, "--model.preset", "tiny-moe", "--model.num_layers", "2",
                       "--train.steps", "1")
    with Trainer(cfg, quiet=True) as tr:
        rec = tr.train_step()
        assert not rec.settled
        counts = rec["moe_tokens_max"]
        assert rec.settled and len(counts) == 2 and all(c > 0 for c in counts)
        assert 0 < rec["moe_tokens_min"][0] <= counts[0]
        assert math.isfinite(rec["moe_aux_loss"]) and rec["moe_imbalance"] >= 1.0
