"""The planner and the engine agree: model-state bytes (1%), one micro-batch's saved
activations (2.5%), the peak items both name (the gradients accumulating whole, the loss's
logits and the DP/ZeRO buckets and gathered units to the byte, the activations in flight
within 0.25%; each known exception named with its own tolerance and reason) and the
communication ledger (exactly) of every layout the engine runs, measured on the engine, on
every rank (pipeline ranks differ: each is compared with the planner's prediction for it)."""

import json
import pathlib

import pytest
import torch
from common import small_config
from harness import run_ranks

from fivefold.parallel.memory import SavedActivations
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.peak import PeakTracker
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.comm import ledger_volume
from fivefold.plan.comm_buffers import dp_comm_buffer_bytes
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.hardware import Assumptions, get_hardware
from fivefold.plan.inputs import training_plan_inputs
from fivefold.plan.memory import memory_items
from fivefold.plan.model_states import model_state_bytes
from fivefold.plan.placement import stage
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
    "tp2-sp-shard": ["--parallel.tp", "2", "--parallel.sp", "true", "--parallel.sp_saved_input",
                     "shard"],
    "tp4-sp-shard-full": ["--parallel.tp", "4", "--parallel.sp", "true",
                          "--parallel.sp_saved_input", "shard", "--train.recompute", "full"],
    "dp2": ["--parallel.dp", "2"],
    "dp2-zero1-bf16": ["--parallel.dp", "2", "--parallel.zero", "1", "--train.precision", "bf16"],
    "dp2-zero2": ["--parallel.dp", "2", "--parallel.zero", "2"],
    "dp4-zero3-bf16": ["--parallel.dp", "4", "--parallel.zero", "3", "--train.precision", "bf16",
                       "--train.gbs", "8"],
    # Enough blocks that ZeRO-3's backward peak has k blocks staged beside the rest unit.
    "dp2-zero3-layers6": ["--parallel.dp", "2", "--parallel.zero", "3", "--model.num_layers",
                          "6"],
    "dp2-zero3-layers6-k1": ["--parallel.dp", "2", "--parallel.zero", "3",
                             "--model.num_layers", "6", "--parallel.buckets_in_flight", "1"],
    "dp2-zero1-offload": ["--parallel.dp", "2", "--parallel.zero", "1", "--parallel.offload",
                          "true"],
    "dp2-tp2-sp-zero1": ["--parallel.dp", "2", "--parallel.tp", "2", "--parallel.sp", "true",
                         "--parallel.zero", "1"],
}
# Pipelines: 4 layers (two chunks per rank for interleaved and DualPipeV), 4 micro-batches of 1
# (DualPipeV needs 2·pp); the model's tied embeddings put a copy on the first and last stage.
PP = ["--parallel.pp", "2", "--model.num_layers", "4", "--parallel.mbs", "1"]
LAYOUTS.update({
    "pp2-1f1b": PP,
    "pp2-afab-selective": [*PP, "--parallel.schedule", "afab", "--train.recompute", "selective"],
    "pp2-interleaved": [*PP, "--parallel.schedule", "interleaved", "--parallel.virtual_stages",
                        "2"],
    "pp2-zb": [*PP, "--parallel.schedule", "zb"],
    "pp2-dualpipev": [*PP, "--parallel.schedule", "dualpipev"],
    "pp2-dp2-zero1-bf16": [*PP, "--parallel.dp", "2", "--parallel.zero", "1",
                           "--train.precision", "bf16", "--train.gbs", "8"],
    "pp2-tp2-sp": [*PP, "--parallel.tp", "2", "--parallel.sp", "true"],
    "pp2-tp2-sp-shard": [*PP, "--parallel.tp", "2", "--parallel.sp", "true",
                         "--parallel.sp_saved_input", "shard"],
    "pp2-layers-1-3": [*PP, "--parallel.pp_layers", "1,3"],
    "pp2-balanced": [*PP, "--parallel.pp_split", "balanced", "--model.vocab_size", "1024"],
    "pp2-interleaved-layers": [*PP, "--parallel.schedule", "interleaved",
                               "--parallel.virtual_stages", "2", "--model.num_layers", "6",
                               "--parallel.pp_layers", "1,2,2,1"],
    "pp2-dp2-zero2": [*PP, "--parallel.dp", "2", "--parallel.zero", "2", "--train.gbs", "8"],
    "pp2-dp2-zero3-bf16": [*PP, "--parallel.dp", "2", "--parallel.zero", "3",
                           "--train.precision", "bf16", "--train.gbs", "8"],
    "pp2-interleaved-dp2-zero3": [*PP, "--parallel.schedule", "interleaved",
                                  "--parallel.virtual_stages", "2", "--parallel.dp", "2",
                                  "--parallel.zero", "3", "--train.gbs", "8"],
    "pp2-zb-dp2-zero3": [*PP, "--parallel.schedule", "zb", "--parallel.dp", "2",
                         "--parallel.zero", "3", "--train.gbs", "8"],
    "pp2-dualpipev-dp2-zero3": [*PP, "--parallel.schedule", "dualpipev", "--parallel.dp", "2",
                                "--parallel.zero", "3", "--train.gbs", "8"],
})
# Context parallelism: both K/V schemes; full recomputation repeats the forward transfers.
CP = ["--parallel.cp", "2"]
LAYOUTS.update({
    "cp2-ring": CP,
    "cp2-allgather-selective": [*CP, "--parallel.cp_comm", "allgather", "--train.recompute",
                                "selective"],
    "cp4-ring-full-bf16": ["--parallel.cp", "4", "--train.recompute", "full",
                           "--train.precision", "bf16"],
    "cp4-allgather-contiguous": ["--parallel.cp", "4", "--parallel.cp_comm", "allgather",
                                 "--parallel.cp_layout", "contiguous"],
    "cp2-tp2-sp-dp1-zero1": [*CP, "--parallel.tp", "2", "--parallel.sp", "true",
                             "--parallel.zero", "1"],
    "pp2-cp2-zb": [*PP, *CP, "--parallel.schedule", "zb"],
})


