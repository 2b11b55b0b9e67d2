"""Activation recomputation, as a transformation of the model.

    none       every block keeps what autograd saves
    selective  the attention core (softmax(QK^T)V) is recomputed in backward: it holds the
               O(s^2) or softmax-sized tensors for little compute (Korthikanti et al. 2022, §4)
    full       only each block's input is kept; the whole block runs again in backward

The wrapped module keeps its parameter names: only its `forward` is replaced.

    auto       a policy per layer, chosen under `train.memory_budget_gib` by
               plan/recompute_plan.py: none, selective, or the whole block checkpointed while
               the outputs of some of its operators are kept (`LayerPolicy.kept`: q, k, v,
               core, o, gate, up, down), through torch's selective activation checkpointing
               (`create_selective_checkpoint_contexts`, as torchtitan's per-op policy). An
               operator is known by the module that runs it: hooks on the block's
               projections and attention core name the operator running now, and the policy
               keeps the output of a matrix product or attention kernel run under a kept
               name; everything else (norms, RoPE, SiLU, products, adds) is recomputed.

A recomputed region that communicates (expert parallelism's all-to-alls) should not send
again what it already received: each checkpointed call carries a `ReplayTape`. In the first
forward a communicating layer pushes what it received onto the tape; when backward runs the
region again, the layer pops it instead of communicating (parallel/expert.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re

import torch
import torch.fx.traceback as fx_traceback
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from fivefold.models import moe
from fivefold.models.llama import AttentionCore, Block
from fivefold.numerics import fp8_ops  # noqa: F401 (registers the FP8 GEMM ops)
from fivefold.numerics.kernel_support import compiling
from fivefold.parallel import peak
from fivefold.parallel.memory import note_kept

MODES = ("none", "selective", "full", "auto")


class ReplayTape:
    """What a checkpointed region's communication received in its first forward, in order."""

    def __init__(self):
        self.items: list = []
        self.replaying = False
        self.position = 0

    def push(self, item) -> None:
        self.items.append(item)

    def pop(self):
        item = self.items[self.position]
        self.position += 1
        return item


_TAPE: contextvars.ContextVar[ReplayTape | None] = contextvars.ContextVar(
    "fivefold_replay_tape", default=None)


def replay_tape() -> ReplayTape | None:
    """The tape of the checkpointed region running now (None outside recomputation)."""
    return _TAPE.get()


def _checkpointed(forward, context_fn=None, traceable=True):
    """`forward` checkpointed: its inputs kept, its insides recomputed in backward.
    `traceable`: False for a region that must stay eager under train.compile
    (`compile_inside`, `_policy_traceable`).

    Traced by torch.compile (selective recomputation inside a compiled block): the bare
    checkpoint, which dynamo turns into a region of the block's graph that the partitioner
    recomputes in the backward graph (`tag_activation_checkpoint`). No replay tape there:
    setting it, a `ContextVar`, broke the graph (torch 2.13: 5 graphs, 6 breaks over 3 steps
    of 2 blocks); the attention core it wraps does not communicate, so nothing would read
    it. No `note_kept` or peak tracking either: the compiled block saves the region's inputs
    itself, so the saved-tensor hooks of both meters count them, and its recomputation runs
    inside the compiled backward, out of their sight. Each region also keeps the CPU
    generator's state (5,056 bytes), as eager's checkpoint does (`preserve_rng_state`);
    compiled, the partitioner saves it for backward since torch tags the SDPA kernels random
    (their dropout), so the meters see it. A per-operator policy (`context_fn`, a
    `functools.partial`, as dynamo requires) is then applied by the partitioner to the
    traced aten ops, which it finds by the module stack the trace records (`_keep_policy`):
    the outputs it keeps are saved by the compiled block, the rest recomputed."""
    inner = [forward]  # compile_inside swaps in the compiled forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        forward = inner[0]
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        if traceable and compiling():  # traced inside a compiled block
            policy = {} if context_fn is None else {"context_fn": context_fn}
            return checkpoint(forward, *args, use_reentrant=False, **policy, **kwargs)
        kept = [a for a in args if isinstance(a, torch.Tensor)]
        note_kept(*kept)
        if peak.active():  # alive while the checkpoint keeps them, i.e. until its backward
            for t in kept:
                peak.track(t)
        tape = ReplayTape()

        def taped(*a, **kw):  # first call: record; the recomputation in backward: replay
            token = _TAPE.set(tape)
            try:
                with peak.recomputing() if tape.replaying else contextlib.nullcontext():
                    return forward(*a, **kw)
            finally:
                _TAPE.reset(token)
                tape.replaying, tape.position = True, 0

        if context_fn is None:
            return checkpoint(taped, *args, use_reentrant=False, **kwargs)
        made = []

        def contexts():
            made.append(context_fn())
            return made[-1]

        out = checkpoint(taped, *args, use_reentrant=False, context_fn=contexts, **kwargs)
        cached = _cached_outputs(made[0][0].storage)
        note_kept(*cached)
        if peak.active():  # weakly: alive exactly as long as the checkpoint's cache keeps them
            for t in cached:
                peak.track(t)
        return out

    if context_fn is None:
        run.checkpointed_forward = inner
    run.traceable = traceable
    return run


