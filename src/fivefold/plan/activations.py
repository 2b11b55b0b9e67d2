"""Activation memory: the bytes autograd saves for backward, per micro-batch, per rank.

The model is built term by term from the tensors a plain PyTorch Llama (RMSNorm, RoPE, GQA,
SwiGLU, scaled_dot_product_attention) saves, so that it can be compared one-to-one with
`torch.autograd.graph.saved_tensors_hooks`. With a GPT-3 configuration (GeLU MLP, LayerNorm,
math attention, dropout, 2-byte activations) the terms add up to Korthikanti et al. (2022)
eq. 1, sbh(34 + 5as/h), and its Table 2 variants; the norms' fp32 statistics are the only
extra (`norm_stats`, 4 or 8 bytes per token, which the paper leaves out).

Notation: T = tokens of the micro-batch on this rank = mbs·seq_len/cp, h = hidden size,
q = heads·head_dim, kv = this rank's kv heads·head_dim, f = MLP width, B = dtype bytes.
Sharding: "tp" tensors live in the tensor-parallel region (divided by tp); "seq" tensors live
in the sequence region (divided by tp only with sequence parallelism, else replicated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivefold.models.loss_chunks import LOGITS_CHUNK_ELEMENTS, chunk_rows  # the engine's rule
from fivefold.models.presets import ModelConfig
from fivefold.plan.fp8 import apply_fp8_terms

INDEX_BYTES = 8  # int64 token ids and targets
STAT_BYTES = 4  # fp32 norm statistics and softmax log-sum-exp


@dataclass
class ActivationBytes:
    """Saved-for-backward bytes of one micro-batch on one rank."""

    layer_terms: dict[str, float]  # one transformer layer, by saved tensor
    layer: float  # sum of layer_terms
    outside_terms: dict[str, float] = field(default_factory=dict)  # embedding, head, loss
    loss_backward: float = 0.0  # transient during the loss backward (not saved), last stage
    # A materialised loss's transient is the peak itself (every activation is still alive
    # when it is made), not a cached block beside a later peak (allocator.allocator_waste).
    loss_transient_is_peak: bool = False

    @property
    def embedding(self) -> float:
        return self.outside_terms.get("embedding", 0.0)

    @property
    def final_norm(self) -> float:
        return self.outside_terms.get("final_norm", 0.0)

    @property
    def logits(self) -> float:
        return self.outside_terms.get("head_input", 0.0) + self.outside_terms.get("logits", 0.0)

    @property
    def loss(self) -> float:
        return self.outside_terms.get("loss", 0.0)

    @property
    def rope_tables(self) -> float:
        return self.outside_terms.get("rope_tables", 0.0)


def kv_heads_per_rank(model: ModelConfig, tp: int) -> int:
    """GQA under TP: kv heads are split when tp ≤ kv heads, else each rank keeps one copy."""
    return max(model.num_kv_heads // tp, 1)


def activation_bytes_per_microbatch(
    model: ModelConfig,
    mbs: int,
    seq_len: int,
    *,
    tp: int = 1,
    sp: bool = False,
    cp: int = 1,
    recompute: str = "none",
    dtype_bytes: int = 2,
    flash: bool = True,
    dropout: bool = False,
    sp_saves_gathered: bool = True,
    cp_comm: str = "ring",
    ep: int = 1,
    chunked_loss: bool = True,
    fp8_recipe: str = "",
    fp8_linears=None,
    loss_parallel: bool = False,
    softmax_loss: bool = False,
    loss_device_memory: float = 0.0,
) -> ActivationBytes:
    """Bytes one micro-batch leaves saved for backward on one rank, per layer and outside.

    Under SP, column-parallel layers keep their all-gathered input (full sequence, T·h·B)
    for the weight gradient with `sp_saves_gathered=True` (`parallel.sp_saved_input = full`).
    Megatron-LM, nanotron and the engine's `sp_saved_input = shard` keep only the sequence
    shard and gather it again in backward (Korthikanti §4.2.2, and the paper's Table 2):
    `sp_saves_gathered=False`. The output head's input stays gathered either way: the
    engine's head is a plain F.linear on the region's gathered input.

    Per layer, with recompute = "none" (each term is one saved tensor):
      attention (seq region): norm input T·h·B; norm statistics T·4 (RMSNorm rstd; LayerNorm
        mean and rstd, 8); QKV-projection input T·h·B (wq, wk, wv share it).
      attention (tp region): q T·q·B; k, v T·kv·B each (RoPE by cos/sin saves no batch
        tensor). Flash attention saves its output T·q·B and log-sum-exp T·heads/hd·4, i.e.
        O(s) (Dao 2022). Math attention saves q, k and v expanded to all heads (3·T·q·B) and
        the softmax output heads·b·s²/cp·B, O(s²) (the s² term of Korthikanti eq. 1). Then the
        output-projection input T·q·B (a reshaped copy of the attention output; with a saved
        flash core it is a view of the core's output, written in (b, s, heads, d) order, so
        it adds nothing).
      dropout (Korthikanti): attention-probability mask (1 byte) and dropout output (B) on the
        s² scores, and a 1-byte mask after each of the two projections back to h.
      MLP (seq region): norm input, statistics, MLP input as above.
      MLP (tp region): SwiGLU saves gate input, SiLU output, up output and the product
        (4·T·f·B: silu(g) and u are multiplied, the product is w2's input). GeLU (GPT) saves the
        GeLU input and fc2 input (2·T·f·B; 16·sbh for f = 4h, as in Korthikanti).
      MoE layers (replicated over tp) save `moe_layer_terms` instead of the MLP's; with dense
        and MoE layers mixed, the per-layer figure is their average over the layers.
    recompute = "selective": the attention core (SDPA, or ring attention under CP) runs again
      in backward; its inputs q, k, v (unexpanded) stay saved, its output/lse or scores do not
      (Korthikanti §5, "selective activation recomputation").
    recompute = "full": only each layer's input T·h·B is kept (seq region; Korthikanti's 2sbh).
    `chunked_loss = False` plans a materialised loss instead (the head's logits cast to fp32,
    log-softmax keeping T·V/tp·4; other engines' default); `loss_parallel` (with tp > 1) its
    DTensor vocabulary-parallel form, whose backward holds more fp32 buffers (`_finish`);
    `softmax_loss` nanotron's `_ShardedCrossEntropy`, which saves the softmax (`_finish`).
    recompute = "op": torchtitan's per-operator selective checkpointing (`op_sac_kept`): the
      layer's input and the outputs of the attention kernel and of the odd-numbered matmuls
      (q, v, gate and down in a Llama block), each as large as the operator's output
      (`op_output_bytes`). A planner-only policy, for planning torchtitan's runs; the engine's
      per-operator choices are train.recompute = auto (plan/recompute_plan.py).

    Context parallelism (cp > 1; parallel/context/): the ring core is flash-style whatever
    `flash` says, saving q, its packed K/V, output and LSE. Selective recomputation leaves it
    alone (re-running it would repeat its cp − 1 K/V transfers to free only the output and
    LSE), so the attention core term stays. `cp_comm = "allgather"` keeps the gathered K/V of
    all cp ranks for backward: (cp − 1)·2·T·kv·B more than the ring.

    `fp8_recipe` (precision = fp8, dense layers, recompute = none): the FP8 linears' saved
    inputs (plan/fp8.py `apply_fp8_terms`), of the layer's `fp8_linears` (those
    train.fp8_keep_out leaves in FP8, plan/fp8_linears.py; None: every linear).

    Outside the layers: rope_tables = the cos and sin tables every layer of a stage shares,
    2·s·d·B (kept by each layer's rotation, and by a fully recomputed layer as its inputs);
    embedding = token ids T·8 (+ a 1-byte dropout mask T·h); final_norm =
    its input and statistics. The head and the loss run together in chunks of tokens
    (models/loss.py), which finish their gradients in forward: head_input = the gradient of
    the head's input, T·h·B (all T tokens, also under SP); logits = the gradient of the
    head's weight, V/tp·h·B (vocab-parallel under TP) — where an unchunked loss would keep
    T·V/tp·4 fp32 log-softmax (Korthikanti's 4sbV/t); loss = 0 (nothing else is kept).
    `loss_backward` is the larger transient of the loss: one chunk's fp32 logits, their
    exponentials in place and the compute-dtype cast, rows·V/tp·(4 + B) (4 in fp32, where
    there is no cast), with the head's weight gradient accumulating in fp32 ((4 − B)·V/tp·h
    over the saved one), or in backward the two gradients scaled by the loss's gradient,
    T·h·B + V/tp·h·B.
    """
    if recompute not in ("none", "selective", "full", "op"):
        raise ValueError(f"recompute must be none, selective, full or op, not {recompute!r}")
    h, d, B = model.hidden_size, model.dim_per_head, dtype_bytes
    tokens = mbs * seq_len / cp
    seq_div = tp if sp else 1
    q = model.num_heads * d / tp
    kv = kv_heads_per_rank(model, tp) * d
    heads = model.num_heads / tp
    stats = STAT_BYTES * (2 if model.norm == "layernorm" else 1)
    seq_tensor = tokens * h * B / seq_div  # one [T, h] tensor in the sequence region
    # what a column-parallel linear keeps of its input (qkv, MLP and head inputs)
    col_input = tokens * h * B if (sp and sp_saves_gathered) else seq_tensor

    terms: dict[str, float] = {}
    if recompute == "op":  # the block checkpointed, keeping the outputs of some operators
        if model.num_experts:
            raise ValueError("recompute = op models dense layers only")
        outputs = op_output_bytes(model, tokens, tp=tp, dtype_bytes=B)
        terms["layer_input"] = seq_tensor
        terms.update({f"kept_{op}": outputs[op] for op in op_sac_kept(model)})
        return _finish(model, terms, tokens, tp, seq_div, B, dropout, col_input, seq_len / cp,
                   chunked_loss, loss_parallel, softmax_loss, loss_device_memory)
    if recompute == "full":
        terms["layer_input"] = seq_tensor
        if ep > 1 and model.num_experts:
            # A recomputed MoE layer replays its all-to-alls (parallel/expert.py): the rows it
            # received and the rows combined back, T·k·h each (on average over the ep group),
            # stay from the forward to the layer's backward. Averaged over the layers.
            replay = 2 * tokens * model.experts_top_k * h * B
            terms["ep_replay"] = replay * model.num_moe_layers / model.num_layers
        return _finish(model, terms, tokens, tp, seq_div, B, dropout, col_input, seq_len / cp,
                   chunked_loss, loss_parallel, softmax_loss, loss_device_memory)

    terms["attn_norm_input"] = seq_tensor
    terms["norm_stats"] = 2 * tokens * stats / seq_div
    terms["qkv_input"] = col_input
    flash = flash or cp > 1
    if recompute == "selective" or flash:
        terms["q"] = tokens * q * B
        terms["k"] = tokens * kv * B
        terms["v"] = tokens * kv * B
    else:  # math attention saves k and v repeated to all query heads
        terms["q"] = terms["k"] = terms["v"] = tokens * q * B
    if cp > 1 and cp_comm == "allgather":
        terms["kv_gathered"] = (cp - 1) * 2 * tokens * kv * B
    if recompute == "none" or cp > 1:
        if flash:
            terms["attn_core"] = tokens * q * B + tokens * heads * STAT_BYTES
        else:
            # scores per rank: (s/cp) queries × s keys per head, for b sequences
            scores = mbs * heads * (seq_len / cp) * seq_len
            terms["attn_core"] = scores * B + (scores * (1 + B) if dropout else 0)
    if not (flash and cp == 1 and recompute == "none"):
        # The output-projection input. A saved flash core's output is the same storage: the
        # kernel writes it in (b, s, heads, d) order, so the transpose-reshape is a view.
        terms["attn_out"] = tokens * q * B
    terms["mlp_norm_input"] = seq_tensor
    terms["mlp_input"] = col_input
    if dropout:
        terms["dropout_masks"] = 2 * tokens * h / seq_div
    if model.mlp == "swiglu":
        terms["mlp_hidden"] = 4 * tokens * model.intermediate_size / tp * B
    else:
        terms["mlp_hidden"] = 2 * tokens * model.intermediate_size / tp * B
    if model.qk_norm:  # the normalised q and k's inputs and statistics
        rows = 2 if model.qk_norm_whole else heads + kv / d  # statistics per token
        terms["qk_norm"] = tokens * (q + kv) * B + tokens * rows * STAT_BYTES
    if model.num_experts:  # MoE layers replace the MLP: averaged over the layers
        n = model.num_moe_layers
        moe = sum(moe_layer_terms(model, tokens, B).values())
        terms["mlp_hidden"] = (n * moe + (model.num_layers - n) * terms["mlp_hidden"]) / (
            model.num_layers)
    if fp8_recipe and recompute == "none" and not model.num_experts:  # FP8 linears' inputs
        apply_fp8_terms(terms, recipe=fp8_recipe, tokens=tokens, h=h, q=q,
                        f=model.intermediate_size / tp, dtype_bytes=B,
                        swiglu=model.mlp == "swiglu", qkv_tokens=col_input / (h * B),
                        linears=fp8_linears)
    return _finish(model, terms, tokens, tp, seq_div, B, dropout, col_input, seq_len / cp,
                   chunked_loss, loss_parallel, softmax_loss, loss_device_memory)


# The per-operator model of a dense block, shared with train.recompute = auto
# (plan/recompute_plan.py): the operators whose outputs a selective checkpointing policy may
# keep, in the order a Llama block's forward runs them. `core` is the attention kernel (its
# output and log-sum-exp), the others are the projections (one matmul each).
BLOCK_OPS = ("q", "k", "v", "core", "o", "gate", "up", "down")


def op_output_bytes(model: ModelConfig, tokens: float, *, tp: int = 1,
                    dtype_bytes: int = 2) -> dict[str, float]:
    """Bytes of each operator's output for `tokens` tokens of one layer on one tp rank."""
    d, B = model.dim_per_head, dtype_bytes
    q = model.num_heads * d / tp
    kv = kv_heads_per_rank(model, tp) * d
    f = model.intermediate_size / tp
    out = {"q": tokens * q * B, "k": tokens * kv * B, "v": tokens * kv * B,
           "core": tokens * q * B + tokens * model.num_heads / tp * STAT_BYTES,
           "o": tokens * model.hidden_size * B, "up": tokens * f * B,
           "down": tokens * model.hidden_size * B}
    if model.mlp == "swiglu":
        out["gate"] = tokens * f * B
    return out


def op_sac_kept(model: ModelConfig) -> tuple[str, ...]:
    """The operators torchtitan's per-operator selective checkpointing keeps (its default
    `selective_ac_option = "op"`; torchtitan @9dec370, torchtitan/parallelisms/
    parallelize_llama.py, `_save_list` and `_custom_policy`): the outputs of the attention
    kernel and of every odd-numbered matmul of the block, counted in forward order; the
    even-numbered matmuls and every elementwise operator run again in backward. In a Llama
    block the matmuls run wq, wk, wv, wo, w1 (gate), w3 (up), w2 (down), so q, v, gate and
    down are kept; a GeLU block (fc1, fc2) keeps q, v and fc1 (`up`)."""
    matmuls = ["q", "k", "v", "o"] + (["gate", "up", "down"] if model.mlp == "swiglu"
                                      else ["up", "down"])
    return ("core", *matmuls[0::2])


def op_sac_recomputed_matmul_share(model: ModelConfig) -> float:
    """The share of a layer's projection FLOPs that per-operator checkpointing runs again
    (the matmuls it does not keep)."""
    h, d = model.hidden_size, model.dim_per_head
    q, kv, f = model.num_heads * d, model.num_kv_heads * d, model.intermediate_size
    flops = {"q": h * q, "k": h * kv, "v": h * kv, "o": q * h, "gate": h * f, "up": h * f,
             "down": f * h}
    if model.mlp != "swiglu":
        del flops["gate"]
    kept = op_sac_kept(model)
    return sum(v for k, v in flops.items() if k not in kept) / sum(flops.values())


def moe_layer_terms(model: ModelConfig, tokens: float, B: int) -> dict[str, float]:
    """What an MoE block (models/moe.py) saves for backward, replicated over tp: fp32 router
    scores, with a z-loss its logits and log-sum-exp, the chosen indices and
    weights, the dispatch and un-dispatch permutations, the dispatched tokens, the experts'
    SwiGLU (4 tensors of T·k·f_e), the expert outputs in fp32 for the combine, and the
    shared expert (SwiGLU, plus its gate's input and sigmoid); bf16 adds the fp32 copy of
    the router's input."""
    h, e, k = model.hidden_size, model.num_experts, model.experts_top_k
    fe, fs = model.moe_intermediate_size, model.shared_expert_intermediate_size
    out = {
        # scores (softmax/gather backward); the z-loss's logits and log-sum-exp
        "router": tokens * (e + (e + 1 if model.z_loss_coeff else 0)) * STAT_BYTES
        + tokens * k * (INDEX_BYTES + 2 * 4),
        "dispatch": 2 * tokens * k * INDEX_BYTES + tokens * k * h * B,
        "experts": 4 * tokens * k * fe * B + tokens * k * h * 4,
        "shared": 4 * tokens * fs * B,
    }
    if fs and model.shared_expert_gate:
        out["shared"] += tokens * h * B + tokens * B
    if B != 4:
        out["router"] += tokens * h * 4
    return out


def _finish(model, terms, tokens, tp, seq_div, B, dropout, col_input, seq: float,
            chunked_loss: bool = True, loss_parallel: bool = False,
            softmax_loss: bool = False, loss_device_memory: float = 0.0) -> ActivationBytes:
    h = model.hidden_size
    vocab_local = -(-model.vocab_size // tp)  # padded to tp pieces
    stats = STAT_BYTES * (2 if model.norm == "layernorm" else 1)
    outside = {
        "rope_tables": 2 * seq * model.dim_per_head * B,
        "embedding": tokens * INDEX_BYTES + (tokens * h / seq_div if dropout else 0),
        "final_norm": tokens * h * B / seq_div + tokens * stats / seq_div,
        "head_input": tokens * h * B,
        "logits": vocab_local * h * B,
        "loss": 0.0,
    }
    if loss_device_memory > 0 and tp == 1:
        # A GPU's fused loss (models/loss.py `_fused`): a chunk of compute-dtype logits sized
        # by the device's memory, their gradient written over them; the weight's gradient in
        # the compute dtype from one chunk, or accumulating in fp32 beside each chunk's part.
        rows = chunk_rows(int(tokens), vocab_local, loss_device_memory, B)
        multi = rows < tokens
        forward = rows * vocab_local * B + (4 * vocab_local * h + B * vocab_local * h
                                            if multi else 0)
    else:
        rows = min(tokens, max(1, LOGITS_CHUNK_ELEMENTS // vocab_local))
        # Forward, per chunk: fp32 logits, their cast to the compute dtype (none in fp32), and
        # the weight's gradient accumulating in fp32 (saved in the compute dtype: 4 − B more).
        # Backward: both saved gradients scaled by the loss's, beside the saved ones.
        cast = B if B < 4 else 0
        forward = rows * vocab_local * (4 + cast) + (4 - B) * vocab_local * h
    if not chunked_loss:
        # Materialised logits, cast to fp32 for the loss (torchtitan: F.cross_entropy(pred
        # .float(), ...), the compute-dtype logits deleted before backward): log-softmax keeps
        # its fp32 output T·V/tp·4; the head keeps its input. Forward holds the logits in
        # both dtypes beside it for a moment; backward, the incoming fp32 gradient and
        # log-softmax's, 2·T·V/tp·4. Under DTensor loss parallel (tp > 1) the backward of
        # nll_loss and log_softmax is one function (torch/distributed/tensor/parallel/loss.py
        # `_nll_loss_and_log_softmax_backward`, torch 2.13 l. 451-518, the same in its 2024
        # versions): `grad_input = zeros_like(x)`, then `(grad_input + exp(x)) * grad_output`,
        # so zeros, exp(x) and their sum (then the product, exp(x) freed) are alive beside the
        # saved log-softmax output x: 3·T·V/tp·4.
        logits = tokens * vocab_local
        outside["logits"] = logits * 4
        backward = max(logits * (B + 4), 2 * logits * 4)
        if loss_parallel and tp > 1:
            backward = 3 * logits * 4
        if softmax_loss:
            # nanotron's _ShardedCrossEntropy (parallel/tensor_parallel/functional.py
            # @2411b022) on the head's compute-dtype logits and their fp32 cast: it subtracts
            # the max into a new fp32 tensor, exponentiates and normalises it in place and
            # saves that softmax (T·V/tp·4). Forward holds both inputs beside it, (B + 4) more;
            # backward turns the softmax into the gradient in place and casts it back (B).
            backward = logits * (B + 4)
        return ActivationBytes(layer_terms=terms, layer=sum(terms.values()),
                               outside_terms=outside, loss_backward=backward,
                               loss_transient_is_peak=True)
    return ActivationBytes(
        layer_terms=terms,
        layer=sum(terms.values()),
        outside_terms=outside,
        loss_backward=max(forward, tokens * h * B + vocab_local * h * B),
    )


def recompute_working_set(model: ModelConfig, mbs: int, seq_len: int, *, tp: int = 1,
                          sp: bool = False, cp: int = 1, recompute: str = "none",
                          dtype_bytes: int = 2, flash: bool = True,
                          dropout: bool = False, sp_saves_gathered: bool = True,
                          cp_comm: str = "ring", ep: int = 1, **_) -> float:
    """Transient bytes while one layer is recomputed in backward: under full recompute a whole
    layer's activations come back for one micro-batch; under selective, its attention core
    (none under cp > 1, where selective recomputation leaves the ring core alone)."""
    kwargs = {"tp": tp, "sp": sp, "cp": cp, "dtype_bytes": dtype_bytes, "flash": flash,
              "dropout": dropout, "sp_saves_gathered": sp_saves_gathered, "cp_comm": cp_comm}
    if recompute == "full":  # the layer's input is already kept: it comes back as itself
        full = activation_bytes_per_microbatch(model, mbs, seq_len, recompute="none", **kwargs)
        return full.layer - full.layer_terms["attn_norm_input"]
    if recompute == "op":  # what autograd saves, less the input and the kept outputs
        full = activation_bytes_per_microbatch(model, mbs, seq_len, recompute="none", **kwargs)
        kept = activation_bytes_per_microbatch(model, mbs, seq_len, recompute="op", **kwargs)
        return max(0.0, full.layer - kept.layer)
    if recompute == "selective" and cp == 1:
        full = activation_bytes_per_microbatch(model, mbs, seq_len, recompute="none", **kwargs)
        return full.layer_terms.get("attn_core", 0.0)
    return 0.0


def kept_output_grad_bytes(model: ModelConfig, mbs: int, seq_len: int, tp: int = 1,
                           sp: bool = False, cp: int = 1, dtype_bytes: int = 2) -> dict[str, float]:
    """What a split backward (ZB-H1, DualPipeV) keeps of one micro-batch from its B to its W:
    the gradient of every weight use's output, which W multiplies with the use's saved
    input (Qi et al. 2023, §2: W needs the output gradient; parallel/pipeline/runtime.py).

    Per layer: the column-parallel outputs q, k, v, gate and up (tp region), the
    row-parallel outputs of o and down and the two norms' outputs (sequence region):
    T·(q + 2·kv + 2·f/tp)·B + 4·T·h·B/(tp if sp). Outside the layers: the embedding's output
    (first stage), the final norm's output and the logits T·V/tp·B (last stage).
    """
    h, B = model.hidden_size, dtype_bytes
    tokens = mbs * seq_len / cp
    seq_div = tp if sp else 1
    q = model.num_heads * model.dim_per_head / tp
    kv = kv_heads_per_rank(model, tp) * model.dim_per_head
    row = tokens * h * B / seq_div
    layer = tokens * B * (q + 2 * kv + 2 * model.intermediate_size / tp) + 4 * row
    vocab = -(-model.vocab_size // tp)  # padded to tp pieces
    return {"layer": layer, "embedding": row, "head": row + tokens * vocab * B}
