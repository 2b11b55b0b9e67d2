"""train.fp8_keep_out in the planner (plan/fp8_linears.py): which linears it counts as FP8
per layer equals what the engine's `convert_to_fp8` converts on a built model, name for
name, for dense and MoE models and several patterns; a pattern naming no linear is refused
with the engine's own line (and `fivefold plan --fp8-keep-out` exits 2 with it)."""

import dataclasses
import pathlib

import pytest
import torch

from fivefold.errors import ConfigError
from fivefold.lowp.convert import convert_to_fp8, parse_keep_out
from fivefold.lowp.linear import FP8Recipe
from fivefold.models.llama import Llama
from fivefold.models.presets import preset
from fivefold.plan.fp8_linears import (
    fp8_linear_names,
    keep_out_problem,
    layers_fp8_linears,
    rank_fp8_linears,
    uniform_fp8_linears,
)
from fivefold.plan.layout import Layout, Workload

DENSE = dataclasses.replace(preset("tiny"), num_layers=4, tie_embeddings=False)
GELU = dataclasses.replace(DENSE, mlp="gelu")
# a dense first layer, then MoE layers with a gated shared expert
MOE = dataclasses.replace(preset("tiny"), num_layers=3, num_experts=4, experts_top_k=2,
                          moe_intermediate_size=32, shared_expert_intermediate_size=64,
                          shared_expert_gate=True, moe_first_dense=1)
CASES = [
    (DENSE, ""), (DENSE, "layers.0,layers.3"), (DENSE, "o_proj"), (DENSE, "layers.2.mlp"),
    (DENSE, "*.down_proj,layers.1.self_attn.q_proj"), (DENSE, "*.self_attn"),
    (GELU, "up_proj"), (GELU, "layers.1"),
    (MOE, ""), (MOE, "experts"), (MOE, "layers.1.mlp"), (MOE, "*.shared_expert"),
    (MOE, "layers.0,layers.2.mlp.experts"), (MOE, "k_proj,v_proj,*.shared_expert.up_proj"),
]


def engine_converted(mc, keep_out):
    with torch.device("meta"):
        model = Llama(mc)
    return convert_to_fp8(model, FP8Recipe.from_name("rowwise"), parse_keep_out(keep_out))


@pytest.mark.parametrize("mc, keep_out", CASES)
def test_planned_fp8_linears_are_the_engines(mc, keep_out):
    planned = fp8_linear_names(mc, keep_out)
    assert [n for layer in planned for n in layer] == engine_converted(mc, keep_out)
    assert len(planned) == mc.num_layers
    # the per-layer counts the terms read, summed over all layers, against the names
    work = Workload(model=mc, seq_len=64, gbs=2, precision="fp8", fp8_keep_out=keep_out)
    total = layers_fp8_linears(work, 0, mc.num_layers)
    names = [n for layer in planned for n in layer]
    assert total.linears == sum(not n.endswith("experts") for n in names)
    assert total.experts == sum(n.endswith("experts") for n in names)
    assert total.o == sum(n.endswith(".o_proj") for n in names)
    assert total.qkv_input == sum(any(n.startswith(f"layers.{i}.self_attn.") and
                                      not n.endswith("o_proj") for n in layer)
                                  for i, layer in enumerate(planned))


def test_no_keep_out_is_every_linear_and_ranks_sum_to_the_model():
    work = Workload(model=MOE, seq_len=64, gbs=2, precision="fp8")
    assert layers_fp8_linears(work, 0, 3) == uniform_fp8_linears(MOE, 3, 2)
    keep = dataclasses.replace(work, fp8_keep_out="layers.0")
    lay = Layout(pp=3)
    ranks = [rank_fp8_linears(keep, lay, r) for r in range(3)]
    assert ranks[0].linears == 0 and ranks[1] == ranks[2] == uniform_fp8_linears(MOE, 1, 1)
    assert rank_fp8_linears(dataclasses.replace(keep, precision="bf16"), lay, 1).linears == 0


@pytest.mark.parametrize("mc, keep_out", [(DENSE, "q_projx"), (DENSE, "experts"),
                                          (MOE, "layers.1,layers.7"), (DENSE, "lm_head,zz"),
                                          (DENSE, "self_attn")])
def test_a_pattern_naming_no_linear_is_the_engines_refusal(mc, keep_out):
    with pytest.raises(ConfigError) as e:
        engine_converted(mc, keep_out)
    assert keep_out_problem(mc, keep_out) == str(e.value)


