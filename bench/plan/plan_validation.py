"""The planner against published measurements of other engines' runs.

    python bench/plan/plan_validation.py   # writes docs/planner-validation.md and
                                      # bench/results/plan_validation.json

Each row is a measurement a paper or a framework's docs published (cited), planned under the
convention of the engine that measured it (`plan/conventions.py`), with the planner's
prediction and its error. Predictions only: the same on every run.
"""

import dataclasses
import json
import platform
import statistics
import subprocess
from pathlib import Path

from fivefold.host import cpu_label
from fivefold.models.presets import ModelConfig, preset
from fivefold.plan.conventions import get_convention
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.hardware import GIB, get_hardware
from fivefold.plan.layout import Layout, Workload

ROOT = Path(__file__).resolve().parents[2]
TT = "torchtitan benchmarks/llama3_h100_202412_torchtitan.md @9dec370"
LLAMA3 = "Dubey et al. 2024 (arXiv:2407.21783) Table 4"
NARAYANAN = "Narayanan et al. 2021 (arXiv:2104.04473) Table 1"


def gpt(h: int, layers: int, heads: int) -> ModelConfig:
    """Narayanan's GPT models: V 51,200, s 2048, 4h GeLU MLP, LayerNorm, tied embeddings."""
    return ModelConfig(name=f"gpt-h{h}-l{layers}", vocab_size=51200, hidden_size=h,
                       intermediate_size=4 * h, num_layers=layers, num_heads=heads,
                       num_kv_heads=heads, max_seq_len=2048, tie_embeddings=True,
                       qkv_bias=True, mlp="gelu", norm="layernorm")


