"""Tensor and sequence parallelism against the single-process model (the oracle).

Tolerances (fp32) from the error model of tests/tolerances.py at these sizes (BATCH·SEQ
tokens per step, 2 blocks of 3 GEMMs of length ≤ 64): losses LOSS_RTOL relative; gradient
norms, each gathered gradient and each parameter after the AdamW steps GRAD_RTOL relative in
the tensor's norm (||a - b|| / ||b||, since single entries near zero have no meaningful
relative error). AdamW's first steps move each entry by about lr·sign(grad) whatever the
gradient's size, so an entry whose gradient is near zero turns rounding noise into a
full-sized difference (at lr 1e-2 one such entry of up_proj put the tensor 1.8e-5 off): the
model's Adam gain covers it. One exception, stated: a key bias barely changes the attention
(softmax over keys ignores a constant and only RoPE's rotation keeps it from vanishing), so
its gradient is 1e-4 of its neighbours', mostly cancellation: a cancellation factor of ~1e4
on top of the model's. Its gradient is compared at GRAD_RTOL like every other tensor (where a
sharding bug would show), but not its parameters after AdamW: Adam turns each of its
rounding-sized gradient entries into an lr-sized step, so the result is set by the kernels'
rounding (3.3e-5 apart under AVX-512, 1.1e-4 under AVX2 on the same AMD EPYC), and no bound
both holds for every kernel and still means something.
One start of the ranks serves every case of a tp size.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from tolerances import loss_rtol, trained_rtol, within
from torch import nn

from fivefold.config import ConfigError, ParallelSection
from fivefold.models.init import build_meta, build_model, materialize
from fivefold.models.presets import preset
from fivefold.parallel import comm
from fivefold.parallel.mesh import ParallelDims
from fivefold.parallel.tensor import (
    apply_tensor_parallel,
    gather_full_state,
    load_tp_state,
    tp_grad_norm,
)

SEED, STEPS, BATCH, SEQ = 7, 3, 2, 16
LOSS_RTOL = loss_rtol(tokens=BATCH * SEQ, depth=3 * 2)
GRAD_RTOL = trained_rtol(tokens=BATCH * SEQ, depth=3 * 2)  # gradients of steps after the first
GPT = {"mlp": "gelu", "norm": "layernorm", "qkv_bias": True}
# (name, model overrides, sp). nano: 4 heads, 2 kv heads, ffn 64, vocab 64, 2 layers.
# sp = "shard": SP whose column linears keep only the sequence shard (parallel.sp_saved_input).
CASES = {
    2: [("nano", {}, False), ("nano", {}, True), ("nano", {}, "shard"),
        ("vocab257", {"vocab_size": 257}, True),
        ("vocab257-tied", {"vocab_size": 257, "tie_embeddings": True}, False)],
    4: [("kv2", {}, False), ("kv2", {}, True), ("kv2", {}, "shard"), ("gpt-bias", GPT, True),
        ("gpt-bias", GPT, "shard")],
}


def batch(cfg, step):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=gen)
    targets[0, :3] = -100  # ignored positions must stay out of the loss on every rank
    return tokens, targets


def train(model, cfg, grad_norm, gather_grads, steps=STEPS):
    """A few fp32 AdamW steps of the summed loss over the target tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses, norms, grads = [], [], None
    for step in range(steps):
        tokens, targets = batch(cfg, step)
        loss = model(tokens, targets) / (targets != -100).sum()
        loss.backward()
        losses.append(loss.item())
        norms.append(grad_norm(model).item())
        if step == 0:
            grads = gather_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, norms, grads


