"""`fivefold launch`: start a multi-rank run through torchrun's own launcher, set up right.

    fivefold launch [--nproc-per-node N] [--nnodes N] [--node-rank R]
                    [--rdzv-endpoint HOST:PORT] [--rdzv-id ID] [--max-restarts K] COMMAND ...

runs `fivefold COMMAND ...` (train, bench, serve) on N local ranks through
`torch.distributed.run` (torchrun's argument parser and `elastic_launch`, the launcher
torchrun itself is), with what a fivefold run needs set for it:

- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: torchrun otherwise shares its rendezvous store with
  the workers and keeps the previous attempt's keys there, so a worker restarted under
  `--max-restarts` can be handed the address of a peer that died (pytorch/pytorch#135712)
  and the restart fails in `init_process_group`;
- one node without a rendezvous endpoint is `--standalone` (a local c10d store on a free
  port), several nodes use a c10d rendezvous at `--rdzv-endpoint`;
- `--nproc-per-node` defaults to the layout's world size (parallel.dp·tp·pp·cp of the
  train config given after COMMAND, or serve's --tp) divided by the number of nodes; given,
  it is checked against the layout (with parallel.layout = auto: that a layout of that many
  ranks exists), so a bad config is one line before any rank starts.

The launcher's exit code is the first failed rank's (2 for a bad input, 3 for a lost rank,
…), or 0. Stopped by SIGTERM or Ctrl-C, it passes the signal on to every rank, waits for them
and ends as the command would: 0 for `serve`, 143 / 130 for a run stopped early. Plain
`torchrun -m fivefold.cli train ...` keeps working as before.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from fivefold.config import ArgumentParser, ConfigError

COMMANDS = ("train", "bench", "serve")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="fivefold launch", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run `fivefold COMMAND ...` on several ranks through torchrun's launcher, "
                    "with restarts that reconnect (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1).",
        epilog="examples:\n  fivefold launch train --parallel.dp 2 --parallel.tp 2\n"
               "  fivefold launch --max-restarts 3 train --config run.toml\n"
               "  fivefold launch --nnodes 2 --node-rank $NODE_RANK --rdzv-endpoint "
               "$HEAD:29500 --rdzv-id $JOB train --config run.toml")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="ranks on this node (default: the layout's world size / nnodes)")
    p.add_argument("--nnodes", type=int, default=1, help="number of nodes (default 1)")
    p.add_argument("--node-rank", type=int, default=None,
                   help="this node's rank (default: assigned by the rendezvous)")
    p.add_argument("--rdzv-endpoint", default="",
                   help="HOST:PORT of the c10d rendezvous (needed with --nnodes > 1)")
    p.add_argument("--rdzv-id", default="fivefold", help="the job's id, the same on every node")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart every rank this many times after a failure (default 0); a "
                        "restarted run resumes from its newest complete checkpoint")
    p.add_argument("--monitor-interval", type=float, default=0.5,
                   help="seconds between checks of the ranks' health (default 0.5)")
    p.add_argument("command", choices=COMMANDS, help="the fivefold command each rank runs")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def layout_world_size(command: str, args: list[str], launched: int | None = None,
                      per_node: int = 1) -> int:
    """parallel.dp·tp·pp·cp of the config `fivefold train ARGS` would run (validated);
    for serve, its --tp (rank 0 serves HTTP, the others hold the other shards). With
    `launched` (--nproc-per-node × --nnodes) the layout must take that many ranks: checked
    here, once, rather than by every rank after it has started."""
    from fivefold import config

    if command == "serve":  # --pp stages of --tp ranks each (serve/pp_worker.py)
        serve = argparse.ArgumentParser(add_help=False)
        serve.add_argument("--tp", type=int, default=1)
        serve.add_argument("--pp", type=int, default=1)
        opts = serve.parse_known_args(args)[0]
        ranks = opts.tp * opts.pp
        layout = " ".join(f"--{k} {v}" for k, v in (("pp", opts.pp), ("tp", opts.tp))
                          if v > 1 or k == "tp" and opts.pp == 1)
        if launched is not None and launched != ranks:
            raise ConfigError(f"fivefold launch starts {launched} rank(s) but serve {layout}"
                              f" uses {ranks}; give --nproc-per-node {ranks} or change "
                              f"{layout}")
        return ranks

    known = argparse.ArgumentParser(add_help=False)
    known.add_argument("--config")
    known.add_argument("--hw-profile")
    known.add_argument("--run-name")
    known.add_argument("--overwrite", action="store_true")
    if command == "bench":
        known.add_argument("--preset")
    opts, overrides = known.parse_known_args(args)
    overrides = [a for a in overrides if a != "--debug"]
    if command == "train":  # a misspelt option, as train itself names it
        config.check_options(overrides, known)
    if opts.run_name is not None:
        overrides = [*config.run_name_overrides(opts.run_name), *overrides]
    cfg = config.load(opts.config, overrides)
    if cfg.parallel.layout == "auto":  # the planner picks the layout for the ranks started
        if launched is None:
            raise ConfigError("parallel.layout = 'auto' picks the layout for the ranks "
                              "launched: give fivefold launch --nproc-per-node N")
        import torch

        from fivefold.plan.auto_layout import check_ranks

        cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto"
                                              and torch.cuda.is_available())
        precision = cfg.train.precision
        if precision == "auto":  # memory aside, the shapes a layout may take do not hang on it
            precision = "bf16" if cuda else "fp32"
        check_ranks(cfg, launched, per_node, not cuda, precision)
        return launched
    if launched is not None and launched != cfg.parallel.world_size:
        nodes = launched // per_node
        raise ConfigError(f"fivefold launch starts {launched} rank(s) but parallel.dp·tp·pp·cp"
                          f" = {cfg.parallel.world_size}; give --nproc-per-node "
                          f"{cfg.parallel.world_size / nodes:g}" + (f" on each of {nodes} nodes"
                          if nodes > 1 else "") + " or change the layout")
    return cfg.parallel.world_size


def torchrun_argv(opts, nproc: int) -> list[str]:
    """The same launch written as torchrun's own arguments."""
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={opts.nnodes}",
            f"--max-restarts={opts.max_restarts}", f"--monitor-interval={opts.monitor_interval}"]
    if opts.nnodes == 1 and not opts.rdzv_endpoint:
        argv.append("--standalone")
    else:
        argv += ["--rdzv-backend=c10d", f"--rdzv-endpoint={opts.rdzv_endpoint}",
                 f"--rdzv-id={opts.rdzv_id}"]
        if opts.node_rank is not None:
            argv.append(f"--node-rank={opts.node_rank}")
    return [*argv, "-m", "fivefold.cli", opts.command, *opts.args]


