"""`fivefold plan`: explain one layout, rank a search space, or check a training config.

    fivefold plan --model llama-3.1-8b --gpus 8 --seq-len 8192 --gbs 128
    fivefold plan --model llama-3.1-70b --gpus 64 --layout tp=8,pp=2,zero=1,recompute=selective
    fivefold plan --config train.toml            # fits? before launch (exit 1 if not)
    fivefold plan ... --json out.json --plot plots/
    fivefold plan --serve --model llama-3.1-8b --context 2048 --output 256   # plan/serve.py

Errors are one line on stderr with exit code 2.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from fivefold.config.parallel import offload_value
from fivefold.config.rules import writable_dir, writable_file
from fivefold.errors import ConfigError
from fivefold.plan.advice import layout_warnings
from fivefold.plan.cli_args import (
    build_parser,
    explicit_workload,
    recompute_options,
    workload_options,
)
from fivefold.plan.conventions import get_convention
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.fp8_linears import keep_out_problem
from fivefold.plan.grad_sync import resolve_grad_sync
from fivefold.plan.hardware import (
    CATALOG,
    check_memory_budget,
    get_hardware,
    load_profile,
    parse_overrides,
    runs_on_host,
    with_profile,
)
from fivefold.plan.inputs import (
    default_gbs,
    engine_accepts,
    parse_layout,
    read_training_config,
    resolve_model,
    training_plan_inputs,
)
from fivefold.plan.layout import Workload, check_layout
from fivefold.plan.report import (
    convention_to_dict,
    describe_convention,
    describe_workload,
    format_explain,
    format_search,
    search_to_dict,
    workload_to_dict,
)
from fivefold.plan.run_cost import model_from_params, run_cost
from fivefold.plan.search import SearchSpace, search, suggest_fix
from fivefold.plan.validated import describe as describe_validated
from fivefold.plan.validated import to_dict as validated_to_dict
from fivefold.plan.validated import validated_range


def _emit_json(args, payload: dict) -> None:
    text = json.dumps(payload, indent=2, default=float)
    if args.json == "-":
        print(text)
    else:
        Path(args.json).write_text(text + "\n")


def _plots(args, plans, title: str) -> list[Path]:
    from fivefold.plan.plots import plot_memory, plot_time

    directory = Path(args.plot)
    return [plot_memory(plans, directory / "memory.png", title),
            plot_time(plans, directory / "time.png", title)]


def _check(work, layout, hw, strict: bool = False) -> None:
    """Refuse only what cannot run; what runs but costs (tp across nodes) is explained."""
    problems = check_layout(work, layout, None, strict)
    if problems:
        raise ConfigError(f"layout {layout.short()}: {problems[0]}")


def _check_keep_out(work) -> None:
    """A train.fp8_keep_out pattern that names no linear: the engine's refusal, here."""
    problem = keep_out_problem(work.model, work.fp8_keep_out) if work.precision == "fp8" else ""
    if problem:
        raise ConfigError(problem)


def _explain(plan, work, hw) -> str:
    warnings = layout_warnings(plan, work, hw)
    text = format_explain(plan, work)
    if warnings:
        text += "\n\nwarnings (the layout runs; at these costs):\n" + "\n".join(
            f"  - {w}" for w in warnings)
    return text


def _run_cost(args, work, plan, assume):
    """The whole run at `--tokens` (None without it)."""
    if not getattr(args, "tokens", None):
        return None
    if args.tokens <= 0:
        raise ConfigError(f"--tokens {args.tokens:g} must be > 0")
    achieved = (args.achieved_tflops * 1e12 if args.achieved_tflops
                else plan.mfu * plan.peak_flops)
    if achieved <= 0:
        raise ConfigError(f"--achieved-tflops {args.achieved_tflops:g} must be > 0")
    num_params = args.params or work.model.num_params()
    return run_cost(args.tokens, plan.world_size, num_params, flops_rule=args.flops_rule,
                    achieved_flops_per_gpu=achieved,
                    tokens_per_second=plan.tokens_per_step / plan.time.total,
                    price_per_gpu_hour=assume.price_per_gpu_hour)


