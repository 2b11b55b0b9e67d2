"""ZeRO-3's FP8 all-gather (parallel.fp8_allgather) holds its own bytes beside the gathered
units' bf16 buffers: a gathered FP8 unit's codes (1 byte per element) and, while a gather is
in flight, its send and receive messages. The peak tracker counts them under comm_buffers
(parallel/zero3.py `fp8_buffers`) and the planner predicts them (plan/comm_buffers.py
`fp8_gather_buffers`).

The planner counts a message at the unit's bytes (FP8 weights at 1, the rest at 2) divided
by the ranks; the engine pads each rank's message to the longest rank's, aligned to the
dtype. So at a peak with one FP8 unit in flight the engine holds exactly (n + 1)/n times
that unit's padding of the receive buffer (n ranks) more than the plan: the test computes it
from the engine's units and asserts the difference equals it (no other tolerance), or is 0
where the peak holds no FP8 message (a train.fp8_keep_out case below). Without
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


# train.fp8_keep_out: a block left all in bf16 gathers as a bf16 unit (no codes, no FP8
# message; the first, or the middle one between two FP8 blocks), o_proj in bf16 rides in
# every unit's message at 2 bytes, and a MoE layer's routed experts in bf16 likewise. With
# the first block in bf16 the peak falls in backward while block 1 is in use and block 0
# (bf16) is prefetched: no FP8 message in flight, so no padding: the two agree to the byte.
KEEP = [pytest.param(("--train.fp8_keep_out", "layers.0"), False, id="keep-first"),
        pytest.param(("--train.fp8_keep_out", "layers.1"), True, id="keep-middle",
                     marks=pytest.mark.slow),
        pytest.param(("--train.fp8_keep_out", "o_proj"), True, id="keep-o"),
        pytest.param((*MOE, "--train.fp8_keep_out", "layers.1.mlp.experts,q_proj"), True,
                     id="moe-keep-experts")]


@pytest.mark.parametrize("extra, in_flight", [pytest.param((), True, id="dense"),
                                              pytest.param(MOE, True, id="moe"), *KEEP])
def test_fp8_gather_buffers_are_counted_by_the_tracker_and_the_planner(tmp_path, extra,
                                                                        in_flight):
    off = run_ranks(measure, 2, str(tmp_path / "off"), "false", extra)
    on = run_ranks(measure, 2, str(tmp_path / "on"), "true", extra)
    for a, b in zip(off, on):
        assert a["engine"] == a["plan"] and not a["paddings"]
        expected = b["paddings"] if in_flight else {0}
        assert b["engine"] - b["plan"] in expected, (b["engine"], b["plan"], b["paddings"])
        # the FP8 gather's own bytes: about one unit's codes and 1.5 units' FP8 messages
        assert b["engine"] - a["engine"] > 0 and b["plan"] > a["plan"]