def compile_inside(module: nn.Module) -> bool:
    """train.compile for a module whose whole forward is checkpointed (full recomputation):
    compile the forward the checkpoint runs, not the module's call, and return True (False:
    nothing done, compile the module as usual). The checkpoint wrapper stays eager: it sets
    the replay tape, a `ContextVar`, which dynamo cannot trace (torch 2.13: a graph break on
    `ContextVar.get`/`set` that left the whole block eager), and feeds the memory meter.
    Recomputation in backward runs the same compiled forward again. Per-operator selective
    checkpointing (its policy picks aten ops, which a compiled forward would not dispatch
    one by one) is traced into the module's graph instead (`_checkpointed`), unless it
    cannot be (`_policy_traceable`): then the module stays eager (True)."""
    forward = module.__dict__.get("forward")
    inner = getattr(forward, "checkpointed_forward", None)
    if inner is None:
        return getattr(forward, "traceable", True) is False
    inner[0] = torch.compile(inner[0])
    return True


def _policy_traceable(block: nn.Module) -> bool:
    """Whether a per-operator policy over `block` can be traced into its compiled graph. Not
    when a layer reads the replay tape (parallel/expert.py's dispatcher), nor over FP8
    linears: torch 2.13 failed tracing their autograd function inside the policy's
    checkpoint (InternalTorchDynamoError, "Argument ... of Node 'output' does not belong to
    this Graph"). Such a block stays eager under train.compile."""
    return not any(getattr(getattr(m, "dispatcher", None), "replays_tape", False)
                   or getattr(m, "fp8_recipe", None) is not None for m in block.modules())


# --- per-operator selective checkpointing (auto) -------------------------------------------
OP_MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
              "core": "self_attn.core", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
              "up": "mlp.up_proj", "down": "mlp.down_proj"}
_aten = torch.ops.aten
# An FP8 linear's GEMM (lowp/linear.py) is one of fivefold's custom ops: kept as an mm is,
# else a kept projection's GEMM would run again under precision = fp8 (its casts do run
# again: the recomputed forward casts its input for the saved codes, and W, as the first).
# Blockwise's emulated K-slice kernel (a CPU's) is one op too: its output is kept, not
# each slice's fp32 partial.
KEEPABLE = {op for op in (
    _aten.mm.default, _aten.addmm.default, torch.ops.fivefold.fp8_scaled_mm.default,
    torch.ops.fivefold.fp8_blockwise_scaled_mm.default,
    torch.ops.fivefold.fp8_blockwise_emulated_mm.default,
    getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    getattr(_aten, "_scaled_dot_product_flash_attention", None),
    getattr(_aten, "_scaled_dot_product_efficient_attention", None),
    getattr(_aten, "_scaled_dot_product_cudnn_attention", None)) if op is not None}
KEEPABLE = {getattr(op, "default", op) for op in KEEPABLE}
_SCOPE: list[str] = []  # the named operator running now (its module's hooks push and pop)


