"""What is planned: the workload (model + training shape) and one layout of the GPUs.

Also the pipeline facts every other module needs: which layers a pipeline rank holds, how many
micro-batches of activations it keeps alive, and the bubble of each schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from fivefold.models.presets import ModelConfig
from fivefold.parallel.pipeline.actions import BACKWARD, FORWARD
from fivefold.parallel.pipeline.schedules import interleaved_chunk, interleaved_warmup
from fivefold.plan.split import (
    check_split,
    cumulative_idle_ranks,
    model_stage_layers,
    split_costs,
    stage_layer_counts,
)

SCHEDULES = ("afab", "1f1b", "interleaved", "zb", "dualpipev")
# "op": torchtitan's per-operator selective checkpointing, planned for its runs
# (plan/activations.py: op_sac_kept); the engine runs the others.
RECOMPUTE = ("none", "selective", "full", "auto", "op")
PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
PP_RUNTIMES = ("engine", "torch", "torch-2412")  # Workload.pp_runtime
# Optimizer state bytes per parameter, nominal (fp32 moments): Adam m+v 8, SGD momentum 4,
# 8-bit Adam 2 + 8/256 of block scales, 4-bit 1 + 8/128; Adafactor (rows + columns) and Muon
# (4 on hidden matrices, 8 elsewhere) depend on the shapes: plan/optimizer.py counts each
# tensor (small ones keep fp32 states too), and `memory.work_bytes_per_param` uses that.
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8, "sgd": 4, "adamw8bit": 2 + 8 / 256,
                   "adamw4bit": 1 + 8 / 128, "adafactor": 0.0, "muon": 4.0}


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
    # A materialised loss on vocabulary-parallel logits (DTensor loss parallel, torchtitan
    # with tp > 1): its backward holds more fp32 T×V/tp buffers (plan/activations.py).
    loss_parallel: bool = False
    # chunked_loss = False as nanotron's sharded cross-entropy: the fp32 softmax saved, its
    # gradient made in place (plan/activations.py).
    softmax_loss: bool = False
    # ZeRO-1/2's gradient reduce-scatter after backward and parameter all-gather after the
    # step run blocking, hidden behind nothing (nanotron's ZeroDistributedOptimizer).
    zero_sync_blocking: bool = False
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

    @property
    def dtype_bytes(self) -> int:
        """Bytes of an activation / a model parameter in the forward pass."""
        return 4 if self.precision == "fp32" else 2

    @property
    def tokens_per_step(self) -> int:
        return self.gbs * self.seq_len

    def num_microbatches(self, layout: Layout) -> int:
        return self.gbs // (layout.dp * layout.mbs)


# ----------------------------------------------------------------------------------------
# Pipeline placement


def num_chunks(layout: Layout) -> int:
    """Model chunks along the pipeline: pp·v for interleaved, 2·pp for DualPipeV (V shape)."""
    if layout.schedule == "dualpipev" and layout.pp > 1:
        return 2 * layout.pp
    if layout.schedule == "interleaved":
        return layout.pp * layout.virtual_stages
    return layout.pp


def chunk_layer_counts(model: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """Layers per model chunk, from the split the engine uses too (plan/split.py)."""
    return model_stage_layers(model, num_chunks(layout), layout.pp_split, layout.pp_layers)


def _split_key(model: ModelConfig, layout: Layout) -> tuple:
    """What the split depends on, hashable (the costs only matter to the balanced split)."""
    costs = (split_costs(model) if layout.pp_split != "even" and not layout.pp_layers
             else (1.0, 0.0, 0.0))
    return (model.num_layers, layout.pp, layout.schedule, layout.virtual_stages,
            layout.pp_split, layout.pp_layers, costs)


@functools.lru_cache(maxsize=65536)
def _stage(key: tuple, rank: int) -> tuple[int, bool, bool]:
    num_layers, pp, schedule, v, split, layers, costs = key
    lay = Layout(pp=pp, schedule=schedule, virtual_stages=v)
    counts = stage_layer_counts(num_layers, num_chunks(lay), split, layers, *costs)
    mine = _rank_chunks(pp, schedule, v, rank)
    return sum(counts[c] for c in mine), 0 in mine, len(counts) - 1 in mine


@functools.lru_cache(maxsize=16384)
def _critical_ranks(key: tuple) -> tuple[int, ...]:
    pp = key[1]
    heaviest = max(range(pp), key=lambda r: _stage(key, r)[0])
    return tuple(sorted({0, pp - 1, heaviest}))


def rank_chunks(layout: Layout, rank: int) -> tuple[int, ...]:
    """Chunk indices pipeline rank `rank` holds (interleaved: r, r+p, …; DualPipeV: r, 2p-1-r)."""
    return _rank_chunks(layout.pp, layout.schedule, layout.virtual_stages, rank)


@functools.lru_cache(maxsize=65536)
def _rank_chunks(pp: int, schedule: str, virtual_stages: int, rank: int) -> tuple[int, ...]:
    if schedule == "dualpipev" and pp > 1:
        return (rank, 2 * pp - 1 - rank)
    per_rank = virtual_stages if schedule == "interleaved" else 1
    return tuple(rank + k * pp for k in range(per_rank))


def stage(model: ModelConfig, layout: Layout, rank: int) -> tuple[int, bool, bool]:
    """(layers, holds the embedding, holds the head) of one pipeline rank."""
    return _stage(_split_key(model, layout), rank)


def layers_on_rank(model: ModelConfig, layout: Layout, rank: int) -> int:
    return stage(model, layout, rank)[0]


def rank_layers(model: ModelConfig, layout: Layout, rank: int) -> list[int]:
    """Indices, in the unsplit model, of the layers pipeline rank `rank` holds."""
    counts = chunk_layer_counts(model, layout)
    starts = [sum(counts[:c]) for c in range(len(counts))]
    return [i for c in rank_chunks(layout, rank) for i in range(starts[c], starts[c] + counts[c])]


def moe_layers_on_rank(model: ModelConfig, layout: Layout, rank: int) -> int:
    """How many of the rank's layers are mixture-of-experts layers (the rest are dense)."""
    if not model.num_experts:
        return 0
    return sum(model.is_moe_layer(i) for i in rank_layers(model, layout, rank))


