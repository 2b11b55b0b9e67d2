"""Model states per GPU: the bytes-per-parameter layout (param, grad, fp32 master, optimizer),
the parameters each pipeline rank holds, and ZeRO's sharding of them over the data-parallel
group (Rajbhandari et al. 2020)."""

from __future__ import annotations

from dataclasses import dataclass

from fivefold.models.presets import ModelConfig
from fivefold.plan.activations import kv_heads_per_rank
from fivefold.plan.layout import OPTIMIZER_BYTES, Layout, Workload
from fivefold.plan.placement import moe_layers_on_rank, stage


@dataclass(frozen=True)
class BytesPerParam:
    """The model-state layout, bytes per parameter before any sharding."""

    param: int
    grad: int
    master: int
    optimizer: int
    grad_accum: int = 0  # a separate fp32 accumulation buffer

    @property
    def total(self) -> int:
        return self.param + self.grad + self.master + self.optimizer + self.grad_accum

    def describe(self, zero: int = 0, shards: int = 1) -> str:
        """'2 param + 2 grad + 4 master + 8 optimizer = 16 B/param; ZeRO-1 over 64: 4.19'."""
        parts = [f"{self.param} param", f"{self.grad} grad"]
        if self.master:
            parts.append(f"{self.master} master")
        parts.append(f"{self.optimizer} optimizer")
        if self.grad_accum:
            parts.append(f"{self.grad_accum} fp32 grad accum")
        text = " + ".join(parts) + f" = {self.total} B/param"
        if zero and shards > 1:
            text += f"; ZeRO-{zero} over {shards}: {self.sharded(zero, shards):.3g} B/param"
        return text

    def sharded(self, zero: int, shards: int) -> float:
        """Bytes per parameter held on one rank under ZeRO stage `zero` over `shards` ranks
        (Rajbhandari et al. 2020 §5: P_os shards master+optimizer, P_g also grads, P_p params)."""
        n = shards
        opt = (self.master + self.optimizer) / (n if zero >= 1 else 1)
        grad = (self.grad + self.grad_accum) / (n if zero >= 2 else 1)
        param = self.param / (n if zero >= 3 else 1)
        return param + grad + opt


def bytes_per_param(precision: str = "bf16", optimizer: str = "adamw",
                    grad_dtype_bytes: int | None = None,
                    fp32_grad_accum: bool = False, fp32_params: bool = False,
                    optimizer_bytes: float | None = None) -> BytesPerParam:
    """Mixed precision (bf16/fp16): 2 param + 2 grad + 4 fp32 master + 8 Adam = 16 (ZeRO paper,
    Ultra-Scale Playbook); grad_dtype_bytes=4 gives Megatron's 18; fp32_grad_accum adds a 4-byte
    buffer, nanotron's 20. fp32: 4 + 4 + 0 + 8 = 16."""
    opt = OPTIMIZER_BYTES[optimizer] if optimizer_bytes is None else optimizer_bytes
    if precision == "fp32" or fp32_params:  # fp32_params: torchtitan's 4 + 4 + 8 = 16
        return BytesPerParam(4, grad_dtype_bytes or 4, 0, opt, 4 if fp32_grad_accum else 0)
    return BytesPerParam(2, grad_dtype_bytes or 2, 4, opt, 4 if fp32_grad_accum else 0)


@dataclass(frozen=True)
class ModelStates:
    """Model-state bytes on one rank. `cpu` is what offload moved to host memory."""

    params: float
    grads: float
    master: float
    optimizer: float
    grad_accum: float
    cpu: float
    num_params: float  # parameter elements this rank holds before ZeRO sharding
    layout: BytesPerParam

    @property
    def total(self) -> float:
        return self.params + self.grads + self.master + self.optimizer + self.grad_accum


def work_bytes_per_param(work: Workload) -> BytesPerParam:
    """The model-state layout of a workload (every field that shapes it)."""
    from fivefold.plan.optimizer import state_bytes_per_param

    per_shape = work.optimizer in ("adamw8bit", "adamw4bit", "adafactor", "muon")
    return bytes_per_param(work.precision, work.optimizer, work.grad_dtype_bytes,
                           work.fp32_grad_accum, work.fp32_params,
                           state_bytes_per_param(work.model, work.optimizer, work.muon_exclude,
                                                 work.adafactor_factored) if per_shape
                           else None)


def shard_model_states(num_params: float, bpp: BytesPerParam, zero: int, shards: int,
                       offload: bool = False, num_expert_params: float = 0.0,
                       expert_shards: int = 1) -> ModelStates:
    """Apply ZeRO to `num_params` dense and `num_expert_params` expert elements (experts shard
    over the expert-data-parallel group, dp·cp/ep). Offload moves master + optimizer to CPU;
    there the optimizer needs an fp32 copy of the weights even when training in fp32 (the
    device keeps its own parameters), so the host holds 4 + optimizer bytes per parameter."""
    def part(per: float, stage: int) -> float:
        return (per * num_params / (shards if zero >= stage else 1)
                + per * num_expert_params / (expert_shards if zero >= stage else 1))

    master, optim = part(bpp.master, 1), part(bpp.optimizer, 1)
    if offload and bpp.master == 0:
        master = part(4, 1)
    return ModelStates(
        params=part(bpp.param, 3), grads=part(bpp.grad, 2),
        master=0.0 if offload else master, optimizer=0.0 if offload else optim,
        grad_accum=part(bpp.grad_accum, 2), cpu=master + optim if offload else 0.0,
        num_params=num_params + num_expert_params, layout=bpp,
    )