def reference(cfg):
    model = build_model(cfg, SEED)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses, norms, grads = train(
        model, cfg, lambda m: torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in m.parameters() if p.grad is not None])),
        lambda m: {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    return init, losses, norms, grads, final


def saved_bytes(model, tokens, targets) -> dict[str, int]:
    """Bytes of unique storages saved for backward, inside the norms and in total."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[str, dict[int, int]] = {"norms": {}, "all": {}}
    inside = []
    for m in model.modules():
        if "Norm" in type(m).__name__:
            m.register_forward_pre_hook(lambda *a: inside.append(1))
            m.register_forward_hook(lambda *a: inside.pop() and None)

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in param_ptrs:
            seen["all"][st.data_ptr()] = st.nbytes()
            if inside:
                seen["norms"][st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    return {k: sum(v.values()) for k, v in seen.items()}


def _tp_worker(rank, world, cases):
    dims = ParallelDims.from_config(ParallelSection(tp=world))
    tp = dims["tp"]
    async_calls = []
    for fn_name in ("all_reduce", "reduce_scatter"):  # count the overlapped reductions
        orig = getattr(comm, fn_name)

        def counted(*a, _orig=orig, **k):
            async_calls.append(bool(k.get("async_op")))
            return _orig(*a, **k)
        setattr(comm, fn_name, counted)
    out = {}
    for name, overrides, sp in cases:
        cfg = preset("nano").replace(**overrides)
        model = materialize(apply_tensor_parallel(
            build_meta(cfg), dims, bool(sp), sp_saved_input="shard" if sp == "shard" else "full"),
            cfg, SEED)
        init = gather_full_state(model, dims)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(0.5)
        missing, unexpected = load_tp_state(model, init)
        reloaded = all(torch.equal(before[n], p) for n, p in model.named_parameters())
        dims.ledger.reset()
        dims.ledger.enabled = True
        async_calls.clear()
        tokens, targets = batch(cfg, 0)
        act = saved_bytes(model, tokens, targets)
        dims.ledger.enabled = False
        ledger, n_async = dims.ledger.totals(), sum(async_calls)
        model.zero_grad(set_to_none=True)
        losses, norms, grads = train(model, cfg, lambda m: tp_grad_norm(m.parameters(), tp),
                                     lambda m: gather_full_state(m, dims, grads=True))
        final = gather_full_state(model, dims)
        in_sync = replicas_in_sync(model, tp)
        meta = {n: (p._tp_slice, p._tp_sharded, p._tp_replicas, tuple(p.shape))
                for n, p in model.named_parameters()}
        out[(name, sp)] = {
            "init": init, "reloaded": reloaded, "missing": missing, "unexpected": unexpected,
            "ledger": ledger, "act": act, "n_async": n_async, "losses": losses, "norms": norms,
            "grads": grads, "final": final, "meta": meta,
            "in_sync": in_sync}
    if world == 4:
        out["refusals"] = []
        for overrides in ({"vocab_size": 3}, {"num_heads": 2, "num_kv_heads": 2}):
            try:
                apply_tensor_parallel(build_meta(preset("nano").replace(**overrides)), dims, False)
            except ConfigError as e:
                out["refusals"].append(str(e))
    if world == 2:
        out["dtensor"] = {sp: _dtensor_losses(world, sp) for sp in (False, True)}
    return out if rank == 0 else None


def replicas_in_sync(model, tp) -> bool:
    """Ranks holding the same piece (replicated tensors, shared kv heads) hold equal bits."""
    ok = True
    for p in model.parameters():
        if p._tp_replicas > 1:
            pieces = torch.empty(tp.size * p.numel())
            comm.all_gather(pieces, p.detach().reshape(-1), tp)
            pieces = pieces.view(tp.size, -1)
            for r in range(tp.size):
                same = p._tp_info.slices[r] == p._tp_info.slices[tp.rank] if p._tp_sharded else True
                ok &= not same or torch.equal(pieces[r], pieces[tp.rank])
    return ok


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check_parity(name, cfg, sp, res, ref):
    init, losses, norms, grads, final = ref
    assert res["reloaded"] and res["missing"] == [] and res["unexpected"] == [], name
    for n, t in init.items():  # layout-independent initialisation, exactly
        assert torch.equal(res["init"][n], t), (name, n)
    for got, want in zip(res["losses"], losses):
        assert within(abs(got - want) / abs(want), LOSS_RTOL, name), (name, sp, res["losses"],
                                                                      losses)
    for got, want in zip(res["norms"], norms):
        assert within(abs(got - want) / want, GRAD_RTOL, name), (name, sp, res["norms"], norms)
    assert res["grads"].keys() == grads.keys()
    for n, g in grads.items():
        err = _rel(res["grads"][n], g)
        assert within(err, GRAD_RTOL, f"{name} grad {n}"), (name, sp, n, err)
    assert res["in_sync"], name
    for n, p in final.items():
        if n.endswith("k_proj.bias"):  # the docstring's exception: its gradient is checked
            continue
        err = _rel(res["final"][n], p)
        assert within(err, GRAD_RTOL, f"{name} final {n}"), (name, sp, n, err)


def _expected_ledger(cfg, tp, sp):
    """Bytes of one micro-batch, forward and backward (fp32, logical sizes, see comm.py)."""
    act = BATCH * SEQ * cfg.hidden_size
    n = 4 * cfg.num_layers + 2
    # Per layer 4 × act: attention and MLP regions, one collective forward, one backward.
    # Plus the embedding (forward) and the head's input (backward); the loss's two
    # all-reduces of per-token scalars (the max; then sum-exp and target logit together).
    calls, elements = 2, 3 * BATCH * SEQ
    if cfg.num_kv_heads < tp:  # k and v weights shared by tp/kv ranks: summed over tp
        calls += 2 * cfg.num_layers
        elements += 2 * cfg.num_layers * cfg.kv_size * cfg.hidden_size
    if not sp:
        calls, elements = calls + n, elements + n * act
        return {("tp", "all_reduce"): {"calls": calls, "elements": elements,
                                       "bytes": 4 * elements}}
    norms = 2 * cfg.num_layers + 1  # the norm weights' gradients, once per micro-batch
    calls, elements = calls + norms, elements + norms * cfg.hidden_size
    seq = {"calls": n, "elements": n * act, "bytes": 4 * n * act}
    # Saving the shard gathers each layer's two region inputs again in backward.
    g = n + (2 * cfg.num_layers if sp == "shard" else 0)
    gathers = {"calls": g, "elements": g * act, "bytes": 4 * g * act}
    return {("tp", "all_gather"): gathers, ("tp", "reduce_scatter"): seq,
            ("tp", "all_reduce"): {"calls": calls, "elements": elements, "bytes": 4 * elements}}


def _run_and_check(tp):
    results = run_ranks(_tp_worker, tp, CASES[tp])[0]
    for name, overrides, sp in CASES[tp]:
        cfg = preset("nano").replace(**overrides)
        res = results[(name, sp)]
        _check_parity(name, cfg, sp, res, reference(cfg))
        # Two regions per layer, each reduced asynchronously under its weight gradient.
        assert res["n_async"] == 2 * cfg.num_layers, (name, res["n_async"])
        if name in ("nano", "kv2"):
            assert res["ledger"] == _expected_ledger(cfg, tp, sp), (name, sp, res["ledger"])
            print(f"tp={tp} sp={sp} ledger per micro-batch: {res['ledger']}")
    for name, _overrides, _ in CASES[tp][:1]:
        off, on = results[(name, False)]["act"], results[(name, True)]["act"]
        print(f"tp={tp} saved activations per rank, bytes: norms {off['norms']} -> "
              f"{on['norms']} with SP; all {off['all']} -> {on['all']}")
        assert on["norms"] * tp == off["norms"], (off, on)
    for name, overrides, sp in CASES[tp]:
        if sp == "shard":  # two region inputs per layer kept at 1/tp of the sequence
            cfg = preset("nano").replace(**overrides)
            full, shard = results[(name, True)]["act"]["all"], results[(name, sp)]["act"]["all"]
            saved = 2 * cfg.num_layers * BATCH * SEQ * cfg.hidden_size * 4 * (tp - 1) // tp
            print(f"tp={tp} {name}: saved activations SP full {full} -> shard {shard}")
            assert full - shard == saved, (name, full, shard, saved)
    return results


@pytest.mark.parity
def test_tp2_parity_sp_vocab_padding_tied_and_dtensor():
    results = _run_and_check(2)
    meta = results[("vocab257", True)]["meta"]
    # 257 rows over 2 ranks: 129 each, rank 0 holds logical rows [0, 129), no padding.
    assert meta["embed_tokens.weight"] == ((0, 0, 129), True, 1, (129, 32))
    assert meta["layers.0.input_layernorm.weight"] == (None, False, 2, (32,))
    assert meta["layers.0.self_attn.o_proj.weight"] == ((1, 0, 16), True, 1, (32, 16))
    # DTensor tensor parallelism from the same weights and data: the same losses.
    ours = {sp: results[("nano", sp)]["losses"][:2] for sp in (False, True)}
    for sp, losses in results["dtensor"].items():
        for got, want in zip(losses, ours[sp]):
            assert within(abs(got - want) / abs(want), LOSS_RTOL, "dtensor"), (sp, losses)


@pytest.mark.parity
def test_tp4_parity_replicated_kv_heads_biases_and_refusals():
    results = _run_and_check(4)
    meta = results[("kv2", False)]["meta"]
    # 2 kv heads of dim 8 over 4 ranks: ranks 0 and 1 both hold head 0 (rows 0..8).
    assert meta["layers.0.self_attn.k_proj.weight"] == ((0, 0, 8), True, 2, (8, 32))
    assert meta["layers.0.self_attn.q_proj.weight"] == ((0, 0, 8), True, 1, (8, 32))
    vocab, heads = results["refusals"]
    assert "model.vocab_size = 3" in vocab and "parallel.tp = 4" in vocab
    assert "model.num_heads = 2" in heads


def _dtensor_losses(tp, sp):
    from torch.distributed.tensor.parallel import loss_parallel

    cfg = preset("nano")
    model = dtensor_model(cfg, tp, sp, SEED)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for step in range(2):
        tokens, targets = batch(cfg, step)
        loss = dtensor_loss(model, tokens, targets, loss_parallel)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def dtensor_model(cfg, tp, sp, seed):
    """The same model under torch's DTensor TP plan (torchtitan's Llama plan); untied."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    model = build_model(cfg, seed)
    mesh = init_device_mesh("cpu", (tp,))
    seq = Shard(1) if sp else Replicate()
    parallelize_module(model, mesh, {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                   use_local_output=False),
        **({"norm": SequenceParallel()} if sp else {})})
    for layer in model.layers:
        parallelize_module(layer, mesh, {
            "self_attn": PrepareModuleInput(input_layouts=(seq,) + (None,) * 5,
                                            desired_input_layouts=(Replicate(),) + (None,) * 5,
                                            use_local_output=True),
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq),
            **({"input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel()} if sp else {})})
    return model


def dtensor_loss(model, tokens, targets, loss_parallel):
    """Llama.forward spelled out so the head goes through the (DTensor) lm_head module."""
    h = model.embed_tokens(tokens)
    cos, sin = model.rotary(torch.arange(tokens.shape[1]), torch.float32)
    for i, layer in enumerate(model.layers):
        h = layer(h, cos, sin, None, i, 0)
    logits = model.lm_head(model.norm(h))
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100,
                               reduction="sum") / int((targets != -100).sum())
        loss.backward()
    return loss.full_tensor() if hasattr(loss, "full_tensor") else loss


def test_metadata_survives_materialize_and_tp1_is_plain():
    cfg = preset("nano")
    model = materialize(apply_tensor_parallel(build_meta(cfg), ParallelDims.single(), False),
                        cfg, SEED)
    ref = build_model(cfg, SEED)
    tokens, targets = batch(cfg, 0)
    assert torch.equal(model(tokens, targets), ref(tokens, targets))
    for p in model.parameters():
        assert isinstance(p, nn.Parameter) and p._tp_replicas == 1 and not p._tp_sharded


def test_sp_without_tp_is_refused():
    with pytest.raises(ConfigError, match="parallel.sp"):
        apply_tensor_parallel(build_meta(preset("nano")), ParallelDims.single(), True)
