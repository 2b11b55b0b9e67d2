"""fivefold train | plan | prepare | generate | convert | schedule | bench | trace

Every subcommand turns a bad input into one line on stderr and exit code 2, before anything
is written; any other failure is one line too, with the exit codes `main` lists.
"""

from __future__ import annotations

import argparse
import os
import sys

from fivefold.config import ArgumentParser, ConfigError, RunError

USAGE = """usage: fivefold COMMAND [options]

commands:
  train      train a model (default: the tiny model on the bundled corpus)
             fivefold train [--config FILE.toml] [--section.key VALUE ...]
  launch     run train on several ranks (torchrun's launcher; restarts, several nodes)
             fivefold launch [--max-restarts K] train --parallel.dp 2 ...
  plan       predict memory, time and MFU of a layout, or search for the best one
  calibrate  measure matmul, attention, collectives (and a disk) here: a --hw-profile
  prepare    turn text/jsonl/parquet files into a token file for training
  generate   sample text from a checkpoint or a Hugging Face directory
  convert    export a checkpoint to Hugging Face format
  schedule   draw the timeline of a pipeline schedule as a PNG
  bench      measure tokens/s, MFU and peak memory (--peer hf: beside transformers)
  trace      count a step's kernels, bytes and syncs here; predict its time on a GPU
  eval       perplexity of a model, or BLEU/ROUGE of its continuations of a task file
  quantize   int8/int4/AWQ/NF4/MXFP4 weight-only quantisation of a checkpoint
  serve      an OpenAI-compatible HTTP server (paged KV cache, continuous batching)
  help       a command's options: fivefold help COMMAND

Run `fivefold help COMMAND` (or `fivefold COMMAND --help`) for a command's options;
`fivefold --version` for the version.
Add --debug to any command to see a failure's traceback."""


def train_main(argv: list[str]) -> int:
    parser = ArgumentParser(
        prog="fivefold train",
        description="Train with the layout of the [parallel] section; any config key can be "
                    "overridden as --section.key VALUE (e.g. --train.steps 50 --parallel.dp 2)."
                    " Launch several processes with torchrun for a parallel layout.",
        epilog=None, formatter_class=argparse.RawDescriptionHelpFormatter, add_help=False)
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument("--config", help="a TOML file with [model], [parallel], [train], "
                                         "[data], [checkpoint] and [log] sections")
    parser.add_argument("--overwrite", action="store_true",
                        help="start afresh in a run directory that holds an earlier run, "
                             "removing its checkpoints and metrics")
    parser.add_argument("--run-name", metavar="NAME",
                        help="write to runs/NAME (log.dir) and runs/NAME/checkpoints "
                             "(checkpoint.dir) instead of runs/default; --log.dir and "
                             "--checkpoint.dir still win")
    parser.add_argument("--hw-profile", metavar="FILE",
                        help="with parallel.layout = auto: a `fivefold calibrate` profile of "
                             "this machine, whose measured speeds rank the layouts")
    args, overrides = parser.parse_known_args(argv)
    from fivefold import config

    config.check_options(overrides, parser)

    if args.run_name is not None:
        overrides = [*config.run_name_overrides(args.run_name), *overrides]
    if args.help:
        from fivefold.config_keys import describe_keys

        print(parser.format_help() + "\nconfig keys (--section.key VALUE), with defaults:\n"
              + describe_keys())
        return 0
    cfg = config.load(args.config, overrides)
    auto = cfg.parallel.layout == "auto"
    if auto:  # the planner picks the layout for the launched ranks (train/auto_layout.py)
        from fivefold.train import auto_layout

        cfg = auto_layout.resolve(cfg, args.hw_profile, int(os.environ.get("RANK", "0")) == 0)
    elif args.hw_profile:
        raise ConfigError("--hw-profile ranks layouts for parallel.layout = 'auto'; add "
                          "--parallel.layout auto or drop --hw-profile")
    if cfg.train.recompute == "auto":  # the planner's minimum, refused before anything is written
        from fivefold.plan.recompute_auto import config_plan

        config_plan(cfg)
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != cfg.parallel.world_size:  # before anything is written or joined
        raise ConfigError(
            f"{launched} process(es) launched but parallel.dp·tp·pp·cp = "
            f"{cfg.parallel.world_size}; launch with torchrun --nproc-per-node "
            f"{cfg.parallel.world_size} or change the layout")
    from fivefold.train import lifecycle
    from fivefold.train.rundir import open_run

    first_rank = int(os.environ.get("RANK", "0")) == 0
    run_dirs = open_run(cfg, first_rank, overwrite=args.overwrite)
    try:
        for note in run_dirs.notes:
            print(f"note: {note}", flush=True)
        from fivefold.parallel.mesh import ParallelDims, init_distributed

        lifecycle.warn_shared_store_restarts()
        rank, world = init_distributed(cfg.parallel.backend, cfg.parallel.timeout_s)
        if auto:
            auto_layout.check_agreement(cfg)
        dims = ParallelDims.from_config(cfg.parallel, rank)
        from fivefold.train.loop import run

        run(cfg, dims)
    except lifecycle.Terminated as stop:  # every rank agreed: a clean, collective end
        run_dirs.close()
        if first_rank:
            print(f"fivefold: {stop}", file=sys.stderr, flush=True)
        lifecycle.shutdown_distributed()
        return lifecycle.EXIT_TERMINATED
    except BaseException:
        run_dirs.close(failed=True)
        raise
    run_dirs.close()
    lifecycle.shutdown_distributed()  # success: every rank is here, nothing in flight
    return 0


