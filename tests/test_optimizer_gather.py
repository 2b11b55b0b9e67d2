"""Muon and Adafactor under ZeRO gather one whole tensor at a time (parallel/zero_rules.py
ZeroAssembler), not a copy of the model.

- The update is the same computation on the same values as the whole-model gather it
  replaced (`zero_rules.WHOLE_MODEL_GATHER`, kept for this comparison and the benchmark):
  weights, losses, gradient norms and states are bit-equal after 3 steps at dp2 ZeRO-0/1/2/3
  (no tolerance: gathering copies values, it rounds nothing).
- The most a rank holds gathered during the step is the largest tensor the rule gathers,
  in fp32, to the byte: the planner's `gathered_bytes` (plan/optimizer.py), though the next
  tensor's gather is in flight beside the current one where both fit in that; the old
  gather held the whole padded flat buffer.
- Through the trainer, the comm_buffers item of the peak tracker equals the planner's, to
  the byte (tests/test_plan_agreement.py's tolerance for that item), under ZeRO-1/3, tp and
  pp. (Under dp x tp, a rank holding no part of a tensor drops it before the tp gather and
  holds less than the plan, which is the most-loaded rank's.)
"""

from __future__ import annotations

import pytest
import torch
from harness import run_ranks
from test_data_parallel import build, final_params, make_cfg, train

from fivefold.parallel import zero_rules
from fivefold.parallel.muon import takes
from fivefold.parallel.peak import PeakTracker
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.optimizer import gathered_bytes

STEPS = 3
OVERRIDES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128}
CASES = [("muon", {}), ("adafactor", {"adafactor_relative_step": True}),
         ("adafactor", {"adafactor_relative_step": False})]


def _cfg(dp, zero, optimizer, options):
    cfg = make_cfg(dp, zero)
    cfg.model.overrides = dict(OVERRIDES)
    cfg.train.optimizer = optimizer
    for key, value in options.items():
        setattr(cfg.optim, key, value)
    return cfg


def _run(rank, world, zeros):
    out = {}
    for zero in zeros:
        for k, (optimizer, options) in enumerate(CASES):
            runs = {}
            for whole in (True, False):
                zero_rules.WHOLE_MODEL_GATHER = whole
                cfg = _cfg(world, zero, optimizer, options)
                model, _, opt = build(cfg, torch.float32)
                held = []  # how many tensors each sample finds gathered

                def gathered(opt=opt, held=held):
                    held.append(len(opt._optimizer_gathered()))
                    return opt._optimizer_gathered()

                tracker = PeakTracker({"gathered": gathered})
                with tracker:
                    losses, norms = train(model, opt, rank, world, STEPS)
                params = final_params(opt)
                states = {n: {key: v for key, v in s.items() if key not in ("param", "master")}
                          for n, s in opt.param_states().items()}
                own = [(v[-1] if isinstance(v, tuple) else v).clone()  # (desc, lo, hi, flat)
                       for *_, views in opt.shard_states() for v in views.values()]
                wanted = [s for s in opt.layout.params
                          if optimizer != "muon" or takes(s.name, s.param,
                                                          cfg.optim.muon_exclude)]
                runs[whole] = {"losses": losses, "norms": norms, "params": params,
                               "states": states, "own": own,
                               "gathered": tracker.item_peaks["gathered"],
                               "most_at_once": max(held),
                               "largest": 4 * max(s.numel for s in wanted),
                               "flat": 4 * opt.layout.total}
                opt.close()
            zero_rules.WHOLE_MODEL_GATHER = False
            out[(zero, k)] = runs
    return out


def test_matrix_at_a_time_is_bit_equal_to_the_whole_model_gather_and_holds_the_largest():
    got = run_ranks(_run, 2, (0, 1, 2, 3))
    for rank_out in got:
        for (zero, k), runs in rank_out.items():
            label = (zero, CASES[k])
            new, old = runs[False], runs[True]
            assert new["losses"] == old["losses"] and new["norms"] == old["norms"], label
            for name, value in old["params"].items():
                assert torch.equal(new["params"][name], value), (label, name)
            for name, states in old["states"].items():
                for key, value in states.items():
                    assert torch.equal(new["states"][name][key], value), (label, name, key)
            assert len(new["own"]) == len(old["own"])
            assert all(torch.equal(a, b) for a, b in zip(new["own"], old["own"])), label
            # ZeRO-0 reads each whole piece where it lies: nothing gathered. Under ZeRO the
            # next tensor's gather is in flight beside the current one when both fit in the
            # largest's bytes: two at once, never more bytes than the largest
            assert new["gathered"] == (new["largest"] if zero else 0), (label, new)
            assert new["most_at_once"] == (2 if zero else 0), (label, new)
            assert old["gathered"] >= old["flat"] > 4 * new["largest"], (label, old)
            plan = gathered_bytes(
                Workload(model=_cfg(2, zero, *CASES[k]).model.resolve(), seq_len=16, gbs=16,
                         precision="fp32", optimizer=CASES[k][0]),
                Layout(dp=2, zero=zero, mbs=1))
            assert new["gathered"] == plan, (label, new["gathered"], plan)


# --- through the trainer: the peak tracker's comm_buffers item against the planner's -------
DP2 = ["--parallel.dp", "2"]
TRAINER_CASES = {
    "dp2-zero1-muon": [*DP2, "--parallel.zero", "1", "--train.optimizer", "muon"],
    "dp2-zero3-muon": [*DP2, "--parallel.zero", "3", "--train.optimizer", "muon"],
    "dp2-zero1-adafactor": [*DP2, "--parallel.zero", "1", "--train.optimizer", "adafactor"],
    "dp2-zero3-adafactor": [*DP2, "--parallel.zero", "3", "--train.optimizer", "adafactor"],
    # one replica: each tensor-parallel matrix gathered whole (train/optim.py)
    "tp2-muon": ["--parallel.tp", "2", "--train.optimizer", "muon"],
    # each pipeline stage gathers its own tensors: the embedding, and its tied copy on the last
    "pp2-dp2-zero1-adafactor": ["--parallel.pp", "2", "--model.num_layers", "4",
                                "--parallel.mbs", "1", *DP2, "--parallel.zero", "1",
                                "--train.gbs", "8", "--train.optimizer", "adafactor"],
}


@pytest.mark.parametrize("name", list(TRAINER_CASES))
def test_comm_buffers_at_the_peak_equal_the_plan(name, tmp_path, capsys):
    """Every rank's comm_buffers peak equals the planner's to the byte: the gathered tensor
    under ZeRO-1 (nothing else is in flight there), and under ZeRO-3 the larger of it and
    the gathered units of backward."""
    from common import small_config
    from test_plan_agreement import MODEL, check_peak_items, measure, planned

    args = TRAINER_CASES[name]
    world = small_config(tmp_path, *MODEL, *args).parallel.world_size
    for got in run_ranks(measure, world, str(tmp_path), args):
        peaks = planned(tmp_path, args, got["precision"], got["pp_rank"])[5]
        assert peaks["comm_buffers"] > 0
        check_peak_items(got, peaks, name, capsys)
