"""What is planned: the workload (model + training shape) and one layout of the GPUs, and the
constraints a layout must meet (`check_layout`). Where a pipeline rank's layers sit, what it
keeps alive and each schedule's bubble are plan/placement.py's.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fivefold.models.presets import ModelConfig
from fivefold.plan.placement import (  # noqa: F401 (re-exported: comm.py's, timing.py's)
    bubble_ratio,
    critical_ranks,
    moe_layers_on_rank,
    num_chunks,
    rank_chunks,
    stage,
)
from fivefold.plan.split import check_split, cumulative_idle_ranks, split_costs

SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "dualpipev")
# "op": torchtitan's per-operator selective checkpointing, planned for its runs
# (plan/activations.py: op_sac_kept); the engine runs the others.
RECOMPUTE = ("none", "selective", "full", "auto", "op")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
PP_RUNTIMES = ("engine", "torch", "torch-2412")  # Workload.pp_runtime
ZERO1_GRAD_SYNCS = ("reduce_scatter", "all_reduce")  # Workload.zero1_grad_sync
# Optimizer state bytes per parameter, nominal (fp32 moments): Adam m+v 8, SGD momentum 4,
# 8-bit Adam 2 + 8/256 of block scales, 4-bit 1 + 8/128; Adafactor (rows + columns) and Muon
# (4 on hidden matrices, 8 elsewhere) depend on the shapes: plan/optimizer.py counts each
# tensor (small ones keep fp32 states too), and `model_states.work_bytes_per_param` uses that.
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "adamw8bit": 2 + 8 / 256,
                   "adamw4bit": 1 + 8 / 128, "adafactor": 0.0, "muon": 4.0}
# What the search tries when nothing fits with AdamW's states, in order of fidelity to AdamW.
LIGHTER_OPTIMIZERS = ("adamw8bit", "adamw4bit", "adafactor")
# Layout.offload → parallel.offload: where offloaded states live (plan/nvme.py)
TIERS = {False: "none", True: "cpu", "nvme": "nvme"}


def tier(offload) -> str:
    """A layout's `offload` as the tier name parallel.offload takes."""
    return TIERS.get(offload, "cpu" if offload else "none")


def layout_offload(tier_name: str):
    """parallel.offload's tier as a Layout's `offload` value."""
    return {"none": False, "cpu": True, "nvme": "nvme"}[tier_name]