def run(argv: list[str]) -> int:
    if "--serve" in argv:  # its own options (plan/serve.py)
        from fivefold.plan.serve import run as run_serve

        return run_serve(argv)
    args, extra = build_parser().parse_known_args(argv)
    if args.list_gpus:
        for name, h in CATALOG.items():
            print(f"{name:<10} {h.memory_gib:>5g} GiB  bf16 {h.bf16_tflops:>7g} TF  fp8 "
                  f"{h.fp8_tflops:>7g} TF  HBM {h.hbm_tbps:g} TB/s  intra {h.intra_node_gbps:g}"
                  f" GB/s  inter {h.inter_node_gbps:g} GB/s  {h.gpus_per_node}/node")
        return 0
    if args.top < 1:
        raise ConfigError(f"--top {args.top}: show at least 1 layout")
    if extra and not args.config:
        raise ConfigError(f"unexpected argument {extra[0]!r}; see fivefold plan --help")
    if args.plot:  # before any work: a missing matplotlib or a read-only DIR is one line
        from fivefold.extras import require

        require("matplotlib", "plot", "--plot (PNG charts)")
        writable_dir("--plot", args.plot)
    if args.json and args.json != "-":
        writable_file("--json", args.json)
    overrides = parse_overrides(args.hw)
    hw, assume = get_hardware(args.gpu, overrides)
    if args.hw_profile:
        hw = with_profile(hw, load_profile(args.hw_profile), tuple(overrides))
    if args.fp8_allgather and (args.config or args.precision != "fp8"):
        raise ConfigError("--fp8-allgather needs --precision fp8 (with --config, set "
                          "parallel.fp8_allgather = true in the file instead)")
    for flag, key, value in (("--fp8-recipe", "fp8_recipe", args.fp8_recipe),
                             ("--fp8-scaling", "fp8_scaling", args.fp8_scaling)):
        if value and (args.config or args.precision != "fp8"):
            raise ConfigError(f"{flag} needs --precision fp8 (with --config, set "
                              f"train.{key} in the file instead)")
    recipe = args.fp8_recipe or ("tensorwise" if args.fp8_allgather else "blockwise")
    if args.fp8_allgather and recipe != "tensorwise":
        raise ConfigError(f"--fp8-allgather gathers tensorwise FP8 only (got --fp8-recipe "
                          f"{recipe}); use --fp8-recipe tensorwise or drop --fp8-allgather")
    if args.fp8_scaling == "delayed" and recipe != "tensorwise":
        raise ConfigError(f"--fp8-scaling delayed keeps one amax per tensor, for the tensorwise "
                          f"recipe only (got {recipe}); add --fp8-recipe tensorwise")
    if args.fp8_keep_out and (args.config or args.precision != "fp8"):
        raise ConfigError("--fp8-keep-out needs --precision fp8 (with --config, set "
                          "train.fp8_keep_out in the file instead)")
    options = workload_options(args)
    if args.config and args.convention != "fivefold":
        raise ConfigError(f"--convention {args.convention} plans another engine's run; a "
                          f"--config training file is fivefold's own: drop one of them")
    if args.config:
        cfg = read_training_config(args.config, extra)
        work, layout = training_plan_inputs(cfg, hw, assume, **options)
        if options.get("grad_sync", getattr(cfg.parallel, "grad_sync", "step")) == "auto":
            # chosen per layout by plan_layout (plan/grad_sync.py), as with --model: for the
            # config's layout (its reason printed), and for each one the search tries
            work = dataclasses.replace(work, grad_sync="auto")
        _check_keep_out(work)
        work = recompute_options(args, work, hw, assume)
        if args.recompute:
            layout = dataclasses.replace(layout, recompute=args.recompute)
        num_gpus = layout.world_size
        if args.search:
            return _search(args, work, num_gpus, hw, assume, engine_accepts(cfg))
        code = _config_check(args, work, layout, num_gpus, hw, assume, engine_accepts(cfg))
        if offload_value(cfg.parallel.offload) == "nvme" and args.json != "-":
            from fivefold.plan.nvme import describe_nvme
            from fivefold.plan.timing import offload_nvme_time, optimizer_time

            plan = plan_layout(work, layout, hw, assume)
            chosen = plan.context[0]  # grad_sync as plan_layout resolved it
            update = optimizer_time(chosen, dataclasses.replace(layout, offload=True), hw,
                                    assume)
            print(describe_nvme(plan.disk_bytes, plan.cpu_bytes,
                                offload_nvme_time(chosen, layout, hw, update), hw))
        return code
    if args.model and args.params:
        raise ConfigError("give --model or --params, not both")
    if not args.model and not args.params:
        raise ConfigError("give --model (a preset, config.json or .toml), --params N or "
                          "--config train.toml")
    if args.params:
        try:
            model = model_from_params(args.params)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    else:
        model = resolve_model(args.model)
    for flag, value in (("--gpus", args.gpus), ("--seq-len", args.seq_len)):
        if value < 1:
            raise ConfigError(f"{flag} {value} must be >= 1")
    if (args.gbs is not None and args.gbs < 1) or (args.gbs_tokens is not None
                                                    and args.gbs_tokens < args.seq_len):
        raise ConfigError("--gbs must be >= 1 sequence (--gbs-tokens >= one sequence of "
                          "--seq-len tokens)")
    if args.gbs_tokens:
        gbs = round(args.gbs_tokens / args.seq_len)
    else:
        gbs = args.gbs or default_gbs(args.gpus, args.seq_len)
    if args.gbs is None and not args.gbs_tokens:
        args.gbs_note = (f"gbs = {gbs} sequences, the default: about 4M tokens rounded to "
                         f"{args.gpus} GPUs × {gbs // args.gpus} so every dp divides it "
                         f"(--gbs or --gbs-tokens sets another)")
    if not runs_on_host(hw):  # a GPU's fused loss sizes its chunks by its memory
        options = {"loss_device_memory": hw.memory_gib * 2**30, **options}
    work = Workload(model=model, seq_len=args.seq_len, gbs=gbs, precision=args.precision,
                    **{"grad_sync": "auto", **options})
    _check_keep_out(work)
    convention = get_convention(args.convention)
    work = convention.apply_workload(work, explicit_workload(args))
    assume = convention.apply_assumptions(assume, set(parse_overrides(args.hw)))
    check_memory_budget(hw, assume)  # the convention's headroom counts too
    args.convention_obj = convention
    if args.layout:
        layout = parse_layout(args.layout, args.gpus)
        if args.recompute:
            layout = layout.replace(recompute=args.recompute)
        work = recompute_options(args, work, hw, assume)
        given = {item.split("=", 1)[0] for item in args.layout.replace(" ", ",").split(",")
                 if "=" in item}
        layout = convention.apply_layout(layout, given | ({"sp"} if layout.tp == 1 else set()))
        if "schedule" in given and layout.schedule not in convention.schedules:
            raise ConfigError(f"--layout schedule={layout.schedule} is outside the "
                              f"{convention.name} convention, whose engine runs "
                              f"{', '.join(convention.schedules)}; pick one of those, or plan "
                              f"it without --convention")
        if model.num_experts and "sp" not in given:  # experts replicate over tp, without SP
            layout = layout.replace(sp=False)
        if layout.world_size != args.gpus:
            raise ConfigError(f"--layout uses {layout.world_size} GPUs but --gpus is {args.gpus}")
        _check(work, layout, hw)
        _check_budget(work, layout)
        plan = plan_layout(work, layout, hw, assume)
        cost = _run_cost(args, work, plan, assume)
        if args.json:
            _emit_json(args, {"workload": workload_to_dict(work), "layouts": [plan.to_dict()],
                              "warnings": layout_warnings(plan, work, hw),
                              "run": cost.to_dict() if cost else None,
                              "convention": convention_to_dict(convention, plan),
                              "validated": validated_to_dict(convention.name, layout,
                                                             hw.gpus_per_node)})
        if args.json != "-":
            print(describe_workload(work, hw, args.gpus))
            if getattr(args, "gbs_note", None):
                print(f"note: {args.gbs_note}")
            print(_explain(plan, work, hw))
            if convention.name != "fivefold":
                print("\n" + describe_convention(convention, plan))
            print("\n" + "\n".join(describe_validated(convention.name, layout,
                                                        hw.gpus_per_node)))
            if cost:
                print("\n" + cost.describe())
        if args.plot:
            _plots(args, [plan], layout.short())
        return 0
    return _search(args, work, args.gpus, hw, assume)


