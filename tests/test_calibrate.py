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
    for sizes in faster["call_us"].values():
        for points in sizes.values():
            for point in points:
                point[1] /= 2
    path = tmp_path / "faster.json"
    path.write_text(json.dumps(faster))
    quick = _plan(capsys, "--hw-profile", str(path))
    assert quick["step_time_parts_s"]["compute"] < measured["step_time_parts_s"]["compute"]
    assert quick["step_time_parts_s"]["tp_comm"] < measured["step_time_parts_s"]["tp_comm"]

    # Each collective was timed over a sweep of message sizes, bytes growing, time too (the
    # bandwidth message last); the planner takes a call's time at its size from them: 1 ms
    # more per call at every size adds 1 ms per tensor-parallel call of the step.
    assert 0 < profile["latency_us"]["2"] < 1e6
    for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv"):
        points = profile["call_us"][op]["2"]
        assert [b for b, _ in points] == [1024, 8192, 65536], op
        assert all(us > 0 for _, us in points), op
    slow = copy.deepcopy(profile)
    for sizes in slow["call_us"].values():
        for points in sizes.values():
            for point in points:
                point[1] += 1000
    path.write_text(json.dumps(slow))
    late = _plan(capsys, "--hw-profile", str(path))
    calls = late["step_time_parts_s"]["tp_comm"] - measured["step_time_parts_s"]["tp_comm"]
    assert calls > 1e-3 * 4  # at least the 4 calls of one layer's forward and backward

    # The host time per layer was measured, and on a CPU it adds to every layer of every
    # micro-batch: 10 ms more per layer adds 10 ms × 16 layers × the micro-batches.
    assert 0 <= profile["host_layer_ms"] < 1e3  # a difference of two timings: may round to 0
    busy = copy.deepcopy(profile)
    busy["host_layer_ms"] = profile["host_layer_ms"] + 10.0
    path.write_text(json.dumps(busy))
    hosted = _plan(capsys, "--hw-profile", str(path))
    added = hosted["step_time_parts_s"]["compute"] - measured["step_time_parts_s"]["compute"]
    expect = 10e-3 * 16 * hosted["num_microbatches"]  # llama-3.2-1b: 16 layers, all on rank
    assert abs(added - expect) < 1e-9 * expect + 1e-12, (added, expect)
    # A GPU's profile: the host time only bounds a micro-batch from below (kernels queue
    # ahead), so 10 ms more per layer adds less than on the CPU here, where it all adds.
    gpu = copy.deepcopy(busy)
    gpu["device"] = "NVIDIA H100 80GB HBM3"
    path.write_text(json.dumps(gpu))
    bounded = _plan(capsys, "--hw-profile", str(path))
    assert bounded["step_time_parts_s"]["compute"] < hosted["step_time_parts_s"]["compute"]


def test_bad_profile_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"matmul": []}))
    assert cli_main([*PLAN, "--hw-profile", str(bad)]) == 2
    assert "--hw-profile" in capsys.readouterr().err


def test_a_calls_time_follows_the_swept_sizes():
    """profile_call_s: linear in bytes between the sizes calibrate timed, the smallest's
    time below them, the largest's bandwidth above, the nearest group size measured; and
    collective_time pays it per call, falling back to latency and bandwidth without it."""
    import dataclasses

    from fivefold.plan.comm import Collective
    from fivefold.plan.hardware import CATALOG, Assumptions, profile_call_s
    from fivefold.plan.layout import Layout
    from fivefold.plan.timing import collective_time

    points = [[4096, 100.0], [65536, 400.0], [1 << 20, 2000.0]]
    profile = {"matmul": [{"thin": 128, "flops_per_s": 1e11}], "attention": [],
               "bus_gbps": {"all_reduce": {"4": 1.0}}, "latency_us": {"4": 50.0},
               "call_us": {"all_reduce": {"4": points}}}
    hw = dataclasses.replace(CATALOG["h100-sxm"], gpus_per_node=4, profile=profile)
    us = 1e-6
    assert profile_call_s(hw, "all_reduce", 4, 4096) == 100 * us
    assert abs(profile_call_s(hw, "all_reduce", 4, (4096 + 65536) / 2) - 250 * us) < 1e-12
    assert profile_call_s(hw, "all_reduce", 4, 100) == 100 * us  # below: the smallest's
    assert abs(profile_call_s(hw, "all_reduce", 4, 2 << 20) - 4000 * us) < 1e-12  # above
    assert profile_call_s(hw, "all_reduce", 8, 4096) == 100 * us  # nearest group measured
    assert profile_call_s(hw, "all_gather", 4, 4096) is None  # not swept

    lay = Layout(tp=4)
    call = Collective("tp", "all_reduce", 4, 65536 / 4, 10, 4, "fwd")
    assert abs(collective_time(call, hw, Assumptions(), lay) - 10 * 400 * us) < 1e-12
    # without the sweep: the measured latency per call plus bytes at the measured bandwidth
    old = dataclasses.replace(hw, profile={k: v for k, v in profile.items() if k != "call_us"})
    wire = 10 * 65536 * 2 * 3 / 4
    expect = wire / 1e9 + 10 * 50 * us
    assert abs(collective_time(call, old, Assumptions(), lay) - expect) < 1e-9