# (source, what, convention, gpu, workload kwargs, layout kwargs, measured, unit, note)
ROWS = [
    (LLAMA3, "Llama 3.1 405B, 8,192 H100", "megatron", "h100-sxm",
     {"model": preset("llama-3.1-405b"), "seq_len": 8192, "gbs": 64 * 32},
     {"dp": 64, "tp": 8, "pp": 16, "zero": 1, "recompute": "none", "sp": True,
      "schedule": "interleaved", "virtual_stages": 4}, 0.43, "MFU",
     "layout from the table; interleaved with v = 4 assumed (v is not published)"),
    (LLAMA3, "Llama 3.1 405B, 16,384 H100", "megatron", "h100-sxm",
     {"model": preset("llama-3.1-405b"), "seq_len": 8192, "gbs": 128 * 16},
     {"dp": 128, "tp": 8, "pp": 16, "zero": 1, "recompute": "none", "sp": True,
      "schedule": "interleaved", "virtual_stages": 4}, 0.41, "MFU", "as above"),
    (LLAMA3, "Llama 3.1 405B, 16,384 H100, 128k context", "megatron", "h100-sxm",
     {"model": preset("llama-3.1-405b"), "seq_len": 131072, "gbs": 8 * 16},
     {"dp": 8, "tp": 8, "pp": 16, "cp": 16, "zero": 1, "recompute": "none", "sp": True,
      "schedule": "interleaved", "virtual_stages": 4}, 0.38, "MFU", "as above"),
    (NARAYANAN, "GPT 1.7B, 32 A100 (t1 p1)", "megatron", "a100-80gb",
     {"model": gpt(2304, 24, 24), "seq_len": 2048, "gbs": 512, "causal_flops": False},
     {"dp": 32, "recompute": "full"}, 137, "TFLOP/s", "HFU: recompute counted (eq. 3)"),
    (NARAYANAN, "GPT 18.4B, 256 A100 (t8 p1)", "megatron", "a100-80gb",
     {"model": gpt(6144, 40, 48), "seq_len": 2048, "gbs": 1024, "causal_flops": False},
     {"dp": 32, "tp": 8, "recompute": "full", "sp": False}, 135, "TFLOP/s", "HFU, as above"),
    (NARAYANAN, "GPT 145.6B, 1,536 A100 (t8 p8)", "megatron", "a100-80gb",
     {"model": gpt(12288, 80, 96), "seq_len": 2048, "gbs": 2304, "causal_flops": False},
     {"dp": 24, "tp": 8, "pp": 8, "recompute": "full", "sp": False}, 148, "TFLOP/s",
     "HFU, as above"),
    (NARAYANAN, "GPT 1T, 3,072 A100 (t8 p64)", "megatron", "a100-80gb",
     {"model": gpt(25600, 128, 160), "seq_len": 2048, "gbs": 3072, "causal_flops": False},
     {"dp": 6, "tp": 8, "pp": 64, "recompute": "full", "sp": False}, 163, "TFLOP/s",
     "HFU, as above"),
    (TT + " Table 1", "Llama 3.1 8B FSDP, 8 H100", "torchtitan", "h100-sxm",
     {"model": preset("llama-3.1-8b"), "seq_len": 8192, "gbs": 16},
     {"dp": 8, "zero": 3, "mbs": 2, "recompute": "op"}, 5762, "tokens/s/GPU",
     "H100 HBM2e at 500 W: below the SXM peaks the planner assumes"),
    (TT + " Table 3", "Llama 3.1 8B FSDP, 128 H100", "torchtitan", "h100-sxm",
     {"model": preset("llama-3.1-8b"), "seq_len": 8192, "gbs": 256},
     {"dp": 128, "zero": 3, "mbs": 2, "recompute": "op"}, 5605, "tokens/s/GPU",
     "as above"),
    (TT + " Table 1", "Llama 3.1 8B FSDP, 8 H100", "torchtitan", "h100-sxm",
     {"model": preset("llama-3.1-8b"), "seq_len": 8192, "gbs": 16},
     {"dp": 8, "zero": 3, "mbs": 2, "recompute": "op"}, 82.4, "GiB reserved",
     "selective AC per operator (selective_ac_option = 'op'): planned as recompute=op"),
    (TT + " Table 3", "Llama 3.1 8B FSDP, 128 H100", "torchtitan", "h100-sxm",
     {"model": preset("llama-3.1-8b"), "seq_len": 8192, "gbs": 256},
     {"dp": 128, "zero": 3, "mbs": 2, "recompute": "op"}, 67.0, "GiB reserved",
     "as above"),
    (TT + " Table 2", "Llama 3.1 8B FSDP 8, seq 32k, 8 H100", "torchtitan", "h100-sxm",
     {"model": preset("llama-3.1-8b"), "seq_len": 32768, "gbs": 8},
     {"dp": 8, "zero": 3, "mbs": 1, "recompute": "full"}, 83.9, "GiB reserved",
     "full AC (layer inputs only); Float8 + compile, planned as bf16"),
    (TT + " Table 2", "Llama 3.1 8B FSDP 4 CP 2, seq 64k, 8 H100", "torchtitan", "h100-sxm",
     {"model": preset("llama-3.1-8b"), "seq_len": 65536, "gbs": 4},
     {"dp": 4, "cp": 2, "zero": 3, "mbs": 1, "recompute": "full"}, 84.2, "GiB reserved",
     "as above"),
    (TT + " Table 4", "Llama 3.1 70B FSDP 32 TP 8, 256 H100", "torchtitan", "h100-sxm",
     {"model": preset("llama-3.1-70b"), "seq_len": 8192, "gbs": 512},
     {"dp": 32, "tp": 8, "zero": 3, "mbs": 16, "recompute": "full", "sp": True}, 71.9,
     "GiB reserved", "as above"),
    # Local batch 32 (Table 5) split into torchtitan's default number of micro-batches, one per
    # stage (pipelining_utils.py build_pipeline_schedule: n_microbatches = pp · stages per
    # rank when pipeline_parallel_microbatches is unset): 8 of 4 sequences under 1F1B; 16 of 2
    # interleaved, whose default is 2 stages per rank, split by generate_split_points (first
    # and last stage one layer fewer).
    (TT + " Table 5", "Llama 3.1 405B FSDP 8 TP 8 PP 8 1F1B, 512 H100", "torchtitan",
     "h100-sxm", {"model": preset("llama-3.1-405b"), "seq_len": 8192, "gbs": 256},
     {"dp": 8, "tp": 8, "pp": 8, "zero": 3, "mbs": 4, "recompute": "full", "sp": True,
      "pp_layers": (15, 16, 16, 16, 16, 16, 16, 15)}, 82.5, "GiB reserved",
     "as above; local batch 32 in torchtitan's default 8 micro-batches of 4 (planned before "
     "as 32 of 1)"),
    (TT + " Table 5", "Llama 3.1 405B FSDP 8 TP 8 PP 8 interleaved, 512 H100", "torchtitan",
     "h100-sxm", {"model": preset("llama-3.1-405b"), "seq_len": 8192, "gbs": 256},
     {"dp": 8, "tp": 8, "pp": 8, "zero": 3, "mbs": 2, "recompute": "full", "sp": True,
      "schedule": "interleaved", "virtual_stages": 2, "pp_layers": (7,) + (8,) * 14 + (7,)},
     72.7, "GiB reserved", "as above; torchtitan's default 2 stages per rank and 16 "
     "micro-batches of 2 (planned before as 32 of 1)"),
]
# torchtitan's runs used torch 1963fc8 (2024-12-23; the benchmark's versions table): its
# torch.distributed.pipelining held more per micro-batch than today's (plan/torch_pipelining.py).
for _row in ROWS:
    if _row[2] == "torchtitan":
        _row[4]["pp_runtime"] = "torch-2412"