def _search(args, work, num_gpus, hw, assume, allowed=None) -> int:
    """`allowed`: for a training config, only the layouts `train` runs with it."""
    space = SearchSpace.parse(args.space)
    space.allowed = allowed
    if args.recompute:
        space.recompute = (args.recompute,)
    work = recompute_options(args, work, hw, assume)
    convention = getattr(args, "convention_obj", None)
    if convention is not None:  # its layout settings, but the search still explores ZeRO
        space.fixed = {k: v for k, v in convention.layout.items() if k != "zero"}
        space.schedule = tuple(s for s in space.schedule if s in convention.schedules)
    space.validated = validated_range(convention.name if convention else "fivefold")
    result = search(work, num_gpus, hw, assume, space, top=max(args.top, 1),
                    progress=lambda line: print(line, file=sys.stderr, flush=True))
    if getattr(args, "gbs_note", None):
        result.notes.insert(0, f"note: {args.gbs_note}")
    cost = _run_cost(args, work, result.top[0], assume) if result.top else None
    if args.json:
        payload = search_to_dict(result, work, hw, assume)
        payload["run"] = cost.to_dict() if cost else None
        payload["convention"] = convention.name if convention else "fivefold"
        if result.top:
            payload["validated"] = validated_to_dict(payload["convention"],
                                                     result.top[0].layout, hw.gpus_per_node)
        _emit_json(args, payload)
    if args.json != "-":
        print(format_search(result, work, hw, args.top))
        if result.top:
            print("\n" + "\n".join(describe_validated(
                convention.name if convention else "fivefold", result.top[0].layout,
                hw.gpus_per_node)))
        if cost:
            print(f"\nwith the fastest layout, {result.top[0].layout.short()}:")
            print(cost.describe())
    if args.plot and result.top:
        plans = result.top[:args.top] + result.faster_but_too_big
        _plots(args, plans, f"{work.model.name} on {num_gpus} × {hw.name}")
    return 0 if result.top else 1


