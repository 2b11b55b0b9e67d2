"""How runs end, on forked gloo ranks: SIGTERM, non-finite steps, a damaged newest
checkpoint, a failing save — and the watchdog thread stopped on every path.

Each case is compared with an uninterrupted run of the same config (fp32, same seed and
global batch): resumed losses equal it within 1e-6 relative (they are bit-exact in practice).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist
from common import small_config
from harness import run_ranks

from fivefold.parallel.mesh import ParallelDims

LAYOUT = ("--parallel.dp", "2", "--parallel.zero", "1", "--train.gbs", "8",
          "--parallel.timeout_s", "60")


def cfg_for(root: Path, name: str, *extra: str):
    return small_config(root / name, *LAYOUT, *extra)


def watchdogs() -> int:
    return sum(t.name == "fivefold-watchdog" and t.is_alive() for t in threading.enumerate())


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a, b))


def _signal_and_resume(rank, world, tmp):
    from fivefold.train import lifecycle
    from fivefold.train.loop import run
    from fivefold.train.trainer import Trainer

    root = Path(tmp)
    out = {}
    dims = ParallelDims.from_config(cfg_for(root, "ref").parallel)
    ref = run(cfg_for(root, "ref", "--train.steps", "6"), dims)
    out["reference"] = [r["loss"] for r in ref]
    out["watchdogs_after_run"] = watchdogs()

    # SIGTERM reaches rank 1 alone during step 3: the ranks agree at the next step whose
    # records are read (log.every 2: step 4) and both stop after it, with a checkpoint.
    real_step = Trainer.train_step
    reduced = []  # the steps after which the world all-reduced the flag
    real_agreed = lifecycle.StopSignal.agreed

    def agreed(self, world, check=True):
        if check:
            reduced.append(self.step_seen)
        return real_agreed(self, world, check)

    def step_then_signal(self):
        rec = real_step(self)
        lifecycle.StopSignal.step_seen = rec["step"]
        if dist.get_rank() == 1 and rec["step"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return rec

    Trainer.train_step = step_then_signal
    lifecycle.StopSignal.agreed = agreed
    try:
        run(cfg_for(root, "term", "--train.steps", "6", "--log.every", "2"), dims)
        out["terminated"] = None
    except lifecycle.Terminated as stop:
        out["terminated"] = (stop.step, stop.saved)
    finally:
        Trainer.train_step = real_step
        lifecycle.StopSignal.agreed = real_agreed
    out["reduced_after"] = reduced
    out["handler_restored"] = signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    out["watchdogs_after_term"] = watchdogs()
    resumed = run(cfg_for(root, "term", "--train.steps", "6"), dims)  # resume = auto
    out["resumed"] = [(r["step"], r["loss"]) for r in resumed]
    return out


def test_sigterm_saves_at_the_step_boundary_and_auto_resume_continues(tmp_path):
    """SIGTERM to one rank mid-step 3: the flag is all-reduced only after steps whose
    records are read (1, 2, 4 at log.every 2: not one collective a step), every rank stops
    after the same step (4), one checkpoint is written, `Terminated` ends the run (exit 143
    in the CLI), the handler is restored, the watchdog thread is gone; the rerun resumes by
    itself and repeats the uninterrupted losses."""
    results = run_ranks(_signal_and_resume, 2, str(tmp_path))
    for out in results:
        assert out["watchdogs_after_run"] == 0 and out["watchdogs_after_term"] == 0
        assert out["handler_restored"]
        assert out["reduced_after"] == [1, 2, 4], out["reduced_after"]
        step, saved = out["terminated"]
        assert step == 4 and saved.endswith("step_00000004"), out["terminated"]
        assert [s for s, _ in out["resumed"]] == [5, 6]
        assert same([loss for _, loss in out["resumed"]], out["reference"][4:])
    assert (tmp_path / "term" / "ckpt" / "step_00000006").is_dir()


def _bad_numbers(rank, world, tmp):
    from fivefold.train.lifecycle import BadStepsError
    from fivefold.train.trainer import Trainer

    root = Path(tmp)
    out = {}
    cfg = cfg_for(root, "nan", "--train.steps", "8", "--train.max_bad_steps", "2",
                  "--checkpoint.every", "1")
    dims = ParallelDims.from_config(cfg.parallel)
    poison_at = {3, 5, 6}  # 3: one bad step, then a good one; 5, 6: two in a row -> stop
    with Trainer(cfg, dims, quiet=True) as t:
        name, param = next(iter(t.model.named_parameters()))
        if rank == 1:  # NaN into one parameter's gradient on rank 1 only, before reduction
            param.register_hook(
                lambda g: g * float("nan") if t.step + 1 in poison_at else g)
        records, snapshots = [], {}
        try:
            while t.step < cfg.train.steps:
                snapshots[t.step] = param.detach().clone()
                records.append(t.train_step())
                t.save_checkpoint()
        except BadStepsError as e:
            out["error"] = str(e)
        out["records"] = [(r["step"], r["skipped"], r["bad"]) for r in records]
        out["unchanged_by_bad_step"] = torch.equal(snapshots[2], snapshots[3])
        out["finite"] = all(bool(torch.isfinite(p).all()) for _, p in t.model.named_parameters())
    out["watchdogs"] = watchdogs()
    return out


def test_a_nan_gradient_on_one_rank_skips_the_step_everywhere_then_stops(tmp_path):
    """NaN in rank 1's gradient: the norm's own reduction tells every rank; the step is
    skipped on both (weights untouched); two bad steps in a row stop the run with one line
    naming the last good checkpoint, written before the bad steps. The steps' records are
    read from the device before a save (train/step_metrics.py): the run stops there, before
    step 6's checkpoint."""
    results = run_ranks(_bad_numbers, 2, str(tmp_path))
    for out in results:
        # step 6 ran (skipped); its record is read, and the run stopped, before its save
        assert out["records"] == [(1, False, False), (2, False, False), (3, True, True),
                                  (4, False, False), (5, True, True), (6, True, True)
                                  ], out["records"]
        assert out["unchanged_by_bad_step"] and out["finite"]
        msg = out["error"]
        assert "steps 5-6 had a non-finite loss or gradient" in msg, msg
        assert "train.max_bad_steps = 2" in msg and "step_00000005" in msg, msg
        assert "\n" not in msg and out["watchdogs"] == 0
    # The run stopped inside step 6: nothing after step 5 was written.
    assert (tmp_path / "nan" / "ckpt" / "latest").read_text() == "step_00000005"


