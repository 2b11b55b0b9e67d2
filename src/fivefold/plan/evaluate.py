"""One layout, fully explained: memory items, FLOPs, communication, time, MFU, fits or not.

The items of plan/'s flow (workload -> terms -> items -> search): a LayoutPlan is assembled
here from the terms (memory.py, timing.py, comm.py, flops.py, nvme.py, ...), each a function
of the workload, the layout and the hardware; the search (search.py, auto_layout.py) reads
LayoutPlans and bounds.py, never a term (tests/test_plan_flow.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivefold.plan.comm import collectives, ledger_volume, wire_volume
from fivefold.plan.flops import hardware_flops_per_token, model_flops_per_token
from fivefold.plan.grad_sync import choose_grad_sync
from fivefold.plan.hardware import GIB, Assumptions, Hardware, usable_memory
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.memory import MEMORY_ITEMS, memory_items, placed_peak
from fivefold.plan.model_states import work_bytes_per_param
from fivefold.plan.network import call_time
from fivefold.plan.nvme import tier_memory
from fivefold.plan.placement import bubble_ratio, critical_ranks, stage
from fivefold.plan.timing import StepTime, rank_compute, step_time

STATE_ITEMS = ("params", "grads", "master", "optimizer", "grad_accum")


def stage_answers(work: Workload, layout: Layout, hw: Hardware,
                  assume: Assumptions) -> list[dict]:
    """Per pipeline rank: its layers, whether it holds the embedding / the head, its memory
    by item (model states as the engine measures them per rank), and its compute time per
    micro-batch and per step."""
    m = work.num_microbatches(layout)
    out = []
    for rank in range(layout.pp):
        placed = tier_memory(*memory_items(work, layout, assume, rank,
                                           limit=usable_memory(hw, assume)),
                             layout.offload, hw)
        items, cpu = placed.items, placed.host
        layers, embed, head = stage(work.model, layout, rank)
        rc = rank_compute(work, layout, hw, assume, rank)
        out.append({
            "pp_rank": rank, "layers": layers, "embedding": embed, "head": head,
            "memory_bytes": {k: items[k] for k in MEMORY_ITEMS},
            "memory_total_bytes": sum(items.values()),
            "model_states_bytes": sum(items[k] for k in STATE_ITEMS),
            "cpu_offload_bytes": cpu,
            "forward_s_per_microbatch": rc.forward, "backward_s_per_microbatch": rc.backward,
            "compute_s_per_step": m * (rc.forward + rc.backward),
        })
    return out


@dataclass
class LayoutPlan:
    """Everything the planner predicts for one layout."""

    layout: Layout
    num_microbatches: int
    memory: dict[str, float]  # bytes on the most-loaded rank, by item
    memory_rank: int  # the pipeline rank that is most loaded
    cpu_bytes: float  # offloaded optimizer states per GPU in host memory (nvme: staging)
    memory_limit: float
    bytes_per_param: str
    model_flops: float  # per step, all GPUs (what MFU counts)
    hardware_flops: float  # per step, with recomputation
    ledger: dict[str, dict[str, float]]  # per step on a rank of stage 0, engine convention
    wire: dict[str, float]  # bytes on the wire per step on that rank, by group
    time: StepTime
    tokens_per_step: int
    peak_flops: float
    context: tuple = ()  # (work, hw, assume), for the per-stage answers computed on demand
    grad_sync: str = "step"  # ZeRO-2/3 reduce-scatter per "step" or "microbatch" (as planned)
    grad_sync_reason: str = ""  # why grad_sync = "auto" chose it ("": set, not chosen)
    disk_bytes: float = 0.0  # offload = "nvme": the states per GPU in files (plan/nvme.py)
    host_limit: float = 0.0  # host bytes per GPU the offloaded states may take (0: any)

    @property
    def stages(self) -> list[dict]:
        """Memory and time of every pipeline rank (computed when asked: pp can be 100+)."""
        if not hasattr(self, "_stages"):
            self._stages = stage_answers(self.context[0], self.layout, *self.context[1:])
        return self._stages

    def named_stages(self) -> dict[str, int]:
        """The first, last, most-loaded (memory) and slowest (compute) pipeline ranks."""
        st = self.stages
        return {"first": 0, "last": self.layout.pp - 1, "most_loaded": self.memory_rank,
                "slowest": max(st, key=lambda s: s["compute_s_per_step"])["pp_rank"]}

    @property
    def memory_total(self) -> float:
        """What the device must hold on the most-loaded rank: reserved + the CUDA context."""
        return sum(self.memory.values())

    @property
    def context_bytes(self) -> float:
        return self.context[2].context_gib * GIB if self.context else 0.0

    @property
    def peak_allocated(self) -> float:
        """torch.cuda.max_memory_allocated: what tensors hold at the peak."""
        return self.memory_total - self.memory["overhead"]

    @property
    def peak_reserved(self) -> float:
        """torch.cuda.max_memory_reserved: allocated + the caching allocator's waste
        (allocator.allocator_waste). An OOM depends on this plus the context, not on allocated."""
        return self.memory_total - self.context_bytes

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.memory_limit and self.host_fits

    @property
    def host_fits(self) -> bool:
        return not self.host_limit or self.cpu_bytes <= self.host_limit

    @property
    def largest_item(self) -> tuple[str, float]:
        return max(self.memory.items(), key=lambda kv: kv[1])

    @property
    def why(self) -> str:
        """'fits: 61.2 of 80 GiB' or 'does not fit: 94.1 of 80 GiB (activations 60.3 GiB)'."""
        total, limit = self.memory_total / GIB, self.memory_limit / GIB
        if self.fits:
            return f"fits: {total:.1f} of {limit:.0f} GiB"
        if not self.host_fits:
            return (f"does not fit: {self.cpu_bytes / GIB:.1f} GiB of offloaded states per GPU"
                    f" in {self.host_limit / GIB:.1f} GiB of host memory per GPU")
        name, value = self.largest_item
        return f"does not fit: {total:.1f} of {limit:.0f} GiB ({name} {value / GIB:.1f} GiB)"

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.time.total / self.world_size

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.time.total * self.world_size * self.peak_flops)

    @property
    def hfu(self) -> float:
        return self.hardware_flops / (self.time.total * self.world_size * self.peak_flops)

    def to_dict(self) -> dict:
        """JSON-ready: the layout, every memory item in bytes, FLOPs, communication bytes per
        dimension, step time and its parts, tokens/s per GPU, MFU, fits and why."""
        return {
            "layout": dataclasses.asdict(self.layout),
            "layout_short": self.layout.short(),
            "world_size": self.world_size,
            "num_microbatches": self.num_microbatches,
            "grad_sync": self.grad_sync,
            "grad_sync_reason": self.grad_sync_reason,
            "memory_bytes": {k: self.memory[k] for k in MEMORY_ITEMS},
            "memory_total_bytes": self.memory_total,
            "memory_limit_bytes": self.memory_limit,
            "memory_rank": self.memory_rank,
            "peak_allocated_bytes": self.peak_allocated,
            "peak_reserved_bytes": self.peak_reserved,
            "context_bytes": self.context_bytes,
            "cpu_offload_bytes": self.cpu_bytes,
            "nvme_offload_bytes": self.disk_bytes,
            "bytes_per_param": self.bytes_per_param,
            "fits": self.fits,
            "why": self.why,
            "model_flops_per_step": self.model_flops,
            "hardware_flops_per_step": self.hardware_flops,
            "comm_ledger_bytes_per_step": self.ledger,
            "comm_wire_bytes_per_step": self.wire,
            "step_time_s": self.time.total,
            "step_time_parts_s": self.time.parts(),
            "recompute_time_s": self.time.recompute,
            "bubble_ratio": bubble_ratio(self.layout, self.num_microbatches),
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "stages": self.stages,
            "named_stages": self.named_stages(),
        }


def plan_layout(work: Workload, layout: Layout, hw: Hardware, assume: Assumptions) -> LayoutPlan:
    """Predict memory, FLOPs, communication and time for one (valid) layout."""
    reason = ""  # why grad_sync = "auto" chose what it did, chosen per layout
    if work.grad_sync == "auto":
        choice, reason = choose_grad_sync(work, layout, hw, assume)
        work = dataclasses.replace(work, grad_sync=choice)
    m = work.num_microbatches(layout)
    rank, placed = placed_peak(work, layout, hw, assume)
    bpp = work_bytes_per_param(work)
    tokens = work.tokens_per_step
    return LayoutPlan(
        layout=layout,
        num_microbatches=m,
        memory=placed.items,
        memory_rank=rank,
        cpu_bytes=placed.host,
        memory_limit=usable_memory(hw, assume),
        bytes_per_param=bpp.describe(layout.zero, layout.dp * layout.cp),
        model_flops=_model_flops(work) * tokens,
        hardware_flops=(hardware_flops_per_token(work.model, work.seq_len, layout.recompute,
                                                 work.causal_flops)
                        - model_flops_per_token(work.model, work.seq_len, work.causal_flops)
                        + _model_flops(work)) * tokens,
        ledger=ledger_volume(work, layout, 0),
        wire=wire_volume(work, layout, 0),
        time=step_time(work, layout, hw, assume),
        tokens_per_step=tokens,
        peak_flops=hw.peak_flops(work.precision),
        context=(work, hw, assume),
        grad_sync=work.grad_sync,
        grad_sync_reason=reason,
        disk_bytes=placed.disk,
        host_limit=0.0 if hw.device_is_host else hw.host_memory_gib * GIB,
    )


def unhidden_comm(plan: LayoutPlan) -> float:
    """Seconds of every collective of a step on its busiest pipeline rank, none of it
    overlapped. Overlap needs an idle resource: on a CPU whose cores the ranks' compute keeps
    busy, the transport's copies and reductions (gloo's, on the same cores) run instead of
    compute, not beside it. Times are calibrate's, measured with the cores free for them."""
    work, hw, assume = plan.context
    lay = plan.layout
    bucket = work.bucket_mb * 1e6
    worst = 0.0
    for rank in critical_ranks(work.model, lay):
        total = sum(call_time(c, hw, assume, lay, bucket) for c in collectives(work, lay, rank))
        worst = max(worst, total)
    return worst


def _model_flops(work: Workload) -> float:
    """Training FLOPs per token: full training, or LoRA's frozen base (plan/lora.py)."""
    if work.lora_rank:
        from fivefold.plan.lora import lora_flops_per_token

        return lora_flops_per_token(work.model, work.seq_len, work.lora_rank,
                                    work.lora_targets, work.causal_flops)
    return model_flops_per_token(work.model, work.seq_len, work.causal_flops)