def _config_check(args, work, layout, num_gpus, hw, assume, allowed=None) -> int:
    """'fits: 61.2 of 80 GiB' or 'does not fit: … ; try …' before launch."""
    _check(work, layout, hw)
    _check_budget(resolve_grad_sync(work, layout, hw, assume), layout)
    plan = plan_layout(work, layout, hw, assume)
    line = plan.why
    if not plan.fits:
        fix = suggest_fix(work, layout, num_gpus, hw, assume, allowed=allowed)
        line += f"; try {fix}" if fix else "; no layout of these GPUs fits: add GPUs"
    if args.json:
        _emit_json(args, {"workload": workload_to_dict(work), "layouts": [plan.to_dict()],
                          "summary": line, "warnings": layout_warnings(plan, work, hw)})
    if args.json != "-":
        print(line)
        print(describe_workload(work, hw, num_gpus))
        print(_explain(plan, work, hw))
    if args.plot:
        _plots(args, [plan], layout.short())
    return 0 if plan.fits else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point of `fivefold plan`; returns the exit code (2 for a bad input)."""
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse printed its one-line error (2), or the help (0)
        return int(e.code or 0)
    except BrokenPipeError:  # `fivefold plan ... | head`: the reader left, nothing is wrong
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (replaces a closed pipe for exit)
        return 0


def _check_budget(work, layout) -> None:
    if layout.recompute != "auto":
        return
    from fivefold.plan.memory import minimum_budget

    low = minimum_budget(work, layout)
    if work.memory_budget_gib < low:
        raise ConfigError(f"--memory-budget-gib {work.memory_budget_gib:g} is below full "
                          f"recomputation's peak for {layout.short()}, {low:.4g} GiB; give at "
                          f"least that")


if __name__ == "__main__":
    sys.exit(main())
