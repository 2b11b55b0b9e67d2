"""`--convention`: each engine's setting pinned by a number derived by hand from the cited
source, never from the planner's own code. The sources, each at the commit read:
NVIDIA/Megatron-LM @d98e8a64 megatron/training/theoretical_memory_usage.py; the Ultra-Scale
Playbook (HF Space nanotron/ultrascale-playbook, GitHub mirror
vinjn/nanotron-ultrascale-playbook @924e4d0) index.md; microsoft/DeepSpeed @38327e07f
deepspeed/runtime/zero/stage_1_and_2.py (formula of f4cb866c2, PR #5099); pytorch/torchtitan
@b5bcd76c6 torchtitan/models/llama3/infra/parallelize.py and benchmarks @9dec370;
huggingface/nanotron @2411b022 src/nanotron/parallel/pipeline_parallel/engine.py; Korthikanti
et al. 2022 (arXiv:2205.05198) Table 2."""

import json

import pytest

from fivefold.cli import main as cli_main
from fivefold.models.presets import ModelConfig
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.plan.conventions import CONVENTIONS, get_convention
from fivefold.plan.layout import Layout

MIB, GIB = 2**20, 2**30


def _plan(capsys, *args):
    assert cli_main(["plan", "--seq-len", "2048", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _states(data):
    plan = data["layouts"][0]
    return plan["stages"][plan["memory_rank"]]["model_states_bytes"]


def test_megatron_distributed_optimizer_llama_8b(capsys):
    """theoretical_memory_usage.py: Llama-3-8B (8,030,261,248 parameters, untied), TP1 PP1
    DP8 with the distributed optimizer: 6 + 12/8 = 7.5 B/param = 57,436.9 MiB (57,437)."""
    data = _plan(capsys, "--model", "llama-3.1-8b", "--gpus", "8", "--gbs", "64",
                 "--layout", "dp=8,zero=1", "--convention", "megatron")
    assert _states(data) / MIB == pytest.approx(8_030_261_248 * 7.5 / MIB, abs=0.5)
    assert round(_states(data) / MIB) == 57_437


def test_megatron_tp2_dp4():
    """TP2 DP4 with the distributed optimizer: Megatron divides every parameter by TP,
    8,030,261,248 / 2 × (6 + 12/4) = 34,462.8 MiB. The engine keeps the replicated norms
    (2·32 + 1 of 4096 = 266,240 parameters) whole on each tp rank: 1.1 MiB more."""
    from fivefold.models.presets import preset
    from fivefold.plan.hardware import Assumptions
    from fivefold.plan.layout import Workload
    from fivefold.plan.memory import memory_items

    conv = get_convention("megatron")
    work = conv.apply_workload(Workload(preset("llama-3.1-8b"), 8192, 64))
    items, _ = memory_items(work, conv.apply_layout(Layout(dp=4, tp=2, zero=1, sp=True)),
                            Assumptions())
    states = sum(items[k] for k in ("params", "grads", "master", "optimizer")) / MIB
    megatron = 8_030_261_248 / 2 * 9 / MIB
    norms = 266_240 / 2 * 9 / MIB
    assert states == pytest.approx(megatron + norms, abs=0.01)


def test_nanotron_twenty_bytes_per_parameter(capsys):
    """Ultra-Scale Playbook table, fp32 gradient accumulation (nanotron): 7B → 140 GB."""
    data = _plan(capsys, "--params", "7e9", "--gpus", "1", "--gbs", "1", "--layout", "dp=1",
                 "--convention", "nanotron")
    assert round(_states(data) / 1e9) == 140
    assert "20 B/param" in data["layouts"][0]["bytes_per_param"]


def test_deepspeed_zero2_current_estimator(capsys):
    """stage_1_and_2.py since PR #5099: GPU = 2Ψ + 18Ψ/N; t5-3b Ψ = 2851M on 8 GPUs:
    2851e6 × 4.25 / 2^30 = 11.28 GiB (the old docs formula 4Ψ + 16Ψ/N gives 15.93)."""
    data = _plan(capsys, "--params", "2.851e9", "--gpus", "8", "--gbs", "8",
                 "--layout", "dp=8,zero=2", "--convention", "deepspeed")
    assert f"{_states(data) / GIB:.2f}" == "11.28"


def test_torchtitan_fsdp_and_reserved_memory(capsys):
    """torchtitan (FSDP2, fp32 sharded parameters and gradients, Adam): 16Ψ/N. Llama-3.1-8B
    on 8 GPUs: 8,030,261,248 × 16 / 8 / 2^30 = 14.96 GiB; its logs report max reserved."""
    data = _plan(capsys, "--model", "llama-3.1-8b", "--gpus", "8", "--gbs", "64",
                 "--layout", "dp=8", "--convention", "torchtitan")
    assert data["layouts"][0]["layout"]["zero"] == 3  # FSDP unless the layout says otherwise
    assert f"{_states(data) / GIB:.2f}" == "14.96"
    conv = data["convention"]
    assert conv["logged_memory"] == "reserved"
    assert conv["logged_memory_bytes"] == data["layouts"][0]["peak_reserved_bytes"]
    assert data["layouts"][0]["peak_reserved_bytes"] > data["layouts"][0]["peak_allocated_bytes"]


def test_flags_override_the_convention(capsys):
    data = _plan(capsys, "--model", "llama-3.1-8b", "--gpus", "8", "--gbs", "64",
                 "--layout", "dp=8,zero=1", "--convention", "megatron",
                 "--grad-dtype-bytes", "2")
    assert "16 B/param" in data["layouts"][0]["bytes_per_param"]


def test_megatron_sp_saves_korthikanti_table2():
    """Korthikanti et al. 2022 Table 2, TP + SP: sbh(34/t + 5as/(ht)) per layer for GPT-3
    (h 12288, a 96, s 2048, b 1, t 8; GeLU, LayerNorm, dropout, 2-byte activations, scores
    kept). Megatron's shard-saving SP gives it plus the fp32 LayerNorm statistics the paper
    leaves out (2 norms × mean and rstd, 16 bytes per token, /t); torchtitan's gathered
    inputs add 2 · 2sbh(1 − 1/t)."""
    gpt3 = ModelConfig(name="gpt3", vocab_size=51200, hidden_size=12288,
                       intermediate_size=4 * 12288, num_layers=96, num_heads=96,
                       num_kv_heads=96, tie_embeddings=True, qkv_bias=True, mlp="gelu",
                       norm="layernorm")
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    paper = s * b * h * (34 / t + 5 * a * s / (h * t)) + 16 * s * b / t

    def layer(convention):
        lay = get_convention(convention).apply_layout(Layout(tp=t, sp=True))
        return activation_bytes_per_microbatch(
            gpt3, b, s, tp=t, sp=True, flash=False, dropout=True,
            sp_saves_gathered=lay.sp_saved == "full").layer

    assert layer("megatron") == pytest.approx(paper, rel=1e-12)
    assert layer("nanotron") == layer("megatron")
    assert layer("torchtitan") - paper == pytest.approx(2 * 2 * s * b * h * (1 - 1 / t))


def test_every_convention_cites_its_source():
    for conv in CONVENTIONS.values():
        assert conv.sources and conv.logged_memory in ("allocated", "reserved")


def test_unknown_convention_is_one_line(capsys):
    code = cli_main(["plan", "--model", "llama-3.1-8b", "--convention", "jax"])
    err = capsys.readouterr().err
    assert code == 2 and "--convention 'jax' is unknown" in err and err.count("\n") == 1


def test_torchtitan_keeps_fsdp_parameters_gathered_under_pp():
    """torchtitan's apply_fsdp: reshard_after_forward = not pp_enabled. Llama-3.1-8B at pp 2,
    rank 0: 16 layers of 4096·(2·4096 + 2·1024) + 3·4096·14336 + 2·4096 = 218,112,000 plus the
    embedding 128,256·4096 = 525,336,576: 4,015,128,576 parameters stay gathered in bf16,
    8,030,257,152 bytes; and the parameters are gathered once per step, not twice per
    micro-batch. (Pipelines run by fivefold's engine here: torch.distributed.pipelining's
    own buffers are pinned in tests/test_plan_torch_pipelining.py.)"""
    import dataclasses

    from fivefold.models.presets import preset
    from fivefold.plan.comm import ledger_volume
    from fivefold.plan.hardware import Assumptions
    from fivefold.plan.layout import Workload
    from fivefold.plan.memory import memory_items

    conv = get_convention("torchtitan")
    work = conv.apply_workload(Workload(preset("llama-3.1-8b"), 4096, 16, pp_runtime="engine"),
                               {"pp_runtime"})
    lay = conv.apply_layout(Layout(dp=2, pp=2, mbs=2))  # zero 3 from the convention; m = 4
    resharding = dataclasses.replace(work, zero3_keep_gathered_pp=False)
    kept = memory_items(work, lay, Assumptions())[0]["comm_buffers"]
    freed = memory_items(resharding, lay, Assumptions())[0]["comm_buffers"]
    assert kept - freed == 8_030_257_152
    gathers = [ledger_volume(w, lay)["dp_cp"]["all_gather"] for w in (work, resharding)]
    assert gathers[1] == 2 * 4 * gathers[0] == 2 * 4 * 8_030_257_152


def test_search_under_a_convention_uses_its_settings_and_schedules(capsys):
    """nanotron's pipeline engines are all-forward-all-backward and 1F1B; its search also
    keeps the convention's SP shard and cumulative-cost split on every layout."""
    assert cli_main(["plan", "--model", "llama-3.1-8b", "--gpus", "16", "--gbs", "64",
                     "--convention", "nanotron", "--space", "pp=2,4 tp=1,2", "--top", "5",
                     "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["convention"] == "nanotron" and data["layouts"]
    for plan in data["layouts"]:
        lay = plan["layout"]
        assert lay["schedule"] in ("afab", "1f1b") and lay["pp_split"] == "cumulative"
        assert lay["sp_saved"] == "shard"