def _damaged_newest(rank, world, tmp, damage):
    from fivefold.train.trainer import Trainer

    root = Path(tmp)
    cfg = cfg_for(root, damage, "--train.steps", "6", "--checkpoint.keep", "3")
    dims = ParallelDims.from_config(cfg.parallel)
    with Trainer(cfg, dims, quiet=True) as t:
        reference = []
        for _ in range(6):
            reference.append(t.train_step()["loss"])
            if t.step in (2, 4):
                t.save_checkpoint()
    ck = root / damage / "ckpt"
    if rank == 0:
        newest = ck / "step_00000004"
        if damage == "truncated":
            shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
            os.truncate(shard, shard.stat().st_size // 3)
        else:
            (newest / "meta.json").write_text('{"model": ')
    dist.barrier()
    with Trainer(cfg, dims, quiet=True) as t:
        resumed_from = t.resumed_from
        after = [t.train_step()["loss"] for _ in range(4)]
    return {"resumed_from": resumed_from, "after": after, "reference": reference,
            "watchdogs": watchdogs()}


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, capfd):
    """A truncated shard, then garbled metadata, in the newest checkpoint: resume = auto
    names it in one line and resumes from the one before, with the uninterrupted losses."""
    for damage in ("truncated", "garbled"):
        results = run_ranks(_damaged_newest, 2, str(tmp_path), damage)
        for out in results:
            assert out["resumed_from"].endswith("step_00000002"), out["resumed_from"]
            assert same(out["after"], out["reference"][2:]) and out["watchdogs"] == 0
        err = capfd.readouterr().err
        lines = [ln for ln in err.splitlines() if "cannot be loaded" in ln]
        assert len(lines) == 1 and "step_00000004" in lines[0], err[-3000:]
        assert "trying the previous one" in lines[0]