def predict(convention, gpu, work_kw, layout_kw, unit):
    conv = get_convention(convention)
    hw, assume = get_hardware(gpu, {"memory_gib": 200})  # predict, whatever fits
    work = conv.apply_workload(Workload(**{k: v for k, v in work_kw.items()
                                           if k != "causal_flops"}), set(work_kw))
    if "causal_flops" in work_kw:  # the source's own FLOPs convention
        work = dataclasses.replace(work, causal_flops=work_kw["causal_flops"])
    layout = conv.apply_layout(Layout(**layout_kw), set(layout_kw))
    plan = plan_layout(work, layout, hw, assume)
    return {"MFU": plan.mfu, "TFLOP/s": plan.hfu * plan.peak_flops / 1e12,
            "tokens/s/GPU": plan.tokens_per_s_per_gpu,
            "GiB reserved": plan.peak_reserved / GIB}[unit], layout.short()


def fmt(value, unit):
    return f"{value:.1%}" if unit == "MFU" else (f"{value:,.0f}" if value > 100 else
                                                 f"{value:.1f}")


# The table before loss parallel, torch.distributed.pipelining's buffers and the 405B rows'
# micro-batches (the run committed at git d1b6c80), shown beside the new one.
BEFORE = ROOT / "bench" / "results" / "plan_validation_ae772dc.json"
# The goal (issue 27): throughput within ±20% on ≥ 80% of rows, memory within ±10% on ≥ 70%.
GOAL = {"time": (0.20, 0.80), "memory": (0.10, 0.70)}


def _stats(errors: dict[str, list[float]]) -> dict:
    return {k: {"n": len(v), "mean_abs": statistics.mean(abs(e) for e in v),
                "median_abs": statistics.median(abs(e) for e in v),
                "max_abs": max(abs(e) for e in v), "mean": statistics.mean(v),
                "within_goal": sum(abs(e) <= GOAL[k][0] for e in v) / len(v)}
            for k, v in errors.items()}