def holds_embedding(layout: Layout, rank: int) -> bool:
    return 0 in rank_chunks(layout, rank)


def holds_head(layout: Layout, rank: int) -> bool:
    return num_chunks(layout) - 1 in rank_chunks(layout, rank)


def inflight_microbatches(layout: Layout, num_microbatches: int, rank: int) -> float:
    """Micro-batches' worth of this rank's activations alive at its peak (in units of all
    the rank's layers for one micro-batch).

    AFAB (GPipe) keeps all m; 1F1B keeps min(m, p − r) on rank r (Narayanan et al. 2021 §2.2);
    interleaved follows Megatron's warm-up count (p − r − 1)·2 + (v − 1)·p + 1
    chunk-micro-batches, which on rank 0 is p·(1 + (p − 1)/(p·v)) micro-batches (Korthikanti
    et al. 2022 §4.2.3). ZB-H1 keeps a micro-batch's graph until its W, and the engine's W
    placement lets every rank, not only rank 0, reach 1F1B's rank-0 peak of min(m, p) (Qi et
    al. 2023 bound the peak, not its spread). DualPipeV keeps 2p + 1 half-size chunks, p + 1/2
    micro-batches, on every rank. All of these equal `parallel.pipeline.check.peak_inflight`
    of the schedules the engine runs (docs/pipeline.md; tests/test_plan_flops_comm.py).
    """
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    if p == 1:
        return 1.0
    if layout.schedule == "afab":
        return float(m)
    if layout.schedule == "1f1b":
        return float(min(m, p - rank))
    if layout.schedule == "zb":
        return float(min(m, p))
    if layout.schedule == "interleaved":
        chunk_mbs = min(m * v, (p - rank - 1) * 2 + (v - 1) * p + 1)
        return chunk_mbs / v
    return float(min(m, p + 0.5))  # dualpipev


def inflight_per_chunk(layout: Layout, num_microbatches: int, rank: int,
                       weights: tuple[float, ...]) -> tuple[float, ...]:
    """Per chunk of `rank` (in `rank_chunks` order), the micro-batches whose activations are
    alive at the rank's peak, where a micro-batch of chunk c weighs `weights[c]` (its bytes).

    With one chunk per rank, or chunks of equal weight, every chunk holds the average,
    `inflight_microbatches`. Interleaved chunks of unequal weight (an uneven `pp_layers`)
    are not held equally: the peak is found along the order the engine runs
    (`parallel.pipeline.schedules`): w warm-up forwards, then each forward followed by a
    backward, the k-th forward through `interleaved_chunk(F, k)`, the k-th backward
    `interleaved_chunk(B, k)`. What is alive after steady forward w+i and before backward i
    repeats with period p·v in i (each period adds and frees p micro-batches of every
    chunk), so the peak lies in the first p·v steady steps. DualPipeV keeps the average
    (its peak is not split by chunk here)."""
    chunks = len(rank_chunks(layout, rank))
    p, m, v = layout.pp, num_microbatches, layout.virtual_stages
    if layout.schedule != "interleaved" or p == 1 or len(set(weights)) <= 1:
        return (inflight_microbatches(layout, m, rank),) * chunks
    return _interleaved_inflight(p, m, v, rank, tuple(weights))


