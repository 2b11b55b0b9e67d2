"""`fivefold calibrate` end to end on CPU/gloo (tiny shapes), and its profile in the planner."""

import copy
import json
import subprocess
import sys

from fivefold.cli import main as cli_main

PLAN = ["plan", "--model", "llama-3.2-1b", "--gpus", "2", "--gbs", "8", "--seq-len", "1024",
        "--layout", "tp=2", "--json"]


def _plan(capsys, *extra):
    assert cli_main([*PLAN, *extra]) == 0
    return json.loads(capsys.readouterr().out)["layouts"][0]


def test_calibrate_writes_a_profile_the_planner_reads(tmp_path, capsys):
    out = tmp_path / "profile.json"
    run = subprocess.run([sys.executable, "-m", "fivefold.cli", "calibrate", "--out", str(out),
                          "--quick", "--world", "2", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    profile = json.loads(out.read_text())
    assert [m["k"] for m in profile["matmul"]] == [32, 64, 128]
    assert all(m["flops_per_s"] > 0 for m in profile["matmul"] + profile["attention"])
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        assert profile["bus_gbps"][op]["2"] > 0, op

    catalog = _plan(capsys)
    measured = _plan(capsys, "--hw-profile", str(out))
    # This CPU multiplies and communicates far below an H100's peaks: every part slows down.
    assert measured["step_time_parts_s"]["compute"] > 10 * catalog["step_time_parts_s"]["compute"]
    assert measured["step_time_parts_s"]["tp_comm"] > catalog["step_time_parts_s"]["tp_comm"]

    # A machine twice as fast at every GEMM shape and twice the bus bandwidth: both parts drop.
    faster = copy.deepcopy(profile)
    for m in faster["matmul"] + faster["attention"]:
        m["flops_per_s"] *= 2
    for sizes in faster["bus_gbps"].values():
        for n in sizes:
            sizes[n] *= 2
    path = tmp_path / "faster.json"
    path.write_text(json.dumps(faster))
    quick = _plan(capsys, "--hw-profile", str(path))
    assert quick["step_time_parts_s"]["compute"] < measured["step_time_parts_s"]["compute"]
    assert quick["step_time_parts_s"]["tp_comm"] < measured["step_time_parts_s"]["tp_comm"]

    # The measured latency of a call is what each collective call costs beyond its bytes:
    # 1 ms more per call adds 1 ms per tensor-parallel call of the step.
    assert 0 < profile["latency_us"]["2"] < 1e6
    slow = copy.deepcopy(profile)
    slow["latency_us"] = {n: v + 1000 for n, v in profile["latency_us"].items()}
    path.write_text(json.dumps(slow))
    late = _plan(capsys, "--hw-profile", str(path))
    calls = late["step_time_parts_s"]["tp_comm"] - measured["step_time_parts_s"]["tp_comm"]
    assert calls > 1e-3 * 4  # at least the 4 calls of one layer's forward and backward


def test_bad_profile_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"matmul": []}))
    assert cli_main([*PLAN, "--hw-profile", str(bad)]) == 2
    assert "--hw-profile" in capsys.readouterr().err