# Mixtures of experts: a dense first layer, then MoE layers; experts replicate over tp; the
# expert-bias update adds its all-reduce of the global tokens per expert.
MOE_BASE = ["--model.num_experts", "4", "--model.experts_top_k", "2",
            "--model.moe_intermediate_size", "64"]
MOE = [*MOE_BASE, "--model.aux_loss_coeff", "0.01", "--model.z_loss_coeff", "0.001"]
LAYOUTS.update({
    "moe-single-dense-first": [*MOE, "--model.moe_first_dense", "1", "--model.num_layers", "3"],
    "moe-tp2-shared": [*MOE, "--parallel.tp", "2", "--model.shared_expert_intermediate_size",
                       "32", "--model.shared_expert_gate", "true"],
    "moe-dp2-zero3-bias": [*MOE_BASE, "--parallel.dp", "2", "--parallel.zero", "3",
                           "--model.expert_bias_rate", "0.001"],
    "moe-pp2-1f1b": [*PP, *MOE],
    "moe-single-full": [*MOE, "--train.recompute", "full"],
})
# Expert parallelism: what a rank receives follows the routing, which the planner takes as
# balanced, so its all-to-all bytes and activations are checked at the peak only, with the
# tolerance there (tests/test_moe_plan.py checks the balanced case's ledger).
EP_LAYOUTS = {
    "moe-dp2-ep2": [*MOE, "--parallel.dp", "2", "--parallel.ep", "2"],
    "moe-dp2-ep2-zero2": [*MOE_BASE, "--parallel.dp", "2", "--parallel.ep", "2",
                          "--parallel.zero", "2"],
}


PEAK_ITEMS = ("grad_buffer", "comm_buffers", "activations", "logits_loss")
# Relative tolerance per peak item, as tight as measured (docs/zero.md states the same).
PEAK_TOLERANCE = {"grad_buffer": 0.0, "logits_loss": 0.0, "comm_buffers": 0.0,
                  "activations": 0.0025}
# Where the planner's formula is known not to follow the engine: (layout, item) → (tolerance,
# why). Each was measured at the size given. (Interleaved chunks of uneven size, pp_layers
# 1,2,2,1, were one until the planner counted each chunk's micro-batches in flight along the
# engine's order: +33% on pp rank 1 before; now within 0.03%.)
PEAK_GAPS: dict[tuple[str, str], tuple[float, str]] = {
    ("single-selective", "activations"): (
        0.035, "measured -3.3%: the planner adds the attention core's working set on top of "
               "every kept layer; the engine's peak comes at the end of forward"),
    ("pp2-afab-selective", "activations"): (0.01, "measured -0.86%: the same, over 4 layers"),
    ("pp2-dualpipev-dp2-zero3", "comm_buffers"): (
        0.002, "measured -0.14% (512 bytes) on pp rank 0: not explained yet"),
}
# Expert parallelism: what a rank receives follows the routing, the planner's is balanced.
EP_TOLERANCE = {**PEAK_TOLERANCE, "activations": 0.05}  # measured -2.2% and +3.7%
# One micro-batch's saved activations, summed over the rank's chunks outside the schedule.
SAVED_TOLERANCE = 0.025  # measured within 1.93% (interleaved pp rank 0) on every other pair
SAVED_GAPS = {  # (layout, pp rank) → (tolerance, why)
    ("pp2-cp2-zb", 1): (0.10, "measured -9.4% = 32 KiB, one fp32 block of the rank's 32 "
                               "tokens × 256 logits that this sum plans and the engine does "
                               "not save; the peak items of the same run agree"),
}


