"""The optimizer's terms: state bytes per tensor and the update's own FLOPs (no torch).

State bytes of one logical tensor of n values (the engine's rules, parallel/):

    adamw, adam       8n                        two fp32 moments
    adamw8bit         2n + 8·n/256              two moments of 1-byte codes + a fp32 scale
                                                per 256-value block (Dettmers et al. 2021)
    adamw4bit         n + 8·n/128               0.5-byte codes, blocks of 128 (Li et al. 2023)
                      (8n for a tensor under 4096 values or not a whole number of blocks)
    adafactor         4·(rows + cols) for a matrix (Shazeer & Stern 2018), 4n for a vector
    muon              4n for a hidden matrix (one momentum); AdamW's 8n for the rest
                      (embeddings, head, norms, biases, routers)
    sgd               4n

Muon's Newton-Schulz iteration (parallel/muon.py) costs per m x n matrix (m <= n) and step
k·(4·m²·n + 2·m³) FLOPs: per iteration X·Xᵀ (2m²n), A·A (2m³) and (bA + cA²)·X (2m²n), with
k = 5 (Jordan 2024) — three matmuls per iteration, on every rank that gathers the matrix.
"""

from __future__ import annotations

import math

from fivefold.models.presets import ModelConfig

# numerics/optim_states.py's block sizes and threshold (it imports torch; the planner does
# not): Dettmers et al. 2021 / torchao 256, Li et al. 2023 128, bitsandbytes' 4096.
OPTIM_BLOCK = {8: 256, 4: 128}
OPTIM_MIN_QUANTISED = 4096
MUON_EXCLUDE = ("embed_tokens", "lm_head", "norm", "router")  # config/optim.py's default
NS_STEPS = 5