def check(opts) -> None:
    for key, value, low in (("--nproc-per-node", opts.nproc_per_node, 1),
                            ("--nnodes", opts.nnodes, 1), ("--max-restarts", opts.max_restarts, 0)):
        if value is not None and value < low:
            raise ConfigError(f"{key} {value} must be >= {low}")
    if opts.nnodes > 1 and not opts.rdzv_endpoint:
        raise ConfigError(f"--nnodes {opts.nnodes} needs --rdzv-endpoint HOST:PORT (the same "
                          f"on every node, e.g. the first node's address and port 29500)")
    if opts.node_rank is not None and not 0 <= opts.node_rank < opts.nnodes:
        raise ConfigError(f"--node-rank {opts.node_rank} must lie in [0, --nnodes "
                          f"{opts.nnodes})")


def main(argv: list[str] | None = None) -> int:
    try:
        opts = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error, or the help
        return int(e.code or 0)
    if opts.args[:1] == ["--"]:
        opts.args = opts.args[1:]
    check(opts)
    nproc = opts.nproc_per_node
    if nproc is None:
        world = layout_world_size(opts.command, opts.args)
        if world % opts.nnodes:
            raise ConfigError(f"the layout's {world} ranks do not split evenly over --nnodes "
                              f"{opts.nnodes}; give --nproc-per-node or change the layout")
        nproc = world // opts.nnodes
    else:
        layout_world_size(opts.command, opts.args, nproc * opts.nnodes, nproc)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(torchrun_argv(opts, nproc)))
    except SignalException as e:
        # The launcher has passed the signal on to every rank and waited for them (the elastic
        # agent's shutdown). The exit code is then what the command itself gives for it: a
        # server's stop is its normal end (`fivefold serve` exits 0 on SIGTERM and Ctrl-C), a
        # training run stopped early says so (130 / 143, train/lifecycle.py).
        sig = signal.Signals(e.sigval)
        if opts.command == "serve":
            return 0
        print(f"fivefold launch: stopped by {sig.name}; every rank was sent it and has ended",
              file=sys.stderr, flush=True)
        return 128 + int(sig)
    except ChildFailedError as e:
        rank, failure = min(e.failures.items())
        code = failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
        print(f"fivefold launch: rank {rank} ended with exit code {code} (its own line above "
              f"says why); the run stopped", file=sys.stderr, flush=True)
        return code
    return 0
