"""The single-process engine: accumulation, recomputation, resume, precision modes."""

import math

import pytest
import torch
from common import small_config

from fivefold.config import TrainSection
from fivefold.parallel.memory import SavedActivations
from fivefold.train.optim import lr_at
from fivefold.train.trainer import Trainer


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def masked_batch(gbs=4, seq_len=32, vocab=256):
    """A batch whose sequences hold different numbers of target tokens (-100 is ignored)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(0, vocab, (gbs, seq_len), generator=gen)
    y = torch.randint(0, vocab, (gbs, seq_len), generator=gen)
    for i in range(gbs):
        y[i, : 5 * i] = -100  # sequence i has seq_len - 5i targets
    return x, y


def test_accumulation_equals_one_big_microbatch(tmp_path):
    """mbs 4 × 1 step and mbs 1 × 4 accumulation steps: same gradients (≤ 1e-6 relative)."""
    x, y = masked_batch()
    num_tokens = int((y != -100).sum())
    assert num_tokens == 4 * 32 - (0 + 5 + 10 + 15)
    big = Trainer(small_config(tmp_path, "--parallel.mbs", "4"), quiet=True)
    big.optimizer.zero_grad()
    loss_big = big.forward_backward([(x, y)], num_tokens)
    small = Trainer(small_config(tmp_path, "--parallel.mbs", "1"), quiet=True)
    small.optimizer.zero_grad()
    loss_small = small.forward_backward([(x[i:i + 1], y[i:i + 1]) for i in range(4)], num_tokens)
    assert abs(float(loss_big) - float(loss_small)) / float(loss_big) <= 1e-6
    gb, gs = grads(big), grads(small)
    for name in gb:
        assert rel(gs[name], gb[name]) <= 1e-6, name


def test_accumulation_losses_over_steps(tmp_path):
    """Through the loader: gbs 8 as 1 × 8 and as 4 × 2 give the same loss curve and norms."""
    runs = []
    for mbs in ("8", "2"):
        t = Trainer(small_config(tmp_path, "--train.gbs", "8", "--parallel.mbs", mbs), quiet=True)
        runs.append([t.train_step() for _ in range(4)])
    for a, b in zip(*runs):
        assert abs(a["loss"] - b["loss"]) / a["loss"] <= 1e-6
        assert abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"] <= 1e-5


def test_recompute_modes_agree_and_save_less(tmp_path, capsys):
    """none, selective and full: same loss and gradients (≤ 1e-6); saved bytes shrink."""
    x, y = masked_batch(gbs=2, seq_len=32)
    num_tokens = int((y != -100).sum())
    results = {}
    for mode in ("none", "selective", "full"):
        t = Trainer(small_config(tmp_path, "--train.recompute", mode), quiet=True)
        t.optimizer.zero_grad()
        params = [p for _, p in t.model.named_parameters()]
        with SavedActivations(params) as meter:
            loss = t.model.chunks[0](x, y)
        (loss / num_tokens).backward()
        results[mode] = (float(loss.detach()), grads(t), meter.bytes)
    loss0, g0, bytes_none = results["none"]
    for mode in ("selective", "full"):
        loss, g, _ = results[mode]
        assert abs(loss - loss0) / loss0 <= 1e-6
        for name in g0:
            assert rel(g[name], g0[name]) <= 1e-6, (mode, name)
    bytes_sel, bytes_full = results["selective"][2], results["full"][2]
    with capsys.disabled():
        print(f"\nsaved activation bytes per micro-batch (b=2, s=32, h=32, L=2): none {bytes_none}"
              f", selective {bytes_sel}, full {bytes_full}")
    assert bytes_full < bytes_sel < bytes_none


def test_resume_is_bit_exact(tmp_path):
    """20 steps in one go equal 10 steps + save + resume + 10 steps, loss for loss (fp32)."""
    cfg = small_config(tmp_path, "--train.steps", "20", "--train.warmup_steps", "4")
    straight = Trainer(cfg, quiet=True)
    losses = [straight.train_step()["loss"] for _ in range(20)]

    first = Trainer(cfg, quiet=True)
    head = [first.train_step()["loss"] for _ in range(10)]
    first.save_checkpoint()
    resumed_cfg = small_config(tmp_path, "--train.steps", "20", "--train.warmup_steps", "4",
                               "--checkpoint.resume", "latest")
    second = Trainer(resumed_cfg, quiet=True)
    assert second.step == 10
    tail = [second.train_step()["loss"] for _ in range(10)]
    assert head + tail == losses  # bit for bit


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_keeps_fp32_master_weights(tmp_path, precision):
    t = Trainer(small_config(tmp_path, "--train.precision", precision, "--train.steps", "8"),
                quiet=True)
    recs = [t.train_step() for _ in range(8)]
    mem = t.optimizer.memory_bytes()
    n = sum(p.numel() for _, p in t.model.named_parameters())
    # 2 + 2 + 4 + 8 bytes per parameter (params, grads, master, Adam).
    assert mem == {"params": 2 * n, "grads": 2 * n, "master": 4 * n, "optimizer": 8 * n}
    finite = [r["loss"] for r in recs if not r["skipped"]]
    assert finite and all(math.isfinite(v) for v in finite)
    assert finite[-1] < finite[0]
    if precision == "fp16":
        assert recs[0]["loss_scale"] == 2.0**16


def schedule(kind: str, steps: int = 50, warmup: int = 5) -> list[float]:
    tr = TrainSection(steps=steps, warmup_steps=warmup, lr=1e-3, min_lr=1e-4,
                      lr_schedule=kind, decay_fraction=0.2)
    return [lr_at(step, tr) for step in range(steps)]


@pytest.mark.parametrize("kind", ["cosine", "linear", "wsd", "constant"])
def test_lr_schedules_warm_up_then_end_at_min_lr(kind):
    """Warmup reaches lr on its last step; every decay ends at min_lr on the last step."""
    lrs = schedule(kind)
    assert lrs[:5] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3], rel=1e-12)
    assert lrs[5] == pytest.approx(1e-3, rel=1e-12)  # decay starts from the peak
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))  # never rises again
    assert lrs[-1] == pytest.approx(1e-3 if kind == "constant" else 1e-4, rel=1e-12)
    if kind == "cosine":  # halfway through the decay, halfway between lr and min_lr
        assert lrs[5 + 22] == pytest.approx(5.5e-4, rel=1e-12)
    if kind == "wsd":  # stable until the last 20% of the steps (10 of 50)
        assert lrs[39] == 1e-3 and lrs[40] < 1e-3


def test_warmup_is_capped_at_a_tenth_of_the_run():
    assert schedule("constant", steps=20, warmup=30)[:3] == pytest.approx([5e-4, 1e-3, 1e-3])


def test_no_weight_decay_on_norms_and_biases(tmp_path):
    t = Trainer(small_config(tmp_path, "--model.qkv_bias", "true"), quiet=True)
    opt = t.optimizer
    by_tensor = {id(m): n for n, m in zip(opt.names, opt.master)}
    decayed = {g["weight_decay"]: {by_tensor[id(p)] for p in g["params"]}
               for g in opt.optimizer.param_groups}
    assert set(decayed) == {0.1, 0.0}
    assert decayed[0.0] and all("norm" in n or n.endswith(".bias") for n in decayed[0.0])
    assert all(n.endswith(".weight") and "norm" not in n for n in decayed[0.1])
    assert "layers.0.self_attn.q_proj.bias" in decayed[0.0]
    assert "embed_tokens.weight" in decayed[0.1]


def test_global_norm_clipping(tmp_path):
    """The step reports the norm before clipping and applies gradients of norm grad_clip."""
    t = Trainer(small_config(tmp_path, "--train.grad_clip", "0.5"), quiet=True)
    params = [p for _, p in t.model.named_parameters()]
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    before = float(torch.stack([p.grad.norm() for p in params]).norm())
    stats = t.optimizer.step(lr=1e-3)
    after = float(torch.stack([p.grad.norm() for p in params]).norm())
    assert stats.grad_norm == pytest.approx(before, rel=1e-6)
    assert after == pytest.approx(0.5, rel=1e-5)


def test_fp16_overflow_skips_the_step_and_halves_the_scale(tmp_path):
    t = Trainer(small_config(tmp_path, "--train.precision", "fp16"), quiet=True)
    params = [p for _, p in t.model.named_parameters()]
    before = [p.detach().clone() for p in params]
    masters = [m.detach().clone() for m in t.optimizer.master]
    for p in params:
        p.grad = torch.ones_like(p)
    params[3].grad[0] = float("inf")
    stats = t.optimizer.step(lr=1e-3)
    assert stats.skipped and stats.loss_scale == 2.0**16
    assert t.scaler.scale == 2.0**15 and t.scaler.skipped_steps == 1
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    assert all(torch.equal(a, m) for a, m in zip(masters, t.optimizer.master))
    assert t.optimizer.step_count() == 0  # Adam did not count it
    # A clean step goes through, and the scale doubles after growth_interval clean steps.
    t.scaler.growth_interval = 2
    for _ in range(2):
        for p in params:
            p.grad = torch.full_like(p, 1e-2 * t.scaler.scale)
        assert not t.optimizer.step(lr=1e-3).skipped
    assert t.scaler.scale == 2.0**16 and t.optimizer.step_count() == 2


def test_checkpoints_keep_the_newest_n(tmp_path):
    t = Trainer(small_config(tmp_path, "--checkpoint.keep", "2"), quiet=True)
    root = tmp_path / "ckpt"
    for step in (3, 6, 9, 12):
        t.step = step
        t.save_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == [
        "latest", "step_00000009", "step_00000012"]
    assert (root / "latest").read_text() == "step_00000012"


def test_resumed_metrics_hold_each_step_once(tmp_path):
    """Steps logged after the checkpoint a run resumes from run again; the file keeps the
    history up to the checkpoint and then the new records, each step once."""
    import json

    from fivefold.train.metrics import MetricsWriter

    first = MetricsWriter(str(tmp_path), tensorboard=False)
    for step in range(1, 8):
        first.write({"kind": "train", "step": step, "loss": 10.0 - step})
        if step % 5 == 0:
            first.write({"kind": "val", "step": step, "val_loss": 1.0})
    first.close()
    again = MetricsWriter(str(tmp_path), tensorboard=False, resume_step=5)
    for step in (6, 7):
        again.write({"kind": "train", "step": step, "loss": 0.5})
    again.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in records] == [
        *[("train", s) for s in range(1, 6)], ("val", 5), ("train", 6), ("train", 7)]
    assert [r["loss"] for r in records if r["step"] > 5] == [0.5, 0.5]


def test_saving_a_step_again_never_leaves_latest_dangling(tmp_path):
    """Saving the step `latest` names a second time keeps the old copy aside until the new
    one is in place; if a crash fell between the two renames, resume finds the old copy."""
    from fivefold.train import checkpoint as ckpt

    t = Trainer(small_config(tmp_path), quiet=True)
    root = tmp_path / "ckpt"
    t.step = 5
    t.save_checkpoint()
    t.save_checkpoint()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000005"]
    # The crash window: the old copy moved aside, the new one not yet renamed into place.
    (root / "step_00000005").rename(root / "step_00000005.old")
    found = ckpt.resolve(str(root), "latest")
    assert found == root / "step_00000005.old"
    resumed = Trainer(small_config(tmp_path, "--checkpoint.resume", "latest"), quiet=True)
    assert resumed.step == 5