@dataclass(frozen=True)
class Layout:
    """One way to place the training on dp·tp·pp·cp GPUs (ep is carved out of dp·cp)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 0
    mbs: int = 1
    recompute: str = "none"
    schedule: str = "1f1b"
    virtual_stages: int = 1
    sp: bool = False
    offload: bool | str = False  # True: CPU offload; "nvme": NVMe offload (plan/nvme.py)
    # Under SP, what column-parallel linears keep for backward: "full" (the gathered input)
    # or "shard" (the sequence shard, gathered again in backward; parallel.sp_saved_input).
    sp_saved: str = "full"
    # Context parallelism's K/V exchange: "ring" (cp − 1 point-to-point steps, overlapped with
    # the block attention) or "allgather" (one all-gather per layer; parallel.cp_comm).
    cp_comm: str = "ring"
    pp_split: str = "even"  # even | balanced | cumulative (plan/split.py)
    pp_layers: tuple[int, ...] = ()  # explicit layers per pipeline chunk; overrides pp_split
    # How ranks fill the grid, fastest-varying first: the engine's mesh is (pp, dp, cp, tp)
    # with tp fastest (parallel/mesh.py), as Megatron-LM's default order "tp-cp-ep-dp-pp".
    rank_order: str = "tp-cp-dp-pp"

    def stride(self, dim: str) -> int:
        """Rank distance between neighbours along `dim` (tp, cp, dp or pp)."""
        stride = 1
        for d in self.rank_order.split("-"):
            if d == dim:
                return stride
            stride *= getattr(self, d)
        raise ValueError(f"rank_order {self.rank_order!r} has no {dim}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def short(self) -> str:
        sched = ""
        if self.pp > 1:
            chunks = f"×{self.virtual_stages}" if self.virtual_stages > 1 else ""
            sched = f"({self.schedule}{chunks})"
        if self.pp > 1 and (self.pp_layers or self.pp_split != "even"):
            sched += ("[" + "-".join(map(str, self.pp_layers)) + "]" if self.pp_layers
                      else f"[{self.pp_split}]")
        parts = [f"dp{self.dp}", f"tp{self.tp}{self._sp_label()}", f"pp{self.pp}{sched}"]
        if self.cp > 1:
            parts.append(f"cp{self.cp}" + ("(ag)" if self.cp_comm == "allgather" else ""))
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        parts += [f"z{self.zero}{self._offload_label()}", f"mbs{self.mbs}",
                  {"none": "rc-none", "selective": "rc-sel", "full": "rc-full",
                   "auto": "rc-auto", "op": "rc-op"}[self.recompute]]
        return " ".join(parts)

    def _offload_label(self) -> str:
        return "+nvme" if self.offload == "nvme" else "+off" if self.offload else ""

    def _sp_label(self) -> str:
        if not self.sp:
            return ""
        return "+sp(shard)" if self.sp_saved == "shard" else "+sp"

    def replace(self, **changes) -> Layout:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Workload:
    """The model and the training shape, independent of the layout."""

    model: ModelConfig
    seq_len: int
    gbs: int  # global batch in sequences
    precision: str = "bf16"  # fp32 | bf16 | fp16
    optimizer: str = "adamw"
    # [optim] keys the plan depends on (config/optim.py): what Muon leaves to AdamW, and
    # whether Adafactor factors a matrix's second moment
    muon_exclude: str = "embed_tokens,lm_head,norm,router"
    adafactor_factored: bool = True
    grad_dtype_bytes: int | None = None  # None: the param dtype; 4 gives Megatron's 18 B/param
    fp32_grad_accum: bool = False  # a separate fp32 accumulation buffer (nanotron: 20 B/param)
    fp32_params: bool = False  # parameters stored in fp32, cast for compute (FSDP2 mixed
    #                            precision, torchtitan): no separate master copy
    zero3_keep_gathered_pp: bool = False  # ZeRO-3 + PP: parameters stay gathered all step
    flash: bool = True  # flash attention (O(s) saved) or math attention (O(s²) saved)
    dropout: bool = False  # dropout masks (GPT-3/Korthikanti); Llama trains without dropout
    causal_flops: bool = False  # halve attention FLOPs (Megatron ≥ 2025) or not (PaLM, Narayanan)
    grad_sync: str = "step"  # ZeRO-2/3 gradient reduce-scatter once per "step" or "microbatch"
    bucket_mb: float = 25.0
    buckets_in_flight: int = 2  # ZeRO-2/3 gradient buckets alive at once (parallel/data.py)
    memory_budget_gib: float = 0.0  # recompute = auto: peak allocated bytes per GPU to fit
    # The head and loss in chunks, nothing T×V kept (models/loss.py), or materialised logits
    # cast to fp32 for the loss (torchtitan and most engines; plan/activations.py).
    chunked_loss: bool = True
    # > 0: the GPU's bytes the engine's fused loss sizes its chunks by (models/loss_chunks.py);
    # 0: a CPU's fixed chunk.
    loss_device_memory: float = 0.0
    lora_rank: int = 0  # > 0: a frozen base with LoRA adapters of this rank (plan/lora.py)
    lora_base: str = "none"  # the frozen base's storage: none (compute dtype) | nf4 | int8
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    fp8_recipe: str = "blockwise"  # precision = fp8: how the saved inputs scale (plan/fp8.py)
    fp8_allgather: bool = False  # ZeRO-3 gathers FP8 linears' weights at 1 byte (plan/fp8.py)
    fp8_scaling: str = "dynamic"  # delayed: an all_reduce(max) of amaxes a step (plan/fp8.py)
    fp8_keep_out: str = ""  # train.fp8_keep_out: linears left in bf16 (plan/fp8_linears.py)
    # A materialised loss on vocabulary-parallel logits (DTensor loss parallel, torchtitan
    # with tp > 1): its backward holds more fp32 T×V/tp buffers (plan/activations.py).
    loss_parallel: bool = False
    # chunked_loss = False as nanotron's sharded cross-entropy: the fp32 softmax saved, its
    # gradient made in place (plan/activations.py).
    softmax_loss: bool = False
    # ZeRO-1/2's gradient reduce-scatter after backward and parameter all-gather after the
    # step run blocking, hidden behind nothing (nanotron's ZeroDistributedOptimizer).
    zero_sync_blocking: bool = False
    # How ZeRO-1 syncs the gradients: "reduce_scatter" (each rank gets the shard it
    # updates) or "all_reduce" of the whole gradient, twice a reduce-scatter's bytes and
    # ring steps (nanotron: DistributedTrainer.training_step, reduce_scatter=False).
    zero1_grad_sync: str = "reduce_scatter"
    # What runs the pipeline: "engine" (fivefold's), or torch.distributed.pipelining as in the
    # installed torch ("torch") or at torch 1963fc8, Dec 2024 ("torch-2412"); the latter two
    # hold per-micro-batch stage buffers and defer FSDP's gradient sync (plan/torch_pipelining.py).
    pp_runtime: str = "engine"
    # The engine's 1F1B refuses fewer than pp − 1 micro-batches (nanotron's
    # OneForwardOneBackwardPipelineEngine asserts nb_microbatches >= pp − 1).
    pp_1f1b_min_warmup: bool = False
    # A pipeline rank the stage cut leaves without any block fails (nanotron's cumulative cut
    # can: plan/split.py cumulative_idle_ranks); such layouts are refused.
    pp_idle_rank_fails: bool = False
    # A checkpointed block's re-run stops once backward's saved tensors are back (torch's
    # non-reentrant checkpoint: fivefold, torchtitan), so a dense block's bf16 down
    # projection's GEMM is not run again (plan/recompute_plan.py `rerun_down`); a reentrant
    # checkpoint (Megatron's CheckpointFunction, DeepSpeed's, nanotron's) re-runs all of it.
    recompute_early_stop: bool = True

    @property
    def dtype_bytes(self) -> int:
        """Bytes of an activation / a model parameter in the forward pass."""
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens_per_step(self) -> int:
        return self.gbs * self.seq_len

    def num_microbatches(self, layout: Layout) -> int:
        return self.gbs // (layout.dp * layout.mbs)


def check_layout(work: Workload, layout: Layout, gpus_per_node: int | None = None,
                 strict_layers: bool = False) -> list[str]:
    """Every constraint a layout must meet; each problem is one line with the fix."""
    mc, lay = work.model, layout
    bad: list[str] = []
    for name in ("dp", "tp", "pp", "cp", "ep", "mbs", "virtual_stages"):
        if getattr(lay, name) < 1:
            bad.append(f"{name} = {getattr(lay, name)} must be >= 1")
    if bad:
        return bad
    if lay.zero not in (0, 1, 2, 3):
        bad.append(f"zero = {lay.zero} is not a ZeRO stage; use 0, 1, 2 or 3")
    if lay.recompute not in RECOMPUTE:
        bad.append(f"recompute = '{lay.recompute}' is not one of {', '.join(RECOMPUTE)}")
    if lay.schedule not in SCHEDULES:
        bad.append(f"schedule = '{lay.schedule}' is not one of {', '.join(SCHEDULES)}")
    if gpus_per_node and lay.tp > gpus_per_node:
        bad.append(f"tp = {lay.tp} spans nodes ({gpus_per_node} GPUs each); keep tp within a node")
    if mc.num_heads % lay.tp:
        bad.append(f"tp = {lay.tp} does not divide num_heads = {mc.num_heads}")
    if mc.num_kv_heads % lay.tp and lay.tp % mc.num_kv_heads:
        bad.append(f"tp = {lay.tp} and num_kv_heads = {mc.num_kv_heads}: one must divide the other")
    # Experts replicate over tp (models/moe.py); only dense MLPs are split.
    if mc.num_moe_layers < mc.num_layers and mc.intermediate_size % lay.tp:
        bad.append(f"tp = {lay.tp} does not divide the MLP width {mc.intermediate_size}")
    if lay.tp > 1 and mc.qk_norm and mc.qk_norm_whole:
        bad.append(f"tp = {lay.tp} with whole-vector q/k norms (OLMoE): use tp = 1")
    if lay.sp and mc.num_experts:
        bad.append("sp with experts: the balance loss needs whole sequences; set sp = false")
    if sorted(lay.rank_order.split("-")) != ["cp", "dp", "pp", "tp"]:
        bad.append(f"rank_order = '{lay.rank_order}' must order tp, cp, dp and pp, e.g. "
                   f"tp-cp-dp-pp (fastest first)")
    if lay.sp_saved not in ("full", "shard"):
        bad.append(f"sp_saved = '{lay.sp_saved}' is not one of full, shard")
    if lay.sp and lay.tp == 1:
        bad.append("sp needs tp > 1")
    if lay.sp and work.seq_len % (lay.tp * lay.cp):
        bad.append(f"seq_len = {work.seq_len} is not divisible by tp·cp = {lay.tp * lay.cp} (SP)")
    if lay.cp > 1 and work.seq_len % (2 * lay.cp):
        bad.append(f"seq_len = {work.seq_len} is not divisible by 2·cp = {2 * lay.cp} (zig-zag)")
    if lay.ep > 1:
        if not mc.num_experts:
            bad.append(f"ep = {lay.ep} needs a mixture-of-experts model")
        elif mc.num_experts % lay.ep:
            bad.append(f"ep = {lay.ep} does not divide num_experts = {mc.num_experts}")
        if (lay.dp * lay.cp) % lay.ep:
            bad.append(f"ep = {lay.ep} does not divide dp·cp = {lay.dp * lay.cp}")
    if work.gbs % (lay.dp * lay.mbs):
        bad.append(f"gbs = {work.gbs} is not divisible by dp·mbs = {lay.dp * lay.mbs}")
        return bad
    m = work.num_microbatches(lay)
    chunks = num_chunks(lay)
    split = check_split(mc.num_layers, chunks, lay.pp_split, lay.pp_layers)
    if lay.pp > 1 and split:
        bad.append(split)
    if (lay.pp > 1 and work.pp_idle_rank_fails and lay.pp_split == "cumulative"
            and not lay.pp_layers and not split and chunks == lay.pp):
        idle = cumulative_idle_ranks(mc.num_layers, lay.pp, *split_costs(mc))
        if idle:
            bad.append(f"pp = {lay.pp} leaves {idle} pipeline rank(s) without a block under "
                       f"this engine's stage cut, and such a rank fails; lower pp")
    if (strict_layers and lay.pp_split == "even" and not lay.pp_layers
            and mc.num_layers % chunks):
        bad.append(f"num_layers = {mc.num_layers} is not divisible by {chunks} pipeline chunks")
    if lay.virtual_stages > 1 and lay.schedule != "interleaved":
        bad.append(f"virtual_stages = {lay.virtual_stages} needs schedule = interleaved")
    if lay.pp > 1 and lay.schedule == "interleaved" and m % lay.pp:
        bad.append(f"interleaved needs micro-batches ({m}) to be a multiple of pp = {lay.pp}")
    if lay.pp > 1 and lay.schedule == "dualpipev" and m < 2 * lay.pp:
        bad.append(f"dualpipev needs at least 2·pp = {2 * lay.pp} micro-batches, got {m}")
    if lay.pp > 1 and lay.schedule == "1f1b" and work.pp_1f1b_min_warmup and m < lay.pp - 1:
        bad.append(f"1f1b needs at least pp - 1 = {lay.pp - 1} micro-batches in this engine, "
                   f"got {m}")
    if lay.pp > 1 and lay.schedule == "zb" and m < lay.pp:
        bad.append(f"zb needs at least pp = {lay.pp} micro-batches, got {m}")
    if lay.offload and lay.zero == 0:
        bad.append("offload needs zero >= 1 (the sharded optimizer is what moves to the CPU)")
    if work.precision not in PRECISIONS:
        bad.append(f"precision = '{work.precision}' is not one of {', '.join(PRECISIONS)}")
    if work.zero1_grad_sync not in ZERO1_GRAD_SYNCS:
        bad.append(f"zero1_grad_sync = '{work.zero1_grad_sync}' is not one of "
                   f"{', '.join(ZERO1_GRAD_SYNCS)}")
    if work.pp_runtime not in PP_RUNTIMES:
        bad.append(f"pp_runtime = '{work.pp_runtime}' is not one of {', '.join(PP_RUNTIMES)}")
    if work.optimizer not in OPTIMIZER_BYTES:
        bad.append(f"optimizer = '{work.optimizer}' is not one of {', '.join(OPTIMIZER_BYTES)}")
    return bad


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2_ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0
