"""The planner's LoRA and QLoRA: memory of a frozen base with trainable adapters, and FLOPs.

Memory (per rank, between steps; Hu et al. 2021 §4, Dettmers et al. 2023 §3):
- the frozen base: each targeted linear at `base_bytes_per_param` (the compute dtype, int8
  with an fp32 scale per output row, or NF4: 4 bits + an int8 absmax per block of 64 + an
  fp32 factor per 256 of those, "double quantisation", 4.127 bits); every other weight
  (embeddings, norms, head, untargeted linears) frozen in the compute dtype;
- the adapters: A (r × in) and B (out × r) per targeted linear, with the full training states
  of `bytes_per_param` (param, grad, fp32 master under mixed precision, Adam moments), the
  only tensors ZeRO-1/2 shard;
- activations as in full fine-tuning (the planner's activation model is unchanged; the
  adapters' own inputs are the linears' inputs, already counted, plus r values per token).

Tensor parallelism (finetune/tensor_parallel.py): column layers keep A whole and split B, row
layers split A and keep B whole; the base splits as in full training.

FLOPs: the base runs its forward (2 FLOPs per weight) and its input-gradient GEMM (2), not its
weight-gradient GEMM: 4·N instead of 6·N, ~2/3 of full fine-tuning for the matmuls; the
adapters add 6 FLOPs per adapter weight; attention is unchanged (3 × forward).
This module imports no torch.
"""

from __future__ import annotations

from fivefold.models.presets import ModelConfig
from fivefold.plan.activations import kv_heads_per_rank
from fivefold.plan.flops import forward_flops_per_token
from fivefold.plan.placement import stage

NF4_BLOCK, NF4_SCALER_BLOCK = 64, 256  # QLoRA's (and torchao's) defaults
# Per NF4 tensor besides its blocks (quant/linear.py NF4Linear): the fp32 mean subtracted
# from the absmaxes before their 8-bit quantisation, and the 16-value fp32 code table.
NF4_TENSOR_BYTES = 4 + 16 * 4
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def base_bytes_per_param(base: str, dtype_bytes: int, in_features: int) -> float:
    """Bytes per frozen base weight of a linear with `in_features` inputs."""
    if base == "nf4":  # 4-bit codes, an int8 absmax per 64, an fp32 factor per 256 absmaxes
        return 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_SCALER_BLOCK)
    if base == "int8":  # one byte, plus an fp32 scale per output row
        return 1.0 + 4 / in_features
    return float(dtype_bytes)


def layer_linears(model: ModelConfig, tp: int = 1) -> dict[str, tuple[int, int, str]]:
    """name -> (in, out, tensor-parallel style) of one dense layer's linears (full shapes)."""
    h, d, f = model.hidden_size, model.dim_per_head, model.intermediate_size
    q, kv = model.num_heads * d, model.num_kv_heads * d
    out = {"q_proj": (h, q, "col"), "k_proj": (h, kv, "col_kv"), "v_proj": (h, kv, "col_kv"),
           "o_proj": (q, h, "row")}
    if model.num_experts:  # routed experts are stacked tensors, not linears: attention only
        return out
    if model.mlp == "swiglu":
        out["gate_proj"] = (h, f, "col")
    out.update(up_proj=(h, f, "col"), down_proj=(f, h, "row"))
    return out


def _targets(spec: str, linears) -> list[str]:
    wanted = [t.strip() for t in spec.split(",") if t.strip()]
    if wanted == ["all-linear"]:
        return list(linears)
    return [n for n in linears if n in wanted]


def layer_lora_counts(model: ModelConfig, rank: int, targets: str, tp: int = 1) -> dict:
    """Per layer on one tp rank: base weights of the targeted linears (elements and bytes-
    weighted by their in_features), and adapter elements."""
    linears = layer_linears(model, tp)
    base, adapters, inputs = 0.0, 0.0, []
    for name in _targets(targets, linears):
        fin, fout, style = linears[name]
        if style == "col_kv":
            local_out = kv_heads_per_rank(model, tp) * model.dim_per_head
        else:
            local_out = fout / tp if style == "col" else fout
        local_in = fin / tp if style == "row" else fin
        weights = local_in * local_out
        base += weights
        inputs.append((weights, local_in))  # int8 keeps a scale per row of the shard
        adapters += rank * fin + local_out * rank if style != "row" else (
            rank * local_in + fout * rank)
    return {"base": base, "adapters": adapters, "inputs": inputs}


def lora_param_split(model: ModelConfig, layout, pp_rank: int, rank: int, targets: str,
                     dense_params: float) -> dict[str, float]:
    """{'base_linear', 'frozen_other', 'adapters'} elements on pipeline rank `pp_rank` (one
    tp rank), from the full-training count `dense_params` of that rank."""
    layers = stage(model, layout, pp_rank)[0]
    per = layer_lora_counts(model, rank, targets, layout.tp)
    return {"base_linear": layers * per["base"],
            "frozen_other": dense_params - layers * per["base"],
            "adapters": layers * per["adapters"], "layers": layers, "per_layer": per}


