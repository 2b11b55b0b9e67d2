"""NVMe offload in `parallel.layout = auto`: `fivefold calibrate --offload-dir` measures the
disk into the profile, the profile's rate times the NVMe tier, the search picks NVMe where
only it fits, the engine runs the pick as it runs the same layout set by hand, and without a
measured disk NVMe is not searched and the printed choice says so."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from common import small_config

from fivefold import config
from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.parallel import nvme as engine_nvme
from fivefold.plan import auto_layout as planner
from fivefold.plan import nvme as plan_nvme
from fivefold.plan.hardware import get_hardware, load_profile, with_profile
from fivefold.plan.inputs import training_plan_inputs

CHUNK = 4096  # values per staging chunk, engine and planner alike: the tiny model's shard
#               spans several, so its states on disk outweigh the slots (as a real model's do)
# A profile as calibrate writes it on a CPU (tiny numbers of this kind of machine), with a disk
PROFILE = {"matmul": [{"m": 128, "k": 32, "n": 128, "thin": 32, "flops_per_s": 2e10}],
           "attention": [], "bus_gbps": {}, "memory_gbps": 5.0, "nvme_gbps": 0.5}


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(engine_nvme, "CHUNK_NUMEL", CHUNK)
    monkeypatch.setattr(plan_nvme, "CHUNK_NUMEL", CHUNK)


def test_calibrate_measures_the_disk_into_the_profile(tmp_path, capsys):
    out, disk = tmp_path / "profile.json", tmp_path / "offload" / "new"
    assert main(["calibrate", "--out", str(out), "--quick", "--world", "1", "--device", "cpu",
                 "--threads", "1", "--offload-dir", str(disk), "--disk-mib", "4"]) == 0
    printed = capsys.readouterr()
    assert "calibrate: disk: write (fsync) and read 4 MiB" in printed.err
    profile = json.loads(out.read_text())
    measured = profile["disk"]
    for key in ("write_gbps", "read_gbps", "nvme_gbps"):
        assert math.isfinite(measured[key]) and measured[key] > 0, (key, measured)
    assert measured["file_mib"] == 4 and measured["dir"] == str(disk.resolve())
    # read and written once each per step, one after the other: 2 / (1/read + 1/write)
    assert profile["nvme_gbps"] == pytest.approx(
        2 / (1 / measured["read_gbps"] + 1 / measured["write_gbps"]), rel=1e-12)
    assert f"disk {profile['nvme_gbps']:.3g} GB/s for offload" in printed.out
    assert not disk.exists()  # made for the file, and removed again with it
    # the planner's hardware takes the measured rate (auto's and plan --hw-profile's way)
    hw, _ = planner.auto_hardware(None, 1, 1.0, load_profile(out), on_cpu=True)
    assert hw.nvme_gbps == profile["nvme_gbps"] and hw.device_is_host
    catalog, _ = get_hardware("h100", {"nvme_gbps": "9"})
    assert with_profile(catalog, profile, ("nvme_gbps",)).nvme_gbps == 9.0  # --hw wins
    # a profile of no disk (or written before calibrate measured one) still loads: the
    # data sheet's rate stays, and nothing says a disk was measured
    older = {k: v for k, v in profile.items() if k not in ("disk", "nvme_gbps")}
    (tmp_path / "older.json").write_text(json.dumps(older))
    hw, _ = planner.auto_hardware(None, 1, 1.0, load_profile(tmp_path / "older.json"), True)
    assert hw.nvme_gbps == 3.8 and "no disk measured" in planner.nvme_note(
        _auto_config(tmp_path, 1.0), hw)
    (tmp_path / "bad.json").write_text(json.dumps(dict(profile, nvme_gbps=-1)))
    with pytest.raises(ConfigError, match="nvme_gbps"):
        load_profile(tmp_path / "bad.json")


def _auto_config(root: Path, budget: float, *more: str):
    return small_config(root, "--parallel.layout", "auto", "--train.memory_budget_gib",
                        str(budget), "--parallel.offload_dir", str(root / "offload"),
                        "--train.steps", "2", *more)


def _choose(cfg, profile: dict | None, budget: float):
    hw, assume = planner.auto_hardware(None, 1, budget, profile, on_cpu=True)
    return planner.choose(cfg, 1, hw, assume, "fp32", "train.memory_budget_gib", "test",
                          on_cpu=True)


def _nvme_only_budget(root: Path) -> float:
    """A budget between what the tiny model needs with its states on disk and the least any
    layout keeping them in memory needs (on a CPU, CPU offload keeps them in the same
    memory): the planner's own numbers, each checked by a search."""
    cfg = _auto_config(root, 1.0)
    work, _ = training_plan_inputs(cfg)
    hw, assume = planner.auto_hardware(None, 1, 1.0, PROFILE, on_cpu=True)
    from fivefold.plan.evaluate import plan_layout
    from fivefold.plan.layout import Layout

    def need(offload, zero) -> float:
        lay = Layout(zero=zero, offload=offload, recompute="full")
        return plan_layout(dataclasses.replace(work, precision="fp32"), lay, hw,
                           assume).memory_total / 2**30

    resident, on_disk, on_host = need(False, 0), need("nvme", 1), need(True, 1)
    assert on_disk < resident <= on_host, (on_disk, resident, on_host)
    return (on_disk + resident) / 2


def _losses(log: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (log / "metrics.jsonl").open()]


