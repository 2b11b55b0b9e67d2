"""[optim]: the keys of each optimizer other than AdamW (`train.optimizer` picks one).

AdamW, 8-bit and 4-bit AdamW take train.beta1, beta2, eps and weight_decay. Adafactor
(Shazeer & Stern 2018, arXiv 1804.04235) takes the `adafactor_*` keys, Muon (Jordan 2024;
Liu et al. 2025, "Muon is Scalable", arXiv 2502.16982) the `muon_*` keys plus train.beta1,
beta2 and eps for the AdamW that updates what Muon does not take (embeddings, head, norms,
biases, routers). A key of another optimizer, set away from its default, is refused: it
would be silently ignored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from fivefold.config.rules import choice, positive
from fivefold.errors import ConfigError

OPTIMIZERS = ("adamw", "adamw8bit", "adamw4bit", "adafactor", "muon")


@dataclass
class OptimSection:
    adafactor_factored: bool = True  # factor a matrix's second moment into rows and columns
    adafactor_beta2_decay: float = -0.8  # beta2 at step t is 1 - t^beta2_decay
    # The absolute step trains (+1.2% of AdamW's val loss at 300 steps, bench/train/
    # optimizers.py); the relative one at the default lr 3e-3 barely does (+36%).
    adafactor_relative_step: bool = False  # min(lr, 1/sqrt(t)) x RMS(W), else lr; paper: lr 1e-2
    adafactor_clip: float = 1.0  # update clipping threshold d (RMS of the update)
    adafactor_eps1: float = 0.0  # floor of the second moment (0: the fp32 machine epsilon)
    adafactor_eps2: float = 1e-3  # floor of a weight's RMS in the relative step
    muon_momentum: float = 0.95  # momentum of the matrices' update
    muon_nesterov: bool = True  # Nesterov momentum
    muon_ns_steps: int = 5  # Newton-Schulz iterations per matrix and step
    muon_ns_coefficients: str = "3.4445,-4.7750,2.0315"  # (a, b, c) of the quintic iteration
    muon_ns_dtype: str = "bf16"  # bf16 (as Jordan and torch) | fp32 (exact layout parity)
    muon_adjust_lr: str = "match_rms_adamw"  # match_rms_adamw (0.2 sqrt(max(A,B))) | original
    muon_adamw_lr: float = 0.0  # peak lr of the AdamW part (0: train.lr)
    muon_exclude: str = "embed_tokens,lm_head,norm,router"  # name parts kept on AdamW


def ns_coefficients(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(math.isfinite(v) for v in values):
        raise ConfigError(f"optim.muon_ns_coefficients = '{text}' must be three finite "
                          f"numbers a,b,c; e.g. 3.4445,-4.7750,2.0315")
    return values  # type: ignore[return-value]


def owner(key: str) -> str | None:
    """The optimizer an [optim] key belongs to."""
    return key.split("_", 1)[0] if key.startswith(("adafactor_", "muon_")) else None


def check_optim(cfg) -> None:
    tr, oc = cfg.train, cfg.optim
    choice("train.optimizer", tr.optimizer, OPTIMIZERS)
    defaults = OptimSection()
    for f in dataclasses.fields(oc):
        who = owner(f.name)
        if who != tr.optimizer and getattr(oc, f.name) != getattr(defaults, f.name):
            raise ConfigError(f"optim.{f.name} is a key of {who}, not of train.optimizer = "
                              f"{tr.optimizer}; remove it or set train.optimizer = {who}")
    if tr.optimizer == "adafactor":
        from fivefold.config.train import TrainSection

        plain = TrainSection()
        for key in ("beta1", "beta2", "eps"):
            if getattr(tr, key) != getattr(plain, key):
                raise ConfigError(f"train.{key} does not apply to train.optimizer = adafactor "
                                  f"(no first moment; its second moment's decay is "
                                  f"optim.adafactor_beta2_decay); remove it")
        if oc.adafactor_beta2_decay >= 0:
            raise ConfigError(f"optim.adafactor_beta2_decay = {oc.adafactor_beta2_decay} "
                              f"must be < 0 (the paper's -0.8)")
        positive("optim.adafactor_clip", oc.adafactor_clip)
        positive("optim.adafactor_eps1", oc.adafactor_eps1, allow_zero=True)
        positive("optim.adafactor_eps2", oc.adafactor_eps2)
    if tr.optimizer == "muon":
        if not 0 <= oc.muon_momentum < 1:
            raise ConfigError(f"optim.muon_momentum = {oc.muon_momentum} must lie in [0, 1)")
        if not 1 <= oc.muon_ns_steps < 100:
            raise ConfigError(f"optim.muon_ns_steps = {oc.muon_ns_steps} must lie in "
                              f"[1, 100); 5 is the usual")
        ns_coefficients(oc.muon_ns_coefficients)
        choice("optim.muon_ns_dtype", oc.muon_ns_dtype, ("bf16", "fp32"))
        choice("optim.muon_adjust_lr", oc.muon_adjust_lr, ("match_rms_adamw", "original"))
        positive("optim.muon_adamw_lr", oc.muon_adamw_lr, allow_zero=True)
    if tr.optimizer != "adamw" and str(cfg.parallel.offload) == "nvme":
        raise ConfigError(f"parallel.offload = nvme streams AdamW's states only; with "
                          f"train.optimizer = {tr.optimizer} use offload = cpu (or none)")