def param_shapes(model: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """Every logical parameter of a fivefold Llama (models/llama.py, models/moe.py) by name
    and shape; stacked expert weights as one [E, out, in] tensor each."""
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    norm = [("norm.weight", (h,))] + ([("norm.bias", (h,))] if model.norm == "layernorm"
                                       else [])
    out = [("embed_tokens.weight", (model.vocab_size, h))]
    for i in range(model.num_layers):
        p = f"layers.{i}."
        out += [(p + "input_layernorm." + n.split(".", 1)[1], s) for n, s in norm]
        out += [(p + "post_attention_layernorm." + n.split(".", 1)[1], s) for n, s in norm]
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((f"{p}self_attn.{name}.weight", (rows, h)))
            if model.qkv_bias:
                out.append((f"{p}self_attn.{name}.bias", (rows,)))
        out.append((f"{p}self_attn.o_proj.weight", (h, q)))
        if model.mlp == "gelu":
            out.append((f"{p}self_attn.o_proj.bias", (h,)))
        if model.qk_norm:
            size = (q, kv) if model.qk_norm_whole else (model.dim_per_head,) * 2
            out += [(f"{p}self_attn.q_norm.weight", (size[0],)),
                    (f"{p}self_attn.k_norm.weight", (size[1],))]
        if model.is_moe_layer(i):
            e, f = model.num_experts, model.moe_intermediate_size
            out += [(f"{p}mlp.router.weight", (e, h)), (f"{p}mlp.experts.w_gate", (e, f, h)),
                    (f"{p}mlp.experts.w_up", (e, f, h)), (f"{p}mlp.experts.w_down", (e, h, f))]
            s = model.shared_expert_intermediate_size
            if s:
                out += [(f"{p}mlp.shared_expert.gate_proj.weight", (s, h)),
                        (f"{p}mlp.shared_expert.up_proj.weight", (s, h)),
                        (f"{p}mlp.shared_expert.down_proj.weight", (h, s))]
                if model.shared_expert_gate:
                    out.append((f"{p}mlp.shared_expert_gate.weight", (1, h)))
        elif model.mlp == "gelu":
            f = model.intermediate_size
            out += [(f"{p}mlp.up_proj.weight", (f, h)), (f"{p}mlp.up_proj.bias", (f,)),
                    (f"{p}mlp.down_proj.weight", (h, f)), (f"{p}mlp.down_proj.bias", (h,))]
        else:
            f = model.intermediate_size
            out += [(f"{p}mlp.gate_proj.weight", (f, h)), (f"{p}mlp.up_proj.weight", (f, h)),
                    (f"{p}mlp.down_proj.weight", (h, f))]
    out += norm
    if not model.tie_embeddings:
        out.append(("lm_head.weight", (model.vocab_size, h)))
    return out


def exclude_parts(exclude: str | tuple[str, ...] = MUON_EXCLUDE) -> tuple[str, ...]:
    """optim.muon_exclude's comma-separated name parts (or the parts themselves)."""
    if isinstance(exclude, str):
        return tuple(p.strip() for p in exclude.split(",") if p.strip())
    return tuple(exclude)


def muon_takes(name: str, shape: tuple[int, ...], exclude=MUON_EXCLUDE) -> bool:
    return len(shape) in (2, 3) and not any(part in name for part in exclude_parts(exclude))


def tensor_state_bytes(name: str, shape: tuple[int, ...], optimizer: str,
                       exclude=MUON_EXCLUDE, factored: bool = True) -> float:
    n = math.prod(shape)
    if optimizer in ("adamw8bit", "adamw4bit"):
        bits = 8 if optimizer == "adamw8bit" else 4
        block = OPTIM_BLOCK[bits]
        if n < OPTIM_MIN_QUANTISED or n % block:
            return 8.0 * n
        return 2 * (n * bits / 8 + 4 * n / block)
    if optimizer == "adafactor":
        if len(shape) < 2 or not factored:
            return 4.0 * n
        lead = math.prod(shape[:-2])
        return 4.0 * lead * (shape[-2] + shape[-1])
    if optimizer == "muon":
        return 4.0 * n if muon_takes(name, shape, exclude) else 8.0 * n
    if optimizer == "sgd":
        return 4.0 * n
    return 8.0 * n


def optimizer_state_bytes(model: ModelConfig, optimizer: str, exclude=MUON_EXCLUDE,
                          factored: bool = True) -> float:
    """Bytes of the optimizer's states for the whole model (one replica, no sharding);
    `exclude` and `factored`: optim.muon_exclude and optim.adafactor_factored."""
    return sum(tensor_state_bytes(n, s, optimizer, exclude, factored)
               for n, s in param_shapes(model))


def state_bytes_per_param(model: ModelConfig, optimizer: str, exclude=MUON_EXCLUDE,
                          factored: bool = True) -> float:
    """The model's state bytes per parameter: what `bytes_per_param` multiplies."""
    shapes = param_shapes(model)
    total = sum(math.prod(s) for _, s in shapes)
    return optimizer_state_bytes(model, optimizer, exclude, factored) / max(total, 1)


def newton_schulz_flops(model: ModelConfig, steps: int = NS_STEPS,
                        exclude=MUON_EXCLUDE) -> float:
    """FLOPs of one Muon step's orthogonalisations over the whole model (see the docstring)."""
    total = 0.0
    for name, shape in param_shapes(model):
        if not muon_takes(name, shape, exclude):
            continue
        count = shape[0] if len(shape) == 3 else 1
        m, n = sorted(shape[-2:])
        total += count * steps * (4 * m * m * n + 2 * m ** 3)
    return total


def gathered_bytes(work, layout, rank: int = 0) -> float:
    """The most a rank holds gathered at once during Muon's or Adafactor's step, in bytes.

    The engine (parallel/zero_rules.py ZeroAssembler, train/optim.py TensorParallelAssembler)
    assembles one whole tensor at a time in fp32 and frees it before the next: the Muon
    update of each hidden matrix, Adafactor's gradient of every tensor (and, with the
    relative step, its weight, before). A tensor is gathered when tensor parallelism slices
    it (its logical size) or when ZeRO shards it over more than one rank (its local size:
    experts over ep hold E/ep of the stack); otherwise the rule reads the piece itself.
    Every rank of the ZeRO group gathers every wanted tensor of its pipeline stage. Before
    tensors were gathered one at a time this was the whole model, P·4 bytes."""
    from fivefold.plan.placement import holds_embedding, holds_head, rank_layers

    if work.optimizer not in ("muon", "adafactor"):
        return 0.0
    model = work.model
    shards = layout.dp * layout.cp if layout.zero >= 1 else 1
    expert_shards = max(shards // layout.ep, 1) if layout.zero >= 1 else 1
    layers = {f"layers.{i}." for i in rank_layers(model, layout, rank)}
    largest = 0
    for name, shape in param_shapes(model):
        if name.startswith("layers."):
            if name[:name.index(".", 7) + 1] not in layers:
                continue
        elif name == "embed_tokens.weight":
            if not holds_embedding(layout, rank) and not (
                    model.tie_embeddings and holds_head(layout, rank)):
                continue
        elif not holds_head(layout, rank):  # lm_head, the final norm
            continue
        if work.optimizer == "muon" and not muon_takes(name, shape, work.muon_exclude):
            continue
        n = math.prod(shape)
        if len(shape) == 3:  # stacked experts: E/ep of them, replicated over tp
            gathered = expert_shards > 1
            n //= layout.ep
        else:  # vocab-, column- or row-parallel under tp (norms and routers: replicated)
            sliced = layout.tp > 1 and len(shape) == 2 and "router" not in name
            gathered = sliced or shards > 1
        if gathered:
            largest = max(largest, n)
    return 4.0 * largest