def test_only_nvme_fits_so_auto_picks_it_and_trains_like_it_set_by_hand(tmp_path, capsys,
                                                                       small_chunks):
    budget = _nvme_only_budget(tmp_path / "plan")
    # without a disk to put them on, nothing fits this budget
    with pytest.raises(ConfigError, match="below what any layout of 1 rank.* needs; .*NVMe "
                       "offload not searched: no disk measured"):
        _choose(_auto_config(tmp_path / "a", budget), {**PROFILE, "nvme_gbps": None}, budget)
    (tmp_path / "profile.json").write_text(json.dumps(PROFILE))
    auto = tmp_path / "auto"
    code = main(["train", *_argv(auto, budget), "--parallel.layout", "auto",
                 "--hw-profile", str(tmp_path / "profile.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    chosen = next(line for line in out.splitlines() if line.startswith("  chosen"))
    assert "z1+nvme" in chosen, out
    assert "NVMe offload not searched" not in out
    meta = json.loads((auto / "ck" / "step_00000002" / "meta.json").read_text())
    fields = meta["auto_layout"]["fields"]
    assert fields["offload"] == "nvme" and meta["config"]["parallel"]["offload"] == "nvme"
    assert not (auto / "offload").exists()  # the run made it and removed it with its files
    # the same layout by hand: the same arithmetic, the same losses
    hand = tmp_path / "hand"
    code = main(["train", *_argv(hand, 0), "--parallel.zero", "1", "--parallel.offload",
                 "nvme", "--train.recompute", fields["recompute"], "--parallel.mbs",
                 str(fields["mbs"])])
    assert code == 0, capsys.readouterr().err
    assert len(_losses(auto)) == 2 and _losses(auto) == _losses(hand)


def _argv(root: Path, budget: float) -> list[str]:
    keys = [  # small_config's, for the CLI
        "--model.hidden_size", "32", "--model.intermediate_size", "64",
            "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
            "--train.seq_len", "32", "--train.gbs", "4", "--train.steps", "2",
            "--train.warmup_steps", "0", "--train.eval_every", "0", "--train.precision",
            "fp32", "--train.device", "cpu", "--model.preset", "tiny", "--data.tokenizer",
            "byte", "--parallel.mbs", "1", "--checkpoint.dir", str(root / "ck"),
            "--checkpoint.every", "2", "--log.dir", str(root), "--log.progress", "false",
            "--log.tensorboard", "false", "--parallel.offload_dir", str(root / "offload")]
    return keys + (["--train.memory_budget_gib", str(budget)] if budget else [])


def test_without_a_measured_disk_nvme_is_not_searched_and_the_choice_says_so(tmp_path,
                                                                             small_chunks):
    cfg = _auto_config(tmp_path, 1.0)
    for profile in (None, {k: v for k, v in PROFILE.items() if k != "nvme_gbps"}):
        pick = _choose(cfg, profile, 1.0)
        assert pick.best.layout.offload is False
        lines = planner.describe(pick)
        assert lines[-1] == ("  NVMe offload not searched: no disk measured (no nvme_gbps in a "
                             "--hw-profile; `fivefold calibrate --offload-dir DIR` measures it)")
    # with a disk measured and room for everything, the states stay in memory
    pick = _choose(cfg, PROFILE, 1.0)
    assert pick.best.layout.offload is False and not pick.nvme_note
    # no offload_dir: the engine would have nowhere to write, so not searched either
    bare = small_config(tmp_path / "bare", "--parallel.layout", "auto")
    hw, _ = planner.auto_hardware(None, 1, 1.0, PROFILE, on_cpu=True)
    assert "no parallel.offload_dir" in planner.nvme_note(bare, hw)
    # a profile whose disk lies on another file system than the run's offload_dir: a note
    from fivefold.train.auto_layout import disk_elsewhere

    measured = {"disk": {"dir": str(tmp_path)}}
    assert disk_elsewhere(measured, str(tmp_path / "not" / "made" / "yet")) == ""
    assert "another file system" in disk_elsewhere(measured, "/proc/fivefold-offload")
    # a parallel.offload the user sets is kept, disk measured or not
    kept = _auto_config(tmp_path / "kept", 1.0, "--parallel.offload", "nvme",
                        "--parallel.zero", "1")
    assert _choose(kept, None, 1.0).best.layout.offload == "nvme"


def test_a_gpu_host_too_small_for_cpu_offload_gets_nvme_the_engine_runs(tmp_path,
                                                                        small_chunks):
    """On 2 GPUs whose budget fits only offloaded states: with host memory to spare CPU
    offload (faster), with host memory below CPU offload's states NVMe; each pick and
    runner-up passes the safety test's independent refusal (every field copied by hand)."""
    from test_safety import _independent_refusal

    from fivefold.plan.layout import Layout

    cfg = config.load(None, ["--model.preset", "tiny", "--parallel.layout", "auto",
                             "--train.gbs", "16", "--train.seq_len", "128",
                             "--parallel.offload_dir", str(tmp_path / "offload")])
    profile = {"matmul": [{"thin": 4096, "flops_per_s": 7e14}], "attention": [],
               "bus_gbps": {}, "nvme_gbps": 5.0}
    budget = 0.004  # GiB: below every resident layout's need on 2 ranks (planned)
    tiers = {}
    for host in (0.0, 0.001):
        hw, assume = planner.auto_hardware(None, 2, budget, profile, False, host)
        pick = planner.choose(cfg, 2, hw, assume, "bf16", "train.memory_budget_gib", "test",
                              on_cpu=False)
        tiers[host] = pick.best.layout.offload
        assert pick.runner_up is not None
        for plan in (pick.best, pick.runner_up):
            fields = planner.record(dataclasses.replace(pick, best=plan))["fields"]
            lay = Layout(**dict(fields, pp_layers=tuple(fields["pp_layers"])))
            assert _independent_refusal(planner.apply(cfg, plan, budget), lay) is None
            assert plan.fits and plan.layout.offload
        if host:
            assert pick.best.cpu_bytes <= host * 2**30 < pick.best.disk_bytes
    assert tiers == {0.0: True, 0.001: "nvme"}
