"""Every check of a config, in one place and in one order: the model, the layout, the
training shape, then the files. Each section's rules sit beside its keys (model.py,
parallel.py, train.py, data.py, output.py); this module only orders them."""

from __future__ import annotations

from fivefold.config.data import check_data
from fivefold.config.lora import check_lora
from fivefold.config.model import check_model
from fivefold.config.optim import check_optim
from fivefold.config.output import check_output
from fivefold.config.parallel import check_offload_dir, check_parallel
from fivefold.config.schema import Config
from fivefold.config.train import check_train
from fivefold.errors import ConfigError


def validate(cfg: Config) -> None:
    """Every check of a config. Raises ConfigError with a one-line fix."""
    validate_layout(cfg)
    check_data(cfg)
    check_output(cfg)
    check_offload_dir(cfg)


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