def measure(rank, world, tmp, args):
    cfg = small_config(pathlib.Path(tmp), *MODEL, *args)
    dims = ParallelDims.from_config(cfg.parallel) if world > 1 else ParallelDims.single()
    trainer = Trainer(cfg, dims, quiet=True)
    if trainer.pipeline is not None:
        trainer.pipeline.count_activations = True  # also measures the kept output gradients
    dims.ledger.enabled = True
    with PeakTracker(trainer.peak_sources()) as tracker:
        trainer.train_step()
    ledger = {}
    for (group, op), t in dims.ledger.totals().items():
        ledger.setdefault(group, {})[op] = t["bytes"]
    x, y = trainer.shard_sequences(trainer.loader.next_batch())[0]  # this cp rank's tokens
    params = [p for _, p in trainer.model.named_parameters()]
    activations = 0
    for chunk in trainer.model.chunks:  # one micro-batch through each of this rank's chunks
        first, last = getattr(chunk, "first", True), getattr(chunk, "last", True)  # pp = 1
        if not first:  # a stage input is a leaf, as the pipeline executor makes it
            rows = x.shape[1] // (dims.tp if cfg.parallel.sp else 1)
            x = torch.randn(x.shape[0], rows, chunk.cfg.hidden_size, requires_grad=True,
                            dtype=next(chunk.parameters()).dtype)
        with SavedActivations(params) as meter:
            chunk(x, y if last else None)
        activations += meter.bytes
    if trainer.pipeline is not None:
        trainer.pipeline.close()
    kept = trainer.pipeline.peak_kept_bytes if trainer.pipeline is not None else 0
    return {"ledger": ledger, "memory": trainer.optimizer.memory_bytes(),
            "activations": activations, "precision": trainer.precision,
            "pp_rank": dims.pp_rank, "split_grads": kept,
            "peaks": {item: tracker.item_peaks.get(item, 0) for item in PEAK_ITEMS},
            "peak": tracker.peak, "at": tracker.at, "items_at_peak": tracker.items_at_peak}


def planned(tmp, args, precision, pp_rank):
    """Model states, saved activations of one micro-batch and the ledger of pipeline rank
    `pp_rank`, as the planner predicts them."""
    cfg = small_config(pathlib.Path(tmp), *MODEL, *args)
    par = cfg.parallel
    work, layout = training_plan_inputs(cfg)
    work = work.__class__(**{**work.__dict__, "precision": precision})
    states = model_state_bytes(work.model, tp=par.tp, pp=par.pp, dp=par.dp, cp=par.cp, ep=par.ep,
                               zero=par.zero, offload=par.offload, precision=precision,
                               pp_rank=pp_rank, schedule=layout.schedule,
                               virtual_stages=layout.virtual_stages, pp_split=layout.pp_split,
                               pp_layers=layout.pp_layers)
    acts = activation_bytes_per_microbatch(
        work.model, par.mbs, cfg.train.seq_len, tp=par.tp, sp=par.sp, cp=par.cp,
        cp_comm=par.cp_comm, recompute=cfg.train.recompute,
        dtype_bytes=4 if precision == "fp32" else 2, flash=True,
        sp_saves_gathered=par.sp_saved_input == "full")
    layers, embed, head = stage(work.model, layout, pp_rank)
    activations = acts.layer * layers + (acts.embedding if embed else 0)
    activations += acts.rope_tables if layers else 0
    if head:
        activations += acts.final_norm + acts.logits + acts.loss
    items, _ = memory_items(work, layout, Assumptions(), pp_rank)
    # The per-stage answer of `fivefold plan --json`, through JSON, for this pipeline rank.
    hw, assume = get_hardware("h100-sxm")
    report = json.loads(json.dumps(plan_layout(work, layout, hw, assume).to_dict(), default=float))
    stage_json = report["stages"][pp_rank]
    # The items of the peak the engine's tracker also counts (comm buffers: DP/ZeRO's part).
    peaks = {"grad_buffer": items["grad_buffer"],
             "comm_buffers": dp_comm_buffer_bytes(work, layout, pp_rank),
             "activations": items["activations"], "logits_loss": items["logits_loss"]}
    return (states, activations, ledger_volume(work, layout, pp_rank), items["split_grads"],
            stage_json, peaks)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_planner_agrees_with_engine(name, tmp_path, capsys):
    args = LAYOUTS[name]
    world = small_config(tmp_path, *MODEL, *args).parallel.world_size
    if world == 1:
        results = [measure(0, 1, str(tmp_path), args)]
    else:
        results = run_ranks(measure, world, str(tmp_path), args)
    for got in results:
        check_rank(got, tmp_path, name, args, capsys)
    for a in results:  # ranks of one pipeline stage hold and move the same amounts
        for b in results:
            if a["pp_rank"] == b["pp_rank"]:
                assert a["ledger"] == b["ledger"] and a["memory"] == b["memory"]