def layer_param_counts(model: ModelConfig, tp: int = 1, ep: int = 1,
                       moe: bool | None = None) -> dict[str, float]:
    """Parameters of one transformer layer on one tp (and ep) rank: 'dense' (incl. replicated
    norms and router) and 'expert'. Matches ModelConfig.param_counts() at tp = ep = 1.
    `moe`: a MoE layer or a dense one (default: MoE if the model has experts). The engine runs
    a MoE block whole on every tp rank (router, experts, shared expert; parallel/tensor.py):
    only expert parallelism splits the routed experts."""
    h, d = model.hidden_size, model.dim_per_head
    q = model.num_heads * d / tp
    kv = kv_heads_per_rank(model, tp) * d
    attn = 2 * h * q + 2 * h * kv + ((q + 2 * kv) if model.qkv_bias else 0)
    norms = 2 * (1 if model.norm == "rmsnorm" else 2) * h
    if model.qk_norm:  # replicated over tp (whole-vector q/k norms run only at tp 1)
        norms += model.q_size + model.kv_size if model.qk_norm_whole else 2 * d
    if model.num_experts if moe is None else moe:
        ffn = model.moe_params()
        return {"dense": attn + norms + ffn["router"] + ffn["shared"],
                "expert": ffn["routed"] / ep}
    f = model.intermediate_size / tp
    mlp = 3 * h * f if model.mlp == "swiglu" else 2 * h * f + f + h
    return {"dense": attn + mlp + norms, "expert": 0.0}


def rank_param_counts(model: ModelConfig, layout: Layout, rank: int = 0) -> dict[str, float]:
    """Parameter elements pipeline rank `rank` holds (one tp rank): its layers, the embedding
    on the first chunk, final norm + output head on the last (a tied head is a second copy
    when it sits on another rank, as in Megatron)."""
    layers, embed, head = stage(model, layout, rank)
    moe = moe_layers_on_rank(model, layout, rank)
    dense, expert = 0.0, 0.0
    for count, is_moe in ((layers - moe, False), (moe, True)):
        per_layer = layer_param_counts(model, layout.tp, layout.ep, is_moe)
        dense += count * per_layer["dense"]
        expert += count * per_layer["expert"]
    vocab = model.vocab_size * model.hidden_size / layout.tp
    if embed:
        dense += vocab
    if head:
        dense += (1 if model.norm == "rmsnorm" else 2) * model.hidden_size
        if not (model.tie_embeddings and embed):
            dense += vocab
    return {"dense": dense, "expert": expert}


def model_state_bytes(model: ModelConfig, *, tp: int = 1, pp: int = 1, dp: int = 1,
                      cp: int = 1, ep: int = 1, zero: int = 0, offload: bool = False,
                      precision: str = "bf16", optimizer: str = "adamw",
                      grad_dtype_bytes: int | None = None, fp32_grad_accum: bool = False,
                      pp_rank: int = 0, schedule: str = "1f1b",
                      virtual_stages: int = 1, pp_split: str = "even",
                      pp_layers: tuple[int, ...] = (), lora_rank: int = 0,
                      lora_base: str = "none", lora_targets: str = "") -> ModelStates:
    """Model-state bytes held by one rank between steps (pipeline rank `pp_rank`): its share of
    parameters, gradients, fp32 master weights and optimizer moments. ZeRO shards over the
    dp×cp group (cp ranks hold the same weights); expert states over dp·cp/ep."""
    offload = offload not in (False, "none")  # a config's tier name also says it
    layout = Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, offload=offload,
                    schedule=schedule, virtual_stages=virtual_stages, pp_split=pp_split,
                    pp_layers=tuple(pp_layers))
    counts = rank_param_counts(model, layout, pp_rank)
    bpp = bytes_per_param(precision, optimizer, grad_dtype_bytes, fp32_grad_accum)
    if lora_rank:  # a frozen base and trainable adapters (plan/lora.py)
        from fivefold.plan.lora import DEFAULT_TARGETS, lora_state_items

        return ModelStates(**lora_state_items(
            model, layout, pp_rank, bpp, 4 if precision == "fp32" else 2,
            counts["dense"] + counts["expert"], lora_rank, lora_targets or DEFAULT_TARGETS,
            lora_base, sum(layer_param_counts(model, tp, ep).values())), layout=bpp)
    return shard_model_states(counts["dense"], bpp, zero, dp * cp, offload,
                              counts["expert"], max(dp * cp // ep, 1))
