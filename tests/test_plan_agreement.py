"""The planner and the engine agree: model-state bytes (1%), saved activations (10%) and the
communication ledger (exactly) of every layout the engine runs, measured on the engine."""

import pathlib

import pytest
from common import small_config
from harness import run_ranks

from fivefold.parallel.memory import SavedActivations
from fivefold.parallel.mesh import ParallelDims
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.comm import ledger_volume
from fivefold.plan.inputs import training_plan_inputs
from fivefold.plan.memory import model_state_bytes
from fivefold.train.trainer import Trainer

# A model big enough that per-tensor terms dominate: hidden 64, 4 heads of 16, 2 kv heads.
MODEL = ["--model.hidden_size", "64", "--model.intermediate_size", "128", "--model.num_layers",
         "2", "--model.num_heads", "4", "--model.num_kv_heads", "2", "--train.seq_len", "64",
         "--train.gbs", "4", "--parallel.mbs", "2"]

LAYOUTS = {
    "single": [],
    "single-selective": ["--train.recompute", "selective"],
    "single-full": ["--train.recompute", "full"],
    "single-bf16": ["--train.precision", "bf16"],
    "tp2": ["--parallel.tp", "2"],
    "tp2-sp": ["--parallel.tp", "2", "--parallel.sp", "true"],
    "tp4-sp-full": ["--parallel.tp", "4", "--parallel.sp", "true", "--train.recompute", "full"],
    "dp2": ["--parallel.dp", "2"],
    "dp2-zero1-bf16": ["--parallel.dp", "2", "--parallel.zero", "1", "--train.precision", "bf16"],
    "dp2-zero2": ["--parallel.dp", "2", "--parallel.zero", "2"],
    "dp4-zero3-bf16": ["--parallel.dp", "4", "--parallel.zero", "3", "--train.precision", "bf16",
                       "--train.gbs", "8"],
    "dp2-zero1-offload": ["--parallel.dp", "2", "--parallel.zero", "1", "--parallel.offload",
                          "true"],
    "dp2-tp2-sp-zero1": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sp", "true",
                         "--parallel.zero", "1"],
}


def measure(rank, world, tmp, args):
    cfg = small_config(pathlib.Path(tmp), *MODEL, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    dims.ledger.enabled = True
    trainer.train_step()
    ledger = {}
    for (group, op), t in dims.ledger.totals().items():
        ledger.setdefault(group, {})[op] = t["bytes"]
    x, y = trainer.loader.next_batch()[0]
    params = [p for _, p in trainer.model.named_parameters()]
    with SavedActivations(params) as meter:
        trainer.model.chunks[0](x, y)
    return {"ledger": ledger, "memory": trainer.optimizer.memory_bytes(),
            "activations": meter.bytes, "precision": trainer.precision}


def planned(tmp, args, precision):
    cfg = small_config(pathlib.Path(tmp), *MODEL, *args)
    par = cfg.parallel
    work, layout = training_plan_inputs(cfg)
    work = work.__class__(**{**work.__dict__, "precision": precision})
    states = model_state_bytes(work.model, tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp,
                               zero=par.zero, offload=par.offload, precision=precision)
    acts = activation_bytes_per_microbatch(
        work.model, par.mbs, cfg.train.seq_len, tp=par.tp, sp=par.sp,
        recompute=cfg.train.recompute, dtype_bytes=4 if precision == "fp32" else 2, flash=True)
    activations = acts.layer * work.model.num_layers + sum(acts.outside_terms.values())
    return states, activations, ledger_volume(work, layout)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_agrees_with_engine(name, tmp_path, capsys):
    args = LAYOUTS[name]
    world = small_config(tmp_path, *MODEL, *args).parallel.world_size
    if world == 1:
        results = [measure(0, 1, str(tmp_path), args)]
    else:
        results = run_ranks(measure, world, str(tmp_path), args)
    got = results[0]
    states, activations, ledger = planned(tmp_path, args, got["precision"])
    plan_items = {k: getattr(states, k) for k in ("params", "grads", "master", "optimizer")}
    measured = dict(got["memory"])
    if "--parallel.offload" in args:  # the planner books offloaded states as host memory
        assert plan_items["master"] == plan_items["optimizer"] == 0 and states.cpu > 0
        plan_items = {"params": states.params, "grads": states.grads, "host": states.cpu}
        measured["host"] = measured.pop("master") + measured.pop("optimizer")
    for item, plan in plan_items.items():
        assert abs(measured[item] - plan) <= 0.01 * max(plan, 1), (item, measured, plan)
    with capsys.disabled():
        print(f"\n{name}: activations measured {got['activations']} planned {activations:.0f} "
              f"({got['activations'] / activations:.3f})")
    assert abs(got["activations"] - activations) <= 0.10 * activations
    plan_ledger = {g: {op: b for op, b in ops.items() if b} for g, ops in ledger.items()}
    plan_ledger = {g: ops for g, ops in plan_ledger.items() if ops}
    assert got["ledger"] == plan_ledger
    for other in results[1:]:  # every rank holds and moves the same amounts
        assert other["ledger"] == got["ledger"] and other["memory"] == got["memory"]
