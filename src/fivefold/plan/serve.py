"""`fivefold plan --serve`: what a GPU holds and how fast it decodes when serving a model.

    fivefold plan --serve --model llama-3.1-8b --gpu h100-sxm --context 2048 --output 256
    fivefold plan --serve --model llama-3.2-1b --weights int4 --kv-cache-gib 10 --batch 64
    fivefold plan --serve --model llama-3.1-70b --gpu h100-sxm --tp 4

KV cache. Each token keeps a key and a value per layer and kv head:
    kv bytes / token = 2 · layers · kv_heads · head_dim · bytes(kv dtype)
The cache is cut into blocks of `block_size` tokens (PagedAttention, Kwon et al. 2023); a
budget holds floor(budget / (block_size · kv bytes/token)) blocks, a sequence of c tokens
needs ceil(c / block_size) of them, so floor(blocks / that) sequences of context + output
tokens run at once. The serving engine (serve/engine.py) sizes its pool by the same
arithmetic from the tensors it allocates; tests/test_serve_plan.py checks that its block
count, its pool's bytes and the number of sequences it runs without preemption equal these.

The budget, unless --kv-cache-gib gives it: `gpu_memory_utilization` (0.9, vLLM's default)
of what is left of the GPU after the weights and the CUDA context (the planner's
`context_gib` assumption), as the engine takes 0.9 of the memory free after loading.

Decode roofline. A decode step reads every weight once (for a mixture of experts, only the
experts some token of the batch is routed to: E · (1 − (1 − k/E)^batch) per layer in
expectation, for uniform routing) and every live sequence's K/V once, and does little
arithmetic per byte, so HBM bandwidth bounds it (Williams et al. 2009, "Roofline"; the
memory-bound decode argument of Pope et al. 2022, "Efficiently Scaling Transformer
Inference"):
    tokens/s ≤ batch · HBM bandwidth / (weight bytes + batch · mean context · kv bytes/token)
with the mean context of a request = prompt + output / 2.

Weight bytes per parameter: fp32 4, bf16/fp16 2, fp8/int8 1 (one scale per row or block:
negligible), int4 0.5 + a 16-bit scale and zero per group of 128 (AWQ's and GPTQ's layout:
0.53125), nf4 4.127 bits (QLoRA, Dettmers et al. 2023: 64-weight blocks, double-quantised
absmax constants).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from fivefold.errors import ArgumentParser, ConfigError
from fivefold.models.presets import ModelConfig
from fivefold.plan.hardware import CATALOG, GIB, get_hardware, parse_overrides

WEIGHT_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0,
                "int4": 0.5 + 4 / 128, "nf4": 4.127 / 8}
KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}


def kv_heads_per_rank(model: ModelConfig, tp: int = 1) -> int:
    """The kv heads one tensor-parallel rank holds: its share, or one replicated head when
    there are fewer heads than ranks (vLLM's ModelConfig.get_num_kv_heads)."""
    return max(model.num_kv_heads // tp, 1)


def pp_stage_bounds(model: ModelConfig, pp: int) -> list[tuple[int, int]]:
    """(first, end) layers of each of pp pipeline stages (fivefold serve --pp, serve/
    pp_worker.py): consecutive runs, none empty, that minimise the largest stage's weights
    read a decode step (each layer's active parameters; the last stage also the head,
    vocab · hidden, which on a small model outweighs several layers). Ties: the earlier
    split. Exact by dynamic programming over the split points."""
    n = model.num_layers
    if not 1 <= pp <= n:
        raise ConfigError(f"--pp {pp} must lie in 1..{n} (the model's layers)")
    cost = [model.layer_params(i, active=True) for i in range(n)]
    prefix = [0]
    for c in cost:
        prefix.append(prefix[-1] + c)
    head = model.vocab_size * model.hidden_size
    inf = float("inf")
    # best[s][e]: the least largest cost of layers 0..e-1 in s stages (the last not yet
    # carrying the head); cut[s][e]: where its last stage starts
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for s in range(1, pp + 1):
        for e in range(s, n + 1):
            extra = head if (s == pp and e == n) else 0
            for f in range(s - 1, e):
                value = max(best[s - 1][f], prefix[e] - prefix[f] + extra)
                if value < best[s][e]:
                    best[s][e], cut[s][e] = value, f
    bounds, end = [], n
    for s in range(pp, 0, -1):
        first = cut[s][end]
        bounds.append((first, end))
        end = first
    return bounds[::-1]


def layers_per_rank(model: ModelConfig, pp: int = 1) -> int:
    """The layers of the largest of pp pipeline stages, whose pool sizes every stage's."""
    return max(end - first for first, end in pp_stage_bounds(model, pp))


def kv_bytes_per_token(model: ModelConfig, kv_dtype: str = "bf16", tp: int = 1,
                       pp: int = 1) -> int:
    """2 · layers · kv_heads · head_dim · bytes, on one of tp ranks (of the largest of pp
    stages)."""
    return (2 * layers_per_rank(model, pp) * kv_heads_per_rank(model, tp) * model.dim_per_head
            * KV_BYTES[kv_dtype])


def num_blocks(budget_bytes: float, model: ModelConfig, block_size: int,
               kv_dtype: str = "bf16", tp: int = 1, pp: int = 1) -> int:
    """Blocks a per-rank budget holds; every rank of tp (and pp) holds the same block ids."""
    return int(budget_bytes // (block_size * kv_bytes_per_token(model, kv_dtype, tp, pp)))


def blocks_per_sequence(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def weight_bytes_read(model: ModelConfig, weights: str, batch: int) -> float:
    """Bytes of weights one decode step of `batch` tokens reads."""
    c = model.param_counts()
    params = c["layers"] + c["final_norm"] + (c["embedding"] if c["head"] == 0 else c["head"])
    if model.num_experts:
        e, k = model.num_experts, model.experts_top_k
        touched = e * (1 - (1 - k / e) ** batch)
        routed = model.moe_params()["routed"]
        params -= model.num_moe_layers * routed * (1 - touched / e)
    return params * WEIGHT_BYTES[weights]


@dataclass(frozen=True)
class ServePlan:
    model: str
    gpu: str
    weights: str
    kv_dtype: str
    block_size: int
    context: int
    output: int
    weight_bytes: float
    kv_budget_bytes: float
    kv_bytes_per_token: int
    num_blocks: int
    blocks_per_sequence: int
    max_concurrent_sequences: int
    batch: int
    bytes_read_per_step: float
    roofline_tokens_per_s: float
    tp: int = 1
    pp: int = 1

    def _layout(self) -> str:
        if self.tp == 1 and self.pp == 1:
            return f"one {self.gpu}"
        gpus = f"{self.tp * self.pp} x {self.gpu}, "
        if self.pp == 1:
            return gpus + "tensor parallel (figures per GPU)"
        if self.tp == 1:
            return gpus + f"{self.pp} pipeline stages (figures for the largest stage's GPU)"
        return gpus + (f"{self.pp} pipeline stages of {self.tp} tensor-parallel GPUs "
                       f"(figures per GPU of the largest stage)")

    def describe(self) -> str:
        return "\n".join([
            f"serving {self.model} on {self._layout()}: weights {self.weights} "
            f"({self.weight_bytes / GIB:.2f} GiB), KV cache {self.kv_dtype}",
            f"KV bytes per token: {self.kv_bytes_per_token:,} (2 · layers · kv_heads · "
            f"head_dim · bytes)",
            f"KV budget: {self.kv_budget_bytes / GIB:.2f} GiB = {self.num_blocks:,} blocks of "
            f"{self.block_size} tokens ({self.num_blocks * self.block_size:,} tokens)",
            f"a request of {self.context} + {self.output} tokens takes "
            f"{self.blocks_per_sequence} blocks: {self.max_concurrent_sequences:,} run at once",
            f"decode roofline at batch {self.batch}: {self.roofline_tokens_per_s:,.0f} tokens/s "
            f"({self.bytes_read_per_step / 2**20:,.1f} MiB read per step)",
        ])


def plan_serving(model: ModelConfig, hbm_bytes_per_s: float, memory_bytes: float,
                 context_bytes: float, gpu: str = "gpu", weights: str = "bf16",
                 kv_dtype: str = "bf16", context: int = 2048, output: int = 256,
                 block_size: int = 16, kv_budget_bytes: float | None = None,
                 utilization: float = 0.9, batch: int | None = None,
                 tp: int = 1, pp: int = 1) -> ServePlan:
    """One GPU, or each of `tp` tensor-parallel GPUs: 1/tp of the weights (the split
    linears, embedding and head; norms are replicated but negligible), max(1, kv_heads/tp)
    kv heads per block, the same number of blocks on every rank."""
    if weights not in WEIGHT_BYTES:
        raise ConfigError(f"--weights {weights}: choose one of {', '.join(WEIGHT_BYTES)}")
    if kv_dtype not in KV_BYTES:
        raise ConfigError(f"--kv-cache-dtype {kv_dtype}: choose one of {', '.join(KV_BYTES)}")
    if context < 1 or output < 1 or block_size < 1:
        raise ConfigError("--context, --output and --block-size must be >= 1")
    if not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization {utilization} must lie in (0, 1]")
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp {tp} and --pp {pp} must be >= 1")
    if pp > model.num_layers:
        raise ConfigError(f"--pp {pp} is more stages than the model's {model.num_layers} "
                          f"layers; use --pp {model.num_layers} or fewer")
    stage = layers_per_rank(model, pp) / model.num_layers  # the largest stage's share
    weight_bytes = model.num_params() * WEIGHT_BYTES[weights] / tp * stage
    if kv_budget_bytes is None:
        kv_budget_bytes = utilization * (memory_bytes - context_bytes - weight_bytes)
        if kv_budget_bytes <= 0:
            raise ConfigError(f"the weights ({weight_bytes / GIB:.1f} GiB) leave no memory "
                              f"for a KV cache on {gpu}; use smaller --weights or a larger GPU")
    per_token = kv_bytes_per_token(model, kv_dtype, tp, pp)
    blocks = num_blocks(kv_budget_bytes, model, block_size, kv_dtype, tp, pp)
    per_seq = blocks_per_sequence(context + output, block_size)
    concurrent = blocks // per_seq
    batch = batch or max(concurrent, 1)
    read = (weight_bytes_read(model, weights, batch) / tp * stage
            + batch * (context + output / 2) * per_token)
    return ServePlan(model.name, gpu, weights, kv_dtype, block_size, context, output,
                     weight_bytes, kv_budget_bytes, per_token, blocks, per_seq, concurrent,
                     batch, read, batch * hbm_bytes_per_s / read, tp, pp)


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fivefold plan --serve",
                       description="KV blocks, concurrent sequences and the decode roofline "
                                   "of serving a model on one GPU.")
    p.add_argument("--model", required=True, help="a preset, a config.json (or its "
                   "directory), or a training .toml")
    p.add_argument("--gpu", default="h100-sxm", help=f"one of {', '.join(CATALOG)}")
    p.add_argument("--hw", action="append", default=[], metavar="KEY=VALUE",
                   help="override a hardware figure, e.g. memory_gib=94 hbm_tbps=4.8")
    p.add_argument("--weights", default="bf16", help=", ".join(WEIGHT_BYTES))
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default="bf16",
                   help="what the KV cache stores, as `fivefold serve --kv-cache-dtype` "
                        f"(--kv-dtype: the older name): {', '.join(KV_BYTES)}")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=256, help="output tokens per request")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV block, as serve's --block-size (default 16)")
    p.add_argument("--kv-cache-gib", type=float, help="the KV budget (default: 0.9 of what "
                   "the weights and the CUDA context leave)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU left after the weights and context that the KV "
                        "cache takes, unless --kv-cache-gib gives it (default 0.9)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs (fivefold serve "
                   "--tp): each holds 1/tp of the weights and its kv heads' share of blocks")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (fivefold serve --pp): "
                   "each holds its layers and their share of every block")
    p.add_argument("--batch", type=int, help="decode batch for the roofline (default: the "
                   "concurrent sequences the budget holds)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="every number as JSON, to PATH or (no PATH) stdout")
    return p


def run(argv: list[str]) -> int:
    from fivefold.plan.inputs import resolve_model

    args = build_parser().parse_args([a for a in argv if a != "--serve"])
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise ConfigError(f"--kv-cache-gib {args.kv_cache_gib} must be > 0")
    if args.batch is not None and args.batch < 1:
        raise ConfigError(f"--batch {args.batch} must be >= 1")
    hw, assume = get_hardware(args.gpu, parse_overrides(args.hw))
    model = resolve_model(args.model)
    plan = plan_serving(
        model, hw.hbm_tbps * 1e12, hw.memory_bytes, assume.context_gib * GIB, hw.name,
        args.weights, args.kv_dtype, args.context, args.output, args.block_size,
        None if args.kv_cache_gib is None else args.kv_cache_gib * GIB,
        args.gpu_memory_utilization, args.batch, args.tp, args.pp)
    if args.json:
        text = json.dumps(asdict(plan), indent=2)
        if args.json == "-":
            print(text)
            return 0
        Path(args.json).write_text(text + "\n")
    print(plan.describe())
    if plan.max_concurrent_sequences == 0:
        print(f"does not fit: one request needs {plan.blocks_per_sequence} blocks, the budget "
              f"holds {plan.num_blocks}")
        return 1
    return 0


def roofline_share(measured_tokens_per_s: float, plan: ServePlan) -> float:
    """The engine's measured decode throughput as a share of the roofline."""
    return measured_tokens_per_s / plan.roofline_tokens_per_s if plan.roofline_tokens_per_s \
        else math.nan
