"""Every check of a config, in one place and in one order: the model, the layout, the
training shape, then the files. Each section's rules sit beside its keys (model.py,
parallel.py, train.py, data.py, output.py); this module only orders them."""

from __future__ import annotations

import copy

from fivefold.config.data import check_data
from fivefold.config.lora import check_lora
from fivefold.config.model import check_model
from fivefold.config.optim import check_optim
from fivefold.config.output import check_output
from fivefold.config.parallel import ParallelSection, check_offload_dir, check_parallel
from fivefold.config.rules import choice, positive
from fivefold.config.schema import Config, given_keys
from fivefold.config.train import check_budget_is_used, check_train
from fivefold.errors import ConfigError


def validate(cfg: Config) -> None:
    """Every check of a config. Raises ConfigError with a one-line fix. Under parallel.layout
    = auto the layout is checked once the planner has picked it (for the launched ranks):
    here the rest of the config is checked on one rank, and each parallel key that is set
    on its own."""
    choice("parallel.layout", cfg.parallel.layout, ("manual", "auto"))
    check_budget_is_used(cfg)
    if cfg.parallel.layout == "auto":
        validate_layout(auto_baseline(cfg))
    else:
        validate_layout(cfg)
    check_data(cfg)
    check_output(cfg)
    check_offload_dir(cfg)


# The keys parallel.layout = auto chooses (train.recompute too), as plain values of one rank.
AUTO_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "mbs", "schedule", "virtual_stages", "sp",
             "offload", "cp_comm", "sp_saved_input", "pp_split", "pp_layers", "grad_sync")


def auto_baseline(cfg: Config) -> Config:
    """A copy of an auto config on one rank with default layout keys (the chosen layout is
    validated in full later), after the choice-valued keys that are set pass on their own."""
    given = given_keys(cfg)
    par = cfg.parallel
    for key, allowed in (("schedule", ("afab", "1f1b", "interleaved", "zb", "dualpipev")),
                         ("cp_comm", ("ring", "allgather")), ("sp_saved_input", ("full", "shard")),
                         ("grad_sync", ("auto", "step", "microbatch")),
                         ("pp_split", ("even", "balanced"))):
        choice(f"parallel.{key}", getattr(par, key), allowed)
    for key in ("dp", "tp", "pp", "cp", "ep", "virtual_stages"):
        if f"parallel.{key}" in given:
            positive(f"parallel.{key}", getattr(par, key))
    if par.zero not in (0, 1, 2, 3):
        raise ConfigError(f"parallel.zero = {par.zero} is not a ZeRO stage; use 0, 1, 2 or 3")
    base = copy.deepcopy(cfg)
    fresh = ParallelSection()
    for key in AUTO_KEYS:
        setattr(base.parallel, key, getattr(fresh, key))
    base.parallel.offload = "none" if par.offload != "nvme" else "nvme"
    if base.parallel.offload == "nvme":
        base.parallel.zero = 1
    if cfg.train.recompute == "auto" and cfg.train.memory_budget_gib <= 0:
        base.train.recompute = "none"  # the budget is the device's free memory (auto_layout)
    return base


def validate_layout(cfg: Config) -> None:
    """The checks of the model, the parallel layout and the training shape (no files)."""
    mc = check_model(cfg)
    check_parallel(cfg, mc)
    check_train(cfg, mc)
    check_optim(cfg)
    check_lora(cfg, mc)


def engine_refusal(cfg: Config) -> str | None:
    """Why `fivefold train` would refuse this config's model, layout and batch, or None. The
    planner asks it before recommending a layout, so it never suggests what train refuses."""
    try:
        validate_layout(cfg)
    except ConfigError as e:
        return str(e)
    return None