def _save_fails(rank, world, tmp):
    from fivefold.train import checkpoint as ckpt
    from fivefold.train.lifecycle import CheckpointWriteError
    from fivefold.train.trainer import Trainer

    root = Path(tmp)
    cfg = cfg_for(root, "full", "--train.steps", "4")
    dims = ParallelDims.from_config(cfg.parallel)
    out = {}
    with Trainer(cfg, dims, quiet=True) as t:
        t.train_step()
        t.save_checkpoint()
        t.train_step()
        real_save = ckpt.torch.save

        def disk_full(*args, **kwargs):  # after DCP wrote its shards into step_N.tmp
            raise OSError(errno.ENOSPC, "No space left on device")

        ckpt.torch.save = disk_full
        try:
            t.save_checkpoint()
        except CheckpointWriteError as e:
            out["error"] = str(e)
        finally:
            ckpt.torch.save = real_save
        dist.barrier()
        # An unwritable directory, seen by rank 0 only (root ignores permission bits, so the
        # refusal is injected where the kernel would give it): every rank stops together.
        real_write = Path.write_bytes

        def refused(path, data):
            if ".write-probe" in path.name:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_write(path, data)

        if rank == 0:
            Path.write_bytes = refused
        try:
            t.save_checkpoint()
        except CheckpointWriteError as e:
            out["unwritable"] = str(e)
        finally:
            Path.write_bytes = real_write
        dist.barrier()
    out["watchdogs"] = watchdogs()
    return out


def test_a_full_disk_or_unwritable_dir_during_save_is_one_line_and_keeps_the_previous(
        tmp_path):
    """ENOSPC on every rank in the middle of saving step 2, then a directory rank 0 may not
    write: one line on every rank naming the step, the cause and the intact previous
    checkpoint; `latest` still names step 1 and nothing half written is left behind."""
    for out in run_ranks(_save_fails, 2, str(tmp_path)):
        msg = out["error"]
        assert "saving step 2" in msg and "No space left on device" in msg, msg
        assert "step_00000001 is intact" in msg and "\n" not in msg, msg
        msg = out["unwritable"]
        assert "saving step 2" in msg and "step_00000001 is intact" in msg, msg
        assert "Permission denied" in msg or "rank 0 cannot write there" in msg, msg
    ck = tmp_path / "full" / "ckpt"
    assert (ck / "latest").read_text() == "step_00000001"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_00000001"]


def test_a_rank_lost_during_a_save_says_whether_the_step_was_published(tmp_path):
    """A peer lost in the save's last barrier, after rank 0 published the step: the survivor
    says the step is complete and a restart resumes from it (before: "saving step 1 failed
    ... the previous checkpoint is untouched", and the restart resumed from step 1). Lost
    before the publish: the save failed and `latest` still names the previous step."""
    from types import SimpleNamespace

    from fivefold.parallel.watchdog import RankLostError
    from fivefold.train.recovery import save_error
    from fivefold.train.trainer import Trainer

    cfg = cfg_for(tmp_path, "lost", "--parallel.dp", "1", "--checkpoint.keep", "5")
    with Trainer(cfg, quiet=True) as t:
        t.train_step()
        t.save_checkpoint()
    survivor = SimpleNamespace(cfg=cfg, step=1, dims=SimpleNamespace(rank=0),
                               watchdog=SimpleNamespace(active=True, lost_ranks=lambda: [1]))
    error = save_error(survivor, RuntimeError("[../third_party/gloo] Connection closed by peer"))
    assert isinstance(error, RankLostError)
    assert "lost rank 1 at the end of saving step 1" in str(error), error
    assert "a restart resumes from step 1" in str(error) and "failed" not in str(error), error
    survivor.step = 2  # not published: the save failed
    error = save_error(survivor, RuntimeError("Connection closed by peer"))
    assert "saving step 2 failed: lost rank 1" in str(error), error
    assert "step_00000001" in str(error) and "untouched" in str(error), error
    survivor.watchdog.lost_ranks = lambda: []  # every rank alive: not a loss, not ours
    assert save_error(survivor, RuntimeError("Connection closed by peer")) is None


