"""Other engines' defaults, so a user of any of them can plan with fivefold
(`fivefold plan --convention NAME`). Individual flags still override each setting.

Each convention sets: the model-state layout (bytes per parameter, where fp32 gradient
accumulation lives, fp32 parameters), what sequence parallelism saves for backward, the
pipeline stage split, the rank order of the grid, how FLOPs count causal attention, and which
number the engine's logs call memory (peak allocated or peak reserved). Each convention's
`sources` name the project, the file and the commit it was read at.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from fivefold.errors import ConfigError
from fivefold.plan.hardware import Assumptions
from fivefold.plan.layout import SCHEDULES, Layout, Workload


@dataclass(frozen=True)
class Convention:
    name: str
    workload: dict = field(default_factory=dict)  # Workload fields
    layout: dict = field(default_factory=dict)  # Layout fields, unless --layout gives them
    logged_memory: str = "allocated"  # what the engine's logs report: allocated | reserved
    sources: tuple[str, ...] = ()
    schedules: tuple[str, ...] = SCHEDULES  # the pipeline schedules the engine offers
    # Assumptions fields (plan/hardware.py) fitted to the engine's measured runs; --hw wins.
    assumptions: dict = field(default_factory=dict)

    def apply_workload(self, work: Workload, explicit: set[str] = frozenset()) -> Workload:
        """The workload under this convention; fields in `explicit` (flags given) stay."""
        changes = {k: v for k, v in self.workload.items() if k not in explicit}
        return dataclasses.replace(work, **changes)

    def apply_assumptions(self, assume: Assumptions,
                          explicit: set[str] = frozenset()) -> Assumptions:
        changes = {k: v for k, v in self.assumptions.items() if k not in explicit}
        return dataclasses.replace(assume, **changes)

    def apply_layout(self, layout: Layout, explicit: set[str] = frozenset()) -> Layout:
        changes = {k: v for k, v in self.layout.items() if k not in explicit}
        return layout.replace(**changes)


CONVENTIONS: dict[str, Convention] = {
    # The engine itself: 2 + 2 + 4 + 8 = 16 B/param (bf16 grads, fp32 master and Adam;
    # parallel/zero.py), SP keeps the gathered input unless parallel.sp_saved_input = shard,
    # even split, mesh (pp, dp, cp, tp) with tp fastest (parallel/mesh.py), full-square
    # attention FLOPs, logs torch.cuda.max_memory_allocated.
    "fivefold": Convention(
        "fivefold", {}, {"sp_saved": "full", "pp_split": "even", "rank_order": "tp-cp-dp-pp"},
        "allocated", ("fivefold: parallel/zero.py, parallel/mesh.py, plan/split.py",)),
    "megatron": Convention(
        "megatron",
        # fp32 main gradients: 2 + 4 + 4 + 8 = 18 B/param; the distributed optimizer shards
        # only master + Adam: 6 + 12/DP (ZeRO-1 here). Causal attention FLOPs halved since
        # 8873b55d6a (2025-03-06).
        {"grad_dtype_bytes": 4, "fp32_grad_accum": False, "fp32_params": False,
         "causal_flops": True, "recompute_early_stop": False},
        # SP keeps the sequence shard and all-gathers it again in backward; uniform split
        # (first/last stage counts only by flag); order "tp-cp-ep-dp-pp".
        {"sp_saved": "shard", "pp_split": "even", "rank_order": "tp-cp-dp-pp"},
        "allocated",
        ("NVIDIA/Megatron-LM @d98e8a64 (2026-08-22): megatron/training/"
         "theoretical_memory_usage.py (18 B/param; 6 + 12/DP with --use-distributed-optimizer)",
         "megatron/core/tensor_parallel/layers.py LinearWithGradAccumulationAndAsync"
         "Communication (sequence_parallel: save the shard, all-gather in backward)",
         "megatron/core/parallel_state.py order='tp-cp-ep-dp-pp'",
         "megatron/training/training.py num_floating_point_operations (causal /2 since "
         "8873b55d6a); megatron/training/utils.py report_memory (max allocated)",
         "megatron/core/pipeline_parallel/schedules.py: 1F1B and interleaved 1F1B"),
        ("1f1b", "interleaved")),
    "nanotron": Convention(
        "nanotron",
        # bf16 params and grads, fp32 master and Adam, and an fp32 gradient-accumulation
        # buffer: 2 + 2 + 4 + 8 + 4 = 20 B/param.
        # The loss materialises the logits (bf16, then cast to fp32) and saves their softmax.
        # ZeRO-1 all-reduces the whole fp32 gradient buffer after backward (not a
        # reduce-scatter: trainer.py DistributedTrainer.training_step calls
        # sync_gradients_across_dp(..., reduce_scatter=False) once train_batch_iter has
        # returned, on the model _init_model leaves without DDP when accumulate_grad_in_fp32
        # and zero_stage > 0; optim/gradient_accumulator.py FP32GradientAccumulator
        # .sync_gradients_across_dp then runs dist.all_reduce(_contiguous_fp32_grad_buffer),
        # not async), and all-gathers the updated bf16 parameters after the step
        # (optim/zero.py ZeroDistributedOptimizer._all_gather_params on the model's own
        # params), both blocking (ZeRO-0 runs DDP's overlapped buckets). The same code in
        # nanotron 0.4 (PyPI, March 2024: trainer.py lines 344-349 and 608-609,
        # gradient_accumulator.py line 155, zero.py line 234) and at @004a89c.
        {"grad_dtype_bytes": 2, "fp32_grad_accum": True, "fp32_params": False,
         "causal_flops": False, "chunked_loss": False, "softmax_loss": True,
         "zero_sync_blocking": True, "zero1_grad_sync": "all_reduce",
         "pp_1f1b_min_warmup": True, "pp_idle_rank_fails": True,
         "recompute_early_stop": False},
        # REDUCE_SCATTER tp mode keeps the shard and gathers in backward; blocks split by
        # cumulative compute cost (4h·q + 3h·ffn per layer, V·h for the head), greedily
        # against thresholds total·(k+1)/pp; ranks reshaped (pp, dp, tp) with tp fastest.
        {"sp_saved": "shard", "pp_split": "cumulative", "rank_order": "tp-cp-dp-pp"},
        "reserved",
        ("huggingface/nanotron @2411b022: scripts/scaling_benchmarks.py "
         "(ACCUMULATE_GRAD_IN_FP32 = True), src/nanotron/models/llama.py "
         "(get_block_compute_costs, get_flops: full attention square)",
         "src/nanotron/parallel/tensor_parallel/functional.py (column linear, "
         "REDUCE_SCATTER mode), src/nanotron/parallel/context.py (rank grid)",
         "Ultra-Scale Playbook (HF Space nanotron/ultrascale-playbook; its GitHub mirror "
         "vinjn/nanotron-ultrascale-playbook @924e4d0) index.md: '+4 if fp32 grad "
         "accumulation (nanotron "
         "does this)'; logs peak_allocated and peak_reserved; its benchmark rows "
         "report torch.cuda.max_memory_reserved",
         "src/nanotron/parallel/pipeline_parallel/engine.py: AllForwardAllBackward and "
         "OneForwardOneBackward engines",
         "src/nanotron/models/base.py build_model (cumulative-cost stage cut); "
         "parallel/tensor_parallel/functional.py _ShardedCrossEntropy (softmax saved); "
         "trainer.py training_step: sync_gradients_across_dp(reduce_scatter=False) after "
         "train_batch_iter; optim/gradient_accumulator.py FP32GradientAccumulator."
         "sync_gradients_across_dp (all_reduce of the fp32 gradient buffer; nanotron 0.4 "
         "and @004a89c), optim/zero.py ZeroDistributedOptimizer (bf16 all-gather after "
         "the step)",
         "parallel/pipeline_parallel/engine.py OneForwardOneBackwardPipelineEngine "
         "(asserts nb_microbatches >= pp - 1); models/base.py build_model (the cut moves "
         "on one rank per block: ranks after the loss get none; such runs crashed)",
         "fitted on the Ultra-Scale Playbook's 1,130 nanotron runs (bench/data/"
         "usp-calibration.csv, bench/plan/usp_calibration.py; max_memory_reserved of rank 0)"),
        ("afab", "1f1b"),
        # Fitted on bench/data/usp-calibration.csv alone (bench/plan/usp_calibration.py `fit`,
        # rounded; docs/planner-validation.md gives them fitted on 16 GPUs and judged on 128,
        # and the other way): reserved per byte of saved activations and of loss buffers
        # beyond the allocator model, bytes per token per hidden unit on the head's rank
        # (least absolute deviations), the host time per layer per micro-batch, the fixed
        # time per pipeline message, the share of a node's NICs a group across nodes uses
        # beyond one per GPU, and the GiB the most loaded rank must leave free to fit.
        # The time factors (bench/plan/usp_fit.py, by coordinate descent on the capped mean log
        # error): host ms per layer and micro-batch, ms per pipeline message, the NICs'
        # share, the spread of the host's wait per ring step of a TP call while nanotron's
        # pipeline blocks the host on its messages (times √(2 ln N) for the slowest of N
        # ranks), the spread of a rank's time (stragglers), and the time a TP call's ring
        # step between nodes takes beyond the network's hop (400 µs on the 16-GPU half
        # alone, 300 on the 128-GPU half; since TP calls run in the GPU's idle time under
        # a host-bound micro-batch, plan/timing.py `host_slack`: 150 on either before).
        # `ddp_pp_message_ms` stays 0: the wait per pipeline message under DDP (ZeRO-0,
        # dp > 1; trainer.py `_init_model`, pipeline_parallel/state.py `run_communication`)
        # fits 0 on the 16-GPU runs and 250 ms on the 128-GPU ones, so it does not carry
        # (docs/planner-validation.md; bench/results/usp_calibration_ddp_trial.json).
        {"activation_reserve": 0.25, "loss_reserve": 0.0, "head_token_bytes": 82.0,
         "host_layer_ms": 4.5, "pp_message_ms": 0.0, "inter_node_rails": 0.5,
         "pp_blocking_latency_us": 60.0, "straggler_sigma": 0.04,
         "tp_inter_step_us": 300.0, "memory_headroom_gib": 4.5}),
    "torchtitan": Convention(
        "torchtitan",
        # FSDP2 mixed precision: sharded fp32 parameters (the master copy), bf16 compute
        # copies gathered per unit, fp32 gradient reduction: 4 + 4 + 8 = 16 B/param, sharded.
        # Loss parallel with tp > 1 (on unless disable_loss_parallel); pipelines run by
        # torch.distributed.pipelining (plan/torch_pipelining.py).
        {"grad_dtype_bytes": 4, "fp32_grad_accum": False, "fp32_params": True,
         "causal_flops": False, "zero3_keep_gathered_pp": True, "chunked_loss": False,
         "loss_parallel": True, "pp_runtime": "torch"},
        # DTensor ColwiseParallel redistributes the sequence shard to Replicate before the
        # linear, which saves the gathered input; even split; mesh
        # ["pp", "dp_replicate", "dp_shard", "cp", "tp"]; FSDP (ZeRO-3) by default.
        {"sp_saved": "full", "pp_split": "even", "rank_order": "tp-cp-dp-pp", "zero": 3},
        "reserved",
        ("pytorch/torchtitan @b5bcd76c6: torchtitan/config/job_config.py (config_manager.py "
         "in older versions) "
         "(mixed_precision_param = 'bfloat16', mixed_precision_reduce = 'float32', "
         "data_parallel_shard_degree = -1), torchtitan/distributed/parallel_dims.py (mesh)",
         "torchtitan/models/llama3/infra/parallelize.py apply_fsdp: reshard_after_forward = "
         "not pp_enabled by default (parameters stay gathered under PP)",
         "torch.distributed.pipelining schedules: GPipe, 1F1B, Interleaved1F1B, DualPipeV "
         "(its zero-bubble schedules are interleaved, not fivefold's one-chunk ZB-H1)",
         "torchtitan train.py @9dec370: loss_fn = F.cross_entropy(pred.flatten(0, 1).float(), "
         "...) on the model's materialised logits, `del pred` before backward",
         "torchtitan parallelisms/parallelize_llama.py @9dec370: selective_ac_option = 'op' "
         "saves the SDPA outputs and every odd-numbered mm (plan: recompute=op)",
         "torchtitan @9dec370 parallelisms/parallel_dims.py: loss_parallel_enabled = tp > 1 "
         "and enable_loss_parallel (= not training.disable_loss_parallel); "
         "torch/distributed/tensor/parallel/loss.py (its backward)",
         "torch/distributed/pipelining/stage.py, _backward.py (per-micro-batch receive "
         "buffers, FSDP sync deferred to the last micro-batch; plan/torch_pipelining.py)",
         "benchmarks @9dec370: MFU = 6·N + 12·L·h·s per token (full square); memory logged "
         "as torch.cuda.memory_stats()['reserved_bytes.all.peak'] (max reserved, GiB)"),
        ("afab", "1f1b", "interleaved", "dualpipev")),
    "deepspeed": Convention(
        "deepspeed",
        # ZeRO-2 since PR #5099: '18 = 2 grads16 + 4 grads32 + 4 params32 + 8 optimizer',
        # GPU = 2Ψ + 18Ψ/N: bf16 params and grads, an fp32 gradient buffer, fp32 master, Adam.
        {"grad_dtype_bytes": 2, "fp32_grad_accum": True, "fp32_params": False,
         "causal_flops": False, "recompute_early_stop": False},
        # PipeModelDataParallelTopology axes ['pipe', 'data', 'model']: model (tp) fastest.
        {"pp_split": "even", "rank_order": "tp-cp-dp-pp"},
        "allocated",
        ("microsoft/DeepSpeed @38327e07f: deepspeed/runtime/zero/stage_1_and_2.py "
         "estimate_zero2_model_states_mem_needs (f4cb866c2, PR #5099: 2Ψ + 18Ψ/N)",
         "deepspeed/runtime/pipe/topology.py PipeModelDataParallelTopology",
         "deepspeed/runtime/utils.py see_memory_usage (memory allocated and cached, GB)",
         "deepspeed/runtime/pipe/schedule.py TrainSchedule (1F1B)"),
        ("1f1b",)),
}


def get_convention(name: str) -> Convention:
    try:
        return CONVENTIONS[name.lower()]
    except KeyError:
        raise ConfigError(f"--convention {name!r} is unknown; use one of "
                          f"{', '.join(CONVENTIONS)}") from None