def _subcommand(name: str):
    if name == "train":
        return train_main
    if name == "plan":
        from fivefold.plan.cli_entry import main
    elif name == "calibrate":
        from fivefold.calibrate import main
    elif name == "prepare":
        from fivefold.data.prepare import main
    elif name == "generate":
        from fivefold.train.generate import main
    elif name == "convert":
        from fivefold.models.convert import main
    elif name == "schedule":
        from fivefold.parallel.pipeline.draw import main
    elif name == "bench":
        from fivefold.train.bench import main
    elif name == "trace":
        from fivefold.trace.cli import main
    elif name == "eval":
        from fivefold.evaluate.cli import main
    elif name == "quantize":
        from fivefold.quant.cli import main
    elif name == "serve":
        from fivefold.serve.openai.api_server import main
    elif name == "launch":
        from fivefold.launch import main
    else:
        return None
    return main


EXIT_BAD_INPUT = 2  # a bad argument, config value or input file: nothing has started
EXIT_INTERNAL = 4  # an error nobody foresaw: one line here, the traceback with --debug
DEBUG_HINT = "rerun with --debug (or FIVEFOLD_DEBUG=1) to see the traceback"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def main(argv: list[str] | None = None) -> int:
    """Run one command; every failure ends as one line on stderr and an exit code:
    1 a run stopped for a reason it names, 2 a bad input, 3 a lost rank, 4 an unforeseen
    error (traceback with --debug), 130 interrupted, 143 stopped by SIGTERM."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("FIVEFOLD_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not argv:
        print(USAGE, file=sys.stderr)
        return EXIT_BAD_INPUT
    if argv[0] in ("-h", "--help") or argv == ["help"]:
        print(USAGE)
        return 0
    if argv[0] == "help":  # `fivefold help COMMAND` is `fivefold COMMAND --help`
        argv = [argv[1], "--help"]
    if argv[0] in ("-V", "--version"):
        from fivefold import __version__

        print(f"fivefold {__version__}")
        return 0
    command = _subcommand(argv[0])
    if command is None:
        print(f"error: unknown command '{argv[0]}'; commands: train, plan, calibrate, prepare, "
              f"generate, convert, schedule, bench, trace, eval, quantize, serve, launch, "
              f"help",
              file=sys.stderr)
        return EXIT_BAD_INPUT

    def leave_if_distributed(code: int) -> int:
        # Only a command that imported torch can have a process group up; `plan` never
        # imports torch (tests/test_plan_search.py), so it must not be imported here.
        if "torch.distributed" not in sys.modules:
            return code
        from fivefold.train.lifecycle import leave_if_distributed as leave

        return leave(code)

    # Under torchrun a failed run leaves without waiting on its peers (train/lifecycle.py).
    try:
        return leave_if_distributed(command(argv[1:]) or 0)
    except ConfigError as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return leave_if_distributed(EXIT_BAD_INPUT)
    except RunError as e:
        if debug:
            raise
        print(f"error: {_first_line(e)}", file=sys.stderr)
        return leave_if_distributed(e.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return leave_if_distributed(130)
    except Exception as e:
        if debug:
            raise
        print(f"error: {argv[0]} failed with {type(e).__name__}: {_first_line(e)[:300]}; "
              f"{DEBUG_HINT}", file=sys.stderr)
        return leave_if_distributed(EXIT_INTERNAL)


if __name__ == "__main__":
    sys.exit(main())