def test_resuming_a_finished_run_says_there_is_nothing_to_do(tmp_path, capsys):
    """Before: exit 0 and no line at all."""
    from fivefold.cli import main

    args = ["train", "--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs",
            "1", "--model.hidden_size", "32", "--model.intermediate_size", "64",
            "--model.num_layers", "2", "--train.seq_len", "32", "--train.gbs", "4",
            "--train.steps", "2", "--train.device", "cpu", "--train.precision", "fp32",
            "--log.progress", "false", "--log.tensorboard", "false",
            "--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log")]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "nothing to do: checkpoint at step 2 ≥ train.steps 2" in out, out
    assert (tmp_path / "ck" / "latest").read_text() == "step_00000002"


def test_the_start_banner_prints_the_whole_layout_and_says_what_is_ignored(tmp_path):
    """Before: dp, tp, pp, cp and zero only (no ep, schedule, sp). (A pipeline schedule with
    pp 1 is refused: tests/test_one_line.py.)"""
    from fivefold.config import load
    from fivefold.train.loop import layout_line, layout_notes

    cfg = load(None, ["--parallel.tp", "2", "--parallel.sp", "true", "--parallel.pp", "2",
                      "--parallel.schedule", "zb", "--parallel.dp", "2", "--parallel.cp", "2",
                      "--train.seq_len", "64", "--train.gbs", "8"])
    line = layout_line(cfg)
    for part in ("dp=2", "tp=2", "pp=2", "cp=2", "ep=1", "zero=0", "sp=on", "schedule=zb",
                 "cp_layout=zigzag"):
        assert part in line, line
    moe = load(None, ["--model.preset", "tiny-moe", "--parallel.dp", "2", "--parallel.ep", "2",
                      "--data.tokenizer", "byte"])
    assert "ep=2" in layout_line(moe), layout_line(moe)
    assert layout_notes(cfg) == []
    assert "schedule=" not in layout_line(load(None, []))


def test_the_default_model_is_counted_the_same_everywhere(capsys):
    """README and presets said 1.06M; the run printed 1.05M (1,049,728)."""
    import inspect

    from fivefold.models import presets

    n = presets.preset("tiny-bpe").num_params()
    assert f"{n / 1e6:.2f}M parameters ({n:,})" in inspect.getsource(presets), n


def test_parallel_timeout_s_has_a_floor():
    """At 0.01 s healthy gloo collectives time out (and at 1-2 s the rendezvous itself)."""
    import pytest

    from fivefold.config import ConfigError, load

    with pytest.raises(ConfigError, match=r"parallel.timeout_s = 0.01 is below the floor of 5 s"):
        load(None, ["--parallel.timeout_s", "0.01"])
    assert load(None, ["--parallel.timeout_s", "5"]).parallel.timeout_s == 5


def test_a_convention_refuses_a_schedule_its_engine_does_not_run(capsys):
    """Before: `--convention deepspeed --layout ...,schedule=zb` planned zero-bubble although
    DeepSpeed's pipeline engine runs 1F1B only."""
    from fivefold.cli import main

    base = ["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--convention", "deepspeed",
            "--layout"]
    assert main([*base, "dp=2,pp=4,schedule=zb"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "schedule=zb is outside the deepspeed convention" in err and "1f1b" in err, err
    assert main([*base, "dp=2,pp=4,schedule=1f1b"]) == 0


if __name__ == "__main__":
    sys.exit("run with pytest")