def base_bytes(model: ModelConfig, layout, pp_rank: int, rank: int, targets: str, base: str,
               dtype_bytes: int, dense_params: float) -> float:
    """Bytes of the frozen base on one rank: targeted linears in `base`, the rest in dtype."""
    split = lora_param_split(model, layout, pp_rank, rank, targets, dense_params)
    inputs = split["per_layer"]["inputs"]
    linear = sum(w * base_bytes_per_param(base, dtype_bytes, fin) for w, fin in inputs)
    if base == "nf4":
        linear += NF4_TENSOR_BYTES * len(inputs)
    linear *= split["layers"]
    return linear + split["frozen_other"] * dtype_bytes


def lora_flops_per_token(model: ModelConfig, seq_len: int, rank: int, targets: str,
                         causal: bool = False) -> float:
    """Training FLOPs per token with a frozen base: 4 per base weight (forward, input
    gradient), 6 per adapter weight, attention 3 × forward; the frozen head 4·h·V."""
    fwd = forward_flops_per_token(model, seq_len, causal)
    adapters = layer_lora_counts(model, rank, targets)["adapters"]
    layer = 2 * fwd.layer_matmul + 3 * fwd.layer_attention + 6 * adapters
    return fwd.num_layers * layer + 2 * fwd.head


def block_frozen_bytes(model: ModelConfig, layout, rank: int, targets: str, base: str,
                       dtype_bytes: int, layer_params: float) -> float:
    """Frozen bytes of one transformer block on one tp rank: its targeted linears in `base`,
    its other weights (untargeted linears, norms) in the compute dtype. `layer_params`: the
    block's full-training parameter count on that rank (plan.model_states.layer_param_counts)."""
    per = layer_lora_counts(model, rank, targets, layout.tp)
    linear = sum(w * base_bytes_per_param(base, dtype_bytes, fin) for w, fin in per["inputs"])
    if base == "nf4":
        linear += NF4_TENSOR_BYTES * len(per["inputs"])
    return linear + (layer_params - per["base"]) * dtype_bytes


def sharded_block_bytes(block_bytes: float, shards: int) -> float:
    """One rank's ZeRO-3 shard of a block's frozen bytes (parallel/zero3_frozen.py): the
    block's bytes padded to a multiple of the dp×cp ranks, divided among them."""
    return -(-round(block_bytes) // shards)


def lora_state_items(model: ModelConfig, layout, pp_rank: int, bpp, dtype_bytes: int,
                     dense_params: float, rank: int, targets: str, base: str,
                     layer_params: float = 0.0) -> dict:
    """Model-state bytes of one rank (the fields of plan.model_states.ModelStates but `layout`):
    the adapters' states sharded by ZeRO over dp×cp (under ZeRO-3 the adapters' parameters
    too); the frozen base whole on every dp rank, except under ZeRO-3, where each block's
    frozen bytes are sharded too (`layer_params` gives the block's size) and only the rest
    (embedding, final norm, head) stays whole. The gathered blocks are comm buffers."""
    split = lora_param_split(model, layout, pp_rank, rank, targets, dense_params)
    adapters, shards, zero = split["adapters"], layout.dp * layout.cp, layout.zero

    def part(per: float, stage_: int) -> float:
        return per * adapters / (shards if zero >= stage_ and shards > 1 else 1)

    master, optim = part(bpp.master, 1), part(bpp.optimizer, 1)
    if layout.offload and bpp.master == 0:
        master = part(4, 1)
    frozen = base_bytes(model, layout, pp_rank, rank, targets, base, dtype_bytes, dense_params)
    if zero == 3 and shards > 1 and split["layers"]:
        block = block_frozen_bytes(model, layout, rank, targets, base, dtype_bytes,
                                   layer_params)
        frozen += split["layers"] * (sharded_block_bytes(block, shards) - block)
    return {"params": frozen + part(bpp.param, 3), "grads": part(bpp.grad, 2),
            "master": 0.0 if layout.offload else master,
            "optimizer": 0.0 if layout.offload else optim,
            "grad_accum": part(bpp.grad_accum, 2),
            "cpu": master + optim if layout.offload else 0.0, "num_params": adapters}


def describe_lora(work) -> str:
    """One line for the plan's header: the adapters, the base's bytes, the FLOPs ratio."""
    if not work.lora_rank:
        return ""
    from fivefold.plan.flops import model_flops_per_token

    mc = work.model
    per = layer_lora_counts(mc, work.lora_rank, work.lora_targets)
    adapters = per["adapters"] * mc.num_layers
    bpp = sum(w * base_bytes_per_param(work.lora_base, work.dtype_bytes, fin)
              for w, fin in per["inputs"]) / max(per["base"], 1)
    ratio = lora_flops_per_token(mc, work.seq_len, work.lora_rank, work.lora_targets,
                                 work.causal_flops) / model_flops_per_token(
        mc, work.seq_len, work.causal_flops)
    return (f"\nLoRA rank {work.lora_rank} on {work.lora_targets}: {adapters / 1e6:.2f}M "
            f"trainable parameters (optimizer states and gradients for these only); frozen "
            f"base linears in {work.lora_base if work.lora_base != 'none' else work.precision}"
            f" at {bpp:.3f} B/param; training FLOPs {ratio:.2f}x full fine-tuning (the base's "
            f"weight-gradient GEMMs skipped)")
