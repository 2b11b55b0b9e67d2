"""ZeRO-3's FP8 all-gather (parallel.fp8_allgather) holds its own bytes beside the gathered
units' bf16 buffers: a gathered FP8 unit's codes (1 byte per element) and, while a gather is
in flight, its send and receive messages. The peak tracker counts them under comm_buffers
(parallel/zero3.py `fp8_buffers`) and the planner predicts them (plan/comm_buffers.py
`fp8_gather_buffers`).

The planner counts a message at the unit's bytes (FP8 weights at 1, the rest at 2) divided
by the ranks; the engine pads each rank's message to the longest rank's, aligned to the
dtype. So at a peak with one FP8 unit in flight the engine holds exactly (n + 1)/n times
that unit's padding of the receive buffer (n ranks) more than the plan: the test computes it
from the engine's units and asserts the difference equals it (no other tolerance). Without
the option the two agree to the byte, as tests/test_plan_agreement.py holds for every layout.
"""

import pathlib

import pytest
from common import small_config
from harness import run_ranks

from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.peak import PeakTracker
from fivefold.plan.comm_buffers import dp_comm_buffer_bytes
from fivefold.plan.inputs import training_plan_inputs
from fivefold.train.trainer import Trainer

MODEL = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_layers",
         "3", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "64",
         "--train.gbs", "4", "--parallel.mbs", "2", "--train.precision", "fp8",
         "--train.fp8_recipe", "tensorwise", "--parallel.dp", "2", "--parallel.zero", "3"]


def measure(rank, world, tmp, fp8_allgather, extra=()):
    cfg = small_config(pathlib.Path(tmp), *MODEL, "--parallel.fp8_allgather", fp8_allgather,
                       *extra)
    trainer = Trainer(cfg, ParallelDims.from_config(cfg.parallel), quiet=True)
    gatherer = trainer.optimizer.gatherer
    with PeakTracker(trainer.peak_sources()) as tracker:
        trainer.train_step()
    n = gatherer.group.size
    paddings = set()  # per FP8 unit: the in-flight messages' bytes beyond the plan's
    for unit in gatherer.fp8.values():
        fp8 = sum(numel for _, _, _, numel, _ in unit.entries)
        unit_bytes = fp8 + 2 * (unit.seg.size - fp8)
        paddings.add((n + 1) * (n * unit.message - unit_bytes) / n)
    trainer.close()
    work, layout = training_plan_inputs(cfg)
    return {"engine": tracker.item_peaks["comm_buffers"],
            "plan": dp_comm_buffer_bytes(work, layout, 0), "paddings": paddings}


# every layer MoE: the routed experts' weights are FP8 in the units' messages too
MOE = ("--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "32")


@pytest.mark.parametrize("extra", [(), MOE], ids=["dense", "moe"])
def test_fp8_gather_buffers_are_counted_by_the_tracker_and_the_planner(tmp_path, extra):
    off = run_ranks(measure, 2, str(tmp_path / "off"), "false", extra)
    on = run_ranks(measure, 2, str(tmp_path / "on"), "true", extra)
    for a, b in zip(off, on):
        assert a["engine"] == a["plan"] and not a["paddings"]
        assert b["engine"] - b["plan"] in b["paddings"], (b["engine"], b["plan"], b["paddings"])
        # the FP8 gather's own bytes: about one unit's codes and 1.5 units' FP8 messages
        assert b["engine"] - a["engine"] > 0 and b["plan"] > a["plan"]