def test_plan_cli_refuses_a_bad_keep_out_in_one_line(capsys):
    from fivefold.plan.cli_entry import main

    base = ["--model", "llama-3.1-8b", "--gpus", "8", "--layout", "dp=8,zero=3,mbs=1",
            "--seq-len", "4096", "--gbs", "8"]
    config = ["--config", str(pathlib.Path(__file__).parents[1] / "examples" / "tiny.toml"),
              "--train.precision", "fp8"]
    for argv, says in (([*base, "--precision", "fp8", "--fp8-keep-out", "o_projx"],
                        "pattern 'o_projx' matches no linear"),
                       ([*base, "--fp8-keep-out", "o_proj"], "needs --precision fp8"),
                       ([*config, "--train.fp8_keep_out", "layers.9"],
                        "pattern 'layers.9' matches no linear"),
                       ([*config, "--fp8-keep-out", "o_proj"], "set train.fp8_keep_out")):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and says in err, err


def test_plan_cli_plans_the_keep_out(capsys):
    """`fivefold plan --fp8-keep-out` reaches the workload (its JSON says it) and the plan:
    layer 0 and every down_proj in bf16 make the step slower and the activations larger
    (down_proj's input saved in bf16) than all-FP8's; keeping every layer out gives bf16's
    plan (step time and activations: the casts gone, every GEMM at bf16's rate)."""
    import json

    from fivefold.plan.cli_entry import main

    base = ["--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100", "--layout",
            "dp=8,zero=1,mbs=1", "--seq-len", "4096", "--gbs", "64", "--json", "-"]
    step, act = {}, {}
    for name, extra in (("bf16", []), ("fp8", ["--precision", "fp8"]),
                        ("keep", ["--precision", "fp8", "--fp8-keep-out", "layers.0,down_proj"]),
                        ("all", ["--precision", "fp8", "--fp8-keep-out", "layers.*"])):
        assert main([*base, *extra]) == 0
        plan = json.loads(capsys.readouterr().out)
        if name == "keep":
            assert plan["workload"]["fp8_keep_out"] == "layers.0,down_proj"
        step[name] = plan["layouts"][0]["step_time_s"]
        act[name] = plan["layouts"][0]["memory_bytes"]["activations"]
    assert step["fp8"] < step["keep"] < step["all"] == pytest.approx(step["bf16"], rel=1e-12)
    assert act["fp8"] < act["keep"] < act["all"] == act["bf16"]


def test_plan_cli_takes_the_fp8_recipe_and_scaling(capsys):
    """--fp8-recipe and --fp8-scaling reach the plan: the command line's tensorwise plan is the
    Python API's (docs/fp8-allgather.md compares recipes through it), delayed scaling adds its
    amax all-reduce's records; each bad combination is one line, exit 2."""
    import re

    from fivefold.models.presets import preset
    from fivefold.plan.cli_entry import main
    from fivefold.plan.hardware import get_hardware
    from fivefold.plan.layout import Layout, Workload
    from fivefold.plan.timing import step_time

    base = ["--model", "llama-3.1-8b", "--gpus", "8", "--gpu", "h100", "--precision", "fp8",
            "--layout", "zero=3,mbs=1", "--seq-len", "4096", "--gbs", "1024"]

    def planned(*extra) -> str:
        assert main([*base, *extra]) == 0
        return re.search(r"step time ([0-9.]+) s", capsys.readouterr().out).group(1)

    hw, assume = get_hardware("h100")
    for recipe in ("tensorwise", "rowwise"):
        work = Workload(model=preset("llama-3.1-8b"), seq_len=4096, gbs=1024, precision="fp8",
                        fp8_recipe=recipe)
        want = step_time(work, Layout(dp=8, zero=3, mbs=1), hw, assume).total
        assert planned("--fp8-recipe", recipe) == f"{want:.3f}"
    assert planned() != planned("--fp8-recipe", "tensorwise")  # the default is blockwise
    assert planned("--fp8-recipe", "tensorwise", "--fp8-scaling", "delayed") != \
        planned("--fp8-recipe", "tensorwise")
    assert planned("--fp8-allgather") == planned("--fp8-allgather", "--fp8-recipe", "tensorwise")
    for extra, says in ((["--fp8-allgather", "--fp8-recipe", "rowwise"], "tensorwise FP8 only"),
                        (["--fp8-scaling", "delayed"], "for the tensorwise recipe only"),
                        (["--fp8-recipe", "rowwise", "--fp8-scaling", "delayed"],
                         "for the tensorwise recipe only")):
        assert main([*base, *extra]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and says in err, err
    bf16 = [a for a in base if a not in ("--precision", "fp8")]
    assert main([*bf16, "--fp8-recipe", "tensorwise"]) == 2
    assert "needs --precision fp8" in capsys.readouterr().err