def _cached_outputs(storage) -> list[torch.Tensor]:
    """The tensors a selective checkpoint's cache holds (its `_VersionWrapper`s' values)."""
    out, stack = [], [storage]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif isinstance(getattr(item, "val", None), torch.Tensor):
            out.append(item.val)
    return out


def _keep_policy(kept: frozenset):
    def policy(ctx, func, *args, **kwargs):
        if func in KEEPABLE and _operator_now() in kept:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


def _keep_contexts(kept: tuple[str, ...]):
    """The checkpoint's `context_fn` keeping the outputs of the `kept` operators. A partial
    of this with the names as constants: dynamo guards on them, so blocks of other policies
    compile graphs of their own (a partial holding the policy closure matched any block's
    graph: dynamo guards a closure by its code, and `_keep_policy`'s code is the same)."""
    return create_selective_checkpoint_contexts(_keep_policy(frozenset(kept)))


def _operator_now() -> str | None:
    """The named operator whose op runs now. Eager: what the module hooks pushed. Compiled,
    the policy runs while the partitioner's trace replays the block's graph node by node
    (torch's `tag_activation_checkpoint` under `fx_traceback.preserve_node_meta`): the
    node's `nn_module_stack` (dynamo's paths, e.g. "L['self'].self_attn.q_proj"), innermost
    last, names it."""
    if _SCOPE:
        return _SCOPE[-1]
    get_meta = getattr(fx_traceback, "get_current_meta", None)
    stack = (get_meta() or {}).get("nn_module_stack") if get_meta else None
    for path, _ in reversed(list((stack or {}).values())):
        path = "." + re.sub(r"\._modules\['([^']+)'\]", r".\1", path)  # either spelling
        for name, suffix in OP_MODULES.items():
            if path.endswith("." + suffix):
                return name
    return None


def _name_operators(block: nn.Module) -> None:
    for name, path in OP_MODULES.items():
        try:
            module = block.get_submodule(path)
        except AttributeError:
            continue  # a GeLU MLP has no gate
        module.register_forward_pre_hook(functools.partial(_enter, name))
        module.register_forward_hook(_leave)


def _enter(name: str, module, args) -> None:
    if not compiling():  # traced, the module stack names the operator (`_operator_now`)
        _SCOPE.append(name)


def _leave(module, args, output) -> None:
    if not compiling():
        _SCOPE.pop()


def apply_layer_policies(model: nn.Module, policies) -> nn.Module:
    """recompute = auto: `policies[i]` (a `kind` of none | selective | keep, and the `kept`
    operators) for the i-th block of `model`, in forward order."""
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    if len(blocks) != len(policies):
        raise ValueError(f"{len(policies)} recompute policies for {len(blocks)} blocks")
    for block, policy in zip(blocks, policies):
        if policy.kind == "selective":
            block.self_attn.core.forward = _checkpointed(block.self_attn.core.forward)
        elif policy.kind == "keep" and not policy.kept:
            block.forward = _checkpointed(block.forward)  # full
            moe.mark_recomputed(block)
        elif policy.kind == "keep":
            moe.mark_recomputed(block)
            _name_operators(block)
            kept = tuple(sorted(policy.kept))
            context = functools.partial(_keep_contexts, kept)
            # the AOT autograd cache keys a compiled region on this (it bypasses one without)
            context.cache_hash = "fivefold-keep:" + ",".join(kept)
            block.forward = _checkpointed(block.forward, context, _policy_traceable(block))
    return model


def apply_recompute(model: nn.Module, mode: str, policies=None) -> nn.Module:
    if mode not in MODES:
        raise ValueError(f"recompute mode '{mode}' is not one of {', '.join(MODES)}")
    if mode == "auto":
        return apply_layer_policies(model, policies or [])
    target = {"selective": AttentionCore, "full": Block}.get(mode)
    if target is None:
        return model
    for module in model.modules():
        if isinstance(module, target):
            module.forward = _checkpointed(module.forward)
            moe.mark_recomputed(module)
    return model