def main():
    rows, errors, errors_before = [], {"time": [], "memory": []}, {"time": [], "memory": []}
    before = {(r["what"], r["unit"]): r for r in json.loads(BEFORE.read_text())["rows"]}
    for source, what, convention, gpu, work_kw, layout_kw, measured, unit, note in ROWS:
        pred, short = predict(convention, gpu, work_kw, layout_kw, unit)
        err = pred / measured - 1
        kind = "memory" if "GiB" in unit else "time"
        errors[kind].append(err)
        old = before.get((what, unit))
        if old:
            errors_before[kind].append(old["error"])
        rows.append({"source": source, "what": what, "convention": convention,
                     "layout": short, "unit": unit, "measured": measured,
                     "predicted": pred, "error": err, "note": note,
                     "before": old and {"layout": old["layout"], "predicted": old["predicted"],
                                        "error": old["error"]}})
        print(f"{what:<45} {unit:<13} measured {fmt(measured, unit):>8} predicted "
              f"{fmt(pred, unit):>8} ({err:+.1%})"
              + (f"; before {fmt(old['predicted'], unit)} ({old['error']:+.1%})" if old else ""))
    stats, stats_before = _stats(errors), _stats(errors_before)
    lines = [
        "# The planner against published measurements",
        "",
        "Generated by `python bench/plan/plan_validation.py` (predictions only; no GPU was used).",
        "Each row is a measurement a paper or a framework's documentation published, planned "
        "with `fivefold plan` under the convention of the engine that measured it "
        "(`--convention`, see `src/fivefold/plan/conventions.py`). Error = predicted / "
        "measured − 1. Throughput is compared in the source's own unit: MFU (Llama 3: 6N "
        "plus attention, full square), hardware TFLOP/s per GPU (Narayanan: recomputation "
        "counted), tokens/s per GPU (torchtitan); memory as the source logged it "
        "(torchtitan: max reserved, GiB).",
        "",
        "The columns *before* are the previous table (generated at git ae772dc, "
        "`bench/results/plan_validation_ae772dc.json`). *Now*: the time terms of issue 44 "
        "(`plan/network.py`: collective latency as NCCL's tuning model counts it, n − 1 "
        "ring steps of which the node-crossing ones at the network's latency, a tree "
        "all-reduce across nodes when faster; the pipeline's messages in its bubble; the "
        "spine and stragglers, whose defaults, a non-blocking fat tree and equal ranks, add "
        "nothing here). Every convention takes them; no factor was fitted to these rows. "
        "Re-scored after nanotron's blocked TP waits became host time that grows with the "
        "slowest of N ranks (`plan/network.py` `blocked_host_s`): the rows are unchanged, "
        "as no other engine's pipeline blocks the host on its messages "
        "(`pp_blocking_latency_us` = 0); and again after a TP call's ring steps between "
        "nodes took nanotron's fitted time (`tp_inter_step_us`): unchanged, as the other "
        "conventions keep NCCL's latency (`tp_inter_step_us` = 0), and no row here has a "
        "TP group across nodes.",
        "",
        "| source | run | convention | layout planned | unit | measured | before | error "
        "before | now | error now | note |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        old = r["before"] or {"predicted": float("nan"), "error": float("nan")}
        lines.append(f"| {r['source']} | {r['what']} | {r['convention']} | `{r['layout']}` | "
                     f"{r['unit']} | {fmt(r['measured'], r['unit'])} | "
                     f"{fmt(old['predicted'], r['unit'])} | {old['error']:+.1%} | "
                     f"{fmt(r['predicted'], r['unit'])} | {r['error']:+.1%} | {r['note']} |")
    lines += ["", "Error statistics (absolute relative error; goal: throughput within ±20% on "
              "≥ 80% of rows, memory within ±10% on ≥ 70%):", "",
              "| quantity | table | rows | mean | median | max | mean signed | within goal |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    for label, table in (("before", stats_before), ("now", stats)):
        for k, s in table.items():
            lines.append(f"| {k} | {label} | {s['n']} | {s['mean_abs']:.1%} | "
                         f"{s['median_abs']:.1%} | {s['max_abs']:.1%} | {s['mean']:+.1%} | "
                         f"{s['within_goal']:.0%} (±{GOAL[k][0]:.0%}) |")
    lines += ["", *NOTES]
    import usp_calibration  # beside this file: the nanotron runs' section, from its JSON
    import usp_doc

    if usp_calibration.OUT.exists():
        lines += ["", *usp_doc.section()]
    doc = ROOT / "docs" / "planner-validation.md"
    # What the page holds after the USP section (the memory section, written by hand from
    # usp_memory.py's results) stays.
    old = doc.read_text() if doc.exists() else ""
    tail = old.split(usp_doc.MARK[1], 1)[1] if usp_doc.MARK[1] in old else ""
    doc.write_text("\n".join(lines) + (tail if tail.strip() else "\n"))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True, cwd=ROOT).stdout.strip()
    out = {"machine": platform.node(), "cpu": cpu_label(),
           "python": platform.python_version(), "git": rev,
           "rows": rows, "stats": stats, "stats_before": stats_before}
    (ROOT / "bench" / "results" / "plan_validation.json").write_text(
        json.dumps(out, indent=2, default=float) + "\n")
    print(json.dumps(stats, indent=2))


NOTES = [
    "What the rows can and cannot say:",
    "",
    "- Layouts are the published ones; what a source leaves out is the convention's default "
    "(stated per row). Llama 3's number of interleaved chunks is not published (v = 4 is "
    "assumed) and its uneven first/last stages are not reproduced (even split).",
    "- Narayanan et al. measured with full recomputation and report hardware TFLOP/s "
    "(F = 96·B·s·L·h²(1 + s/6h + V/16Lh)); the prediction is HFU × 312 TFLOP/s with the "
    "attention square counted whole, as they did.",
    "- torchtitan's H100s were HBM2e parts at 500 W (their footnote: the peak lies between "
    "SXM and NVL, exact value unknown): the planner's h100-sxm peaks overstate them, so its "
    "throughput reads high; the default efficiencies are left as they were, since no "
    "published peak for those parts exists to calibrate against.",
    "- The scale terms move the rows that span nodes: torchtitan's 8B on 128 H100s from "
    "+17.2% to -1.4% (FSDP's all-gathers over 16 nodes: ring steps at the network's "
    "latency), Llama 3's 16,384-GPU rows lower (-19.3% and -19.0%: dp 128 and 8 rings "
    "of one GPU per node, every step over the network), still within 20%. The 8B run "
    "on one node (+50.8%) is untouched: it spans no node, no spine and 8 ranks; its "
    "planned 52.9% MFU against 33.7% measured (the issue's command, `--layout dp=8,"
    "zero=3,mbs=1,recompute=selective --seq-len 8192 --gbs 8`, still plans 9,043 tokens/s "
    "per GPU) is the parts' lower peak above and whatever else a single row cannot "
    "separate; fitting a factor to one row would only hide it, so the row stays a miss "
    "(throughput within 20% on 8 of 9 rows, 89%, goal 80%).",
    "- torchtitan's selective activation checkpointing (`selective_ac_option = 'op'`, "
    "parallelisms/parallelize_llama.py @9dec370) keeps the SDPA outputs and every "
    "odd-numbered matmul's output of a block: in a Llama block q, v, w1 and w2 "
    "(`plan/activations.py: op_sac_kept`), planned as `recompute=op`. Its loss is "
    "`F.cross_entropy(pred.flatten(0, 1).float(), labels)` on materialised logits (train.py "
    "@9dec370; compiling it was disabled there), planned with log-softmax's fp32 output "
    "kept and two fp32 T×V gradients in backward (`chunked_loss = False`); that transient is "
    "the peak itself, not a cached block beside a later one (`allocator.allocator_waste`).",
    "- Loss parallel (torchtitan with tp > 1, Tables 4 and 5): the loss's backward is "
    "DTensor's `_nll_loss_and_log_softmax_backward` (torch/distributed/tensor/parallel/"
    "loss.py), `(zeros_like(x) + exp(x)) * grad_output`: three fp32 T×V/tp buffers beside "
    "the saved log-softmax output, one more than plain `F.cross_entropy`'s two. At the 70B "
    "row's 131,072 tokens per rank that is 7.8 GiB, the row's gap before (-15.3%, now -4.4%).",
    "- The 405B rows were planned before with 32 micro-batches of 1 sequence. torchtitan "
    "(@9dec370, `build_pipeline_schedule`) splits the local batch (32, Table 5) into one "
    "micro-batch per stage unless told otherwise: 8 of 4 sequences under 1F1B, 16 of 2 "
    "under Interleaved1F1B, whose default is 2 stages per rank (`generate_split_points`: "
    "126 layers as 7, 8 × 14, 7). That alone moves the rows from -30.1% and -18.1% to "
    "-9.2% and -8.0% (the older model otherwise unchanged).",
    "- torch.distributed.pipelining as of the runs' torch (1963fc8, 2024-12-23; "
    "`plan/torch_pipelining.py`, `pp_runtime = torch-2412`): every stage keeps one "
    "activation and one gradient receive buffer per micro-batch, every stage output and "
    "every input gradient until the step ends (freed earlier since pytorch/pytorch#153383 "
    "and #164329), and the last stage every micro-batch's logits. FSDP2 under it "
    "accumulates the stage's unsharded gradients in fp32 until the last micro-batch "
    "(counted before as `grad_buffer`); since the stage's parameters stay gathered, what "
    "passes per unit is its bf16 gradient, not the two gathered blocks and two staged fp32 "
    "blocks of fivefold's own ZeRO-3 that were counted before (3.7 GiB less per 405B rank). "
    "On the 1F1B row's peak rank (pp rank 1, 7 micro-batches alive) the buffers add 2.25 "
    "GiB less the engine's two receive buffers: -11.9% in all; on the interleaved row the "
    "peak moves to the last rank, which keeps the logits of all 16 micro-batches (7.8 GiB): "
    "-2.3%.",
    "- Not met for one row: the 405B 1F1B row still reads 12% low (memory within ±10% on 6 "
    "of 7 rows, goal ≥ 70%: met). Its interleaved twin, the same model, parallelism and "
    "torch, is within 2.3%, so what is missing grows with the 1F1B run's larger micro-batch "
    "(4 sequences against 2) or its schedule: candidates not modelled are Float8 and "
    "torch.compile's buffers in the recomputed layer, AsyncTP's workspaces, and the caching "
    "allocator's blocks around FSDP's fp32 accumulators, which are allocated during the "
    "first backward while activations are freed. With no GPU to measure a run, the row "
    "stays a miss.",
    "- With full activation checkpointing only layer inputs are saved, so Float8 and "
    "torch.compile (Tables 2, 4, 5) change memory little; they are planned as bf16. Under "
    "PP, torchtitan's FSDP keeps each stage's parameters gathered from forward to backward "
    "(`reshard_after_forward = not pp_enabled`, llama3/infra/parallelize.py); the torchtitan "
    "convention models that (`zero3_keep_gathered_pp`). The convention itself plans today's "
    "torch (`pp_runtime = torch`: receive buffers per micro-batch, outputs kept until their "
    "backward, the last stage's logits until the step ends); the rows use the older torch "
    "their runs had.",
    "- Measured memory is max reserved (torchtitan logs `reserved_bytes.all.peak`); the "
    "prediction is the planner's reserved estimate (allocated plus its caching-allocator "
    "model, `plan/allocator.py: allocator_waste`), without the CUDA context.",
]


if __name__ == "__main__":
    main()