@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_planner_agrees_with_engine_at_the_peak_under_ep(name, tmp_path, capsys):
    args = EP_LAYOUTS[name]
    for got in run_ranks(measure, 2, str(tmp_path), args):
        check_peak_items(got, planned(tmp_path, args, got["precision"], got["pp_rank"])[5],
                         name, capsys, EP_TOLERANCE)


def check_peak_items(got, peaks, name, capsys, tolerance=PEAK_TOLERANCE):
    """Peak items, measured from storages where the peak can occur (parallel/peak.py): the
    gradients accumulating whole over micro-batches, DP/ZeRO's buckets and gathered units,
    the saved activations of every micro-batch in flight (with a recomputation's working
    set), and the final norm, head and loss (saved, and the loss's transient logits)."""
    with capsys.disabled():
        print(f"\n{name} (pp rank {got['pp_rank']}) peak items measured/planned: " + ", ".join(
            f"{item} {got['peaks'][item]}/{plan:.0f}" for item, plan in peaks.items() if plan))
    for item, plan in peaks.items():
        allowed = PEAK_GAPS.get((name, item), (tolerance[item], ""))[0]
        assert abs(got["peaks"][item] - plan) <= allowed * plan, (item, got["peaks"], peaks)


def check_rank(got, tmp_path, name, args, capsys):
    states, activations, ledger, split_grads, stage_json, peaks = planned(
        tmp_path, args, got["precision"], got["pp_rank"])
    # A split backward keeps output gradients from B to W: exactly what the planner counts.
    assert got["split_grads"] == split_grads, (got["split_grads"], split_grads)
    check_peak_items(got, peaks, name, capsys)
    plan_items = {k: getattr(states, k) for k in ("params", "grads", "master", "optimizer")}
    measured = dict(got["memory"])
    if "--parallel.offload" in args:  # the planner books offloaded states as host memory
        assert plan_items["master"] == plan_items["optimizer"] == 0 and states.cpu > 0
        plan_items = {"params": states.params, "grads": states.grads, "host": states.cpu}
        measured["host"] = measured.pop("master") + measured.pop("optimizer")
    for item, plan in plan_items.items():
        assert abs(measured[item] - plan) <= 0.01 * max(plan, 1), (item, measured, plan)
    # Per-stage memory in the JSON report: the engine's model states of this rank, within 1%.
    assert stage_json["pp_rank"] == got["pp_rank"]
    json_states = {k: stage_json["memory_bytes"][k] for k in ("params", "grads", "master",
                                                              "optimizer")}
    if "--parallel.offload" in args:
        json_states["host"] = stage_json["cpu_offload_bytes"]
        del json_states["master"], json_states["optimizer"]
    for item, plan in json_states.items():
        assert abs(measured[item] - plan) <= 0.01 * max(plan, 1), ("json", item, measured, plan)
    with capsys.disabled():
        print(f"\n{name} (pp rank {got['pp_rank']}): activations measured "
              f"{got['activations']} planned {activations:.0f} "
              f"({got['activations'] / activations:.3f})"
              + (f"; kept for W {got['split_grads']}" if split_grads else ""))
    allowed = SAVED_GAPS.get((name, got["pp_rank"]), (SAVED_TOLERANCE, ""))[0]
    assert abs(got["activations"] - activations) <= allowed * activations
    plan_ledger = {g: {op: b for op, b in ops.items() if b} for g, ops in ledger.items()}
    plan_ledger = {g: ops for g, ops in plan_ledger.items() if ops}
    assert got["ledger"] == plan_ledger