@functools.lru_cache(maxsize=16384)
def _interleaved_inflight(p: int, m: int, v: int, rank: int,
                          weights: tuple[float, ...]) -> tuple[float, ...]:
    warmup = interleaved_warmup(p, m, v, rank)
    alive = [0] * v
    for k in range(warmup):
        alive[interleaved_chunk(FORWARD, k, p, v)] += 1
    best = tuple(alive)
    for i in range(min(m * v - warmup, p * v)):
        alive[interleaved_chunk(FORWARD, warmup + i, p, v)] += 1
        if sum(n * w for n, w in zip(alive, weights)) > sum(
                n * w for n, w in zip(best, weights)):
            best = tuple(alive)
        alive[interleaved_chunk(BACKWARD, i, p, v)] -= 1
    return tuple(float(n) for n in best)


def pending_weight_passes(layout: Layout, num_microbatches: int, rank: int) -> tuple[int, ...]:
    """Per chunk of `rank` (in `rank_chunks` order), the most micro-batches whose B has run
    and whose W has not, at the rank's peak: each keeps its output gradients until W.

    Read off the engine's lists (`parallel.pipeline.schedules`; a B directly followed by its
    own W runs as one backward and keeps nothing): ZB-H1 keeps r + 1 on rank r > 0 and none
    on rank 0, whose every W follows its B; DualPipeV keeps r + 1 on rank r > 0 as well,
    ⌈(r+1)/2⌉ in the down-going chunk and ⌊(r+1)/2⌋ in the up-going one. Equal to
    `parallel.pipeline.check.peak_pending_weights` (tests/test_plan_flops_comm.py)."""
    chunks = len(rank_chunks(layout, rank))
    if layout.pp == 1 or rank == 0 or layout.schedule not in ("zb", "dualpipev"):
        return (0,) * chunks
    n = min(rank + 1, num_microbatches)
    if layout.schedule == "zb":
        return (n,)
    return ((n + 1) // 2, n // 2)


def bubble_ratio(layout: Layout, num_microbatches: int) -> float:
    """Pipeline bubble time as a fraction of the ideal compute time m·(t_f + t_b).

    AFAB and 1F1B: (p − 1)/m, i.e. (p − 1)/(m + p − 1) of the step (Narayanan 2021 §2.2.1).
    Interleaved: (p − 1)/(v·m) (Narayanan 2021 §2.2.2).
    ZB-H1: one third of 1F1B's, (p − 1)/(3m) (Qi et al. 2023, with F = B = W).
    DualPipeV: (p − 1)/(6m), half of ZB-H1's. DeepSeek-V3 Table 2 gives (PP/2 − 1)(F&B + B − 3W)
    where PP counts stages, two per rank in the V (PP = 2p); the engine's DualPipeV schedule,
    simulated with F = B = W and no F&B overlap (`parallel.pipeline.check.simulate`), idles
    exactly (p − 1)/(6m) of the ideal time.
    """
    p, m = layout.pp, num_microbatches
    if p == 1:
        return 0.0
    if layout.schedule == "interleaved":
        return (p - 1) / (layout.virtual_stages * m)
    if layout.schedule == "zb":
        return (p - 1) / (3 * m)
    if layout.schedule == "dualpipev":
        return (p - 1) / (6 * m)
    return (p - 1) / m


def critical_ranks(model: ModelConfig, layout: Layout) -> tuple[int, ...]:
    """Pipeline ranks that can be the most loaded: the first (embedding, most activations),
    the last (output head, logits) and the one holding the most layers."""
    return _critical_ranks(_split_key(model, layout))


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
    if work.pp_runtime not in PP_RUNTIMES:
        bad.append(f"pp_runtime = '{work.pp_runtime}' is not one of {', '.join(PP_RUNTIMES)}")
    if work.optimizer not in OPTIMIZER_BYTES:
        bad.append(f"optimizer = '{work.optimizer}' is not one of {', '.join(OPTIMIZER_BYTES)}")
    return bad


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def log2_ceil(n: int) -> int:
    return max(1, math.ceil(math.log2(n))) if n > 1 else 0
