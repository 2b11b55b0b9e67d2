"""[lora]: LoRA / QLoRA fine-tuning (finetune/), and its rules.

rank = 0 (the default) trains every weight; rank > 0 freezes the base and trains adapters
on the linears `targets` names. `base` stores the frozen base weights as they are (none), in
NF4 with double quantisation (nf4, QLoRA) or in int8 (int8). `init_from` starts the adapters
from a PEFT adapter directory, whose adapter_config.json then decides rank, alpha, targets
and rslora (a mismatch with keys set here is refused).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from fivefold.config.rules import choice, positive
from fivefold.errors import ConfigError

LORA_BASES = ("none", "nf4", "int8")
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
NF4_BLOCK = 64  # numerics/nf4.py NF4_BLOCK_SIZE (QLoRA's block); config imports no torch


@dataclass
class LoraSection:
    rank: int = 0  # 0: no adapters (full fine-tuning); r > 0: LoRA of rank r
    alpha: float = 16.0  # the update is scaled by alpha / rank (alpha / sqrt(rank): rslora)
    dropout: float = 0.0  # on the adapter's input only
    targets: str = DEFAULT_TARGETS  # comma list of module names, or all-linear
    base: str = "none"  # none | nf4 | int8: how the frozen base weights are stored
    rslora: bool = False  # scale by alpha / sqrt(rank) (rank-stabilised LoRA) instead
    init_from: str = ""  # a PEFT adapter directory (adapter_config.json + safetensors)


def adapter_settings(directory: str) -> dict:
    """rank, alpha, targets, rslora, dropout from a PEFT adapter_config.json (no torch)."""
    path = Path(directory) / "adapter_config.json"
    if not path.is_file():
        raise ConfigError(f"lora.init_from = '{directory}' has no adapter_config.json; give a "
                          f"PEFT adapter directory (PeftModel.save_pretrained writes one)")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"lora.init_from: {path} is not JSON ({e.msg}); re-save the "
                          f"adapter") from None
    if str(config.get("peft_type", "")).upper() != "LORA" or "r" not in config:
        raise ConfigError(f"lora.init_from: {path} is not a LoRA adapter (peft_type "
                          f"{config.get('peft_type')!r}); give a LoRA adapter directory")
    targets = config.get("target_modules") or ""
    return {"rank": int(config["r"]), "alpha": float(config.get("lora_alpha", config["r"])),
            "targets": targets if isinstance(targets, str) else ",".join(sorted(targets)),
            "rslora": bool(config.get("use_rslora", False)),
            "dropout": float(config.get("lora_dropout", 0.0))}


def check_lora(cfg, mc=None) -> None:
    """Adapter shape and storage; a quantised base needs pretrained weights to quantise.
    `mc` (the resolved model shape) lets an NF4 base under tp be checked shard by shard."""
    lo = cfg.lora
    if lo.init_from:
        settings = adapter_settings(lo.init_from)
        lo.init_from = str(Path(lo.init_from).resolve())  # absolute in the run's metadata
        defaults = LoraSection()
        for key, value in settings.items():  # what the adapter was made with decides
            mine = getattr(lo, key)
            if mine != getattr(defaults, key) and mine != value:
                raise ConfigError(f"lora.{key} = {mine!r} but the adapter in lora.init_from "
                                  f"was made with {value!r}; drop lora.{key} or set it to "
                                  f"{value!r}")
            setattr(lo, key, value)
    if lo.rank < 0 or (lo.rank == 0 and (lo.base != "none" or lo.init_from)):
        raise ConfigError(f"lora.rank = {lo.rank} must be a positive integer (e.g. 8 or 16) "
                          f"to train adapters")
    if lo.rank == 0:
        return
    if cfg.train.precision == "fp8":  # the adapters' own small GEMMs would run in FP8 too
        raise ConfigError("lora.rank > 0 with train.precision = 'fp8': FP8 training would "
                          "quantise the adapters' own GEMMs as well, which no LoRA recipe "
                          "does; use train.precision = 'bf16' (or lora.base = 'nf4' for a "
                          "low-precision base)")
    positive("lora.alpha", lo.alpha)
    if not 0 <= lo.dropout < 1:
        raise ConfigError(f"lora.dropout = {lo.dropout} must lie in [0, 1)")
    if not [t for t in lo.targets.split(",") if t.strip()]:
        raise ConfigError("lora.targets is empty; name modules, e.g. "
                          "'q_proj,k_proj,v_proj,o_proj', or 'all-linear'")
    choice("lora.base", lo.base, LORA_BASES)
    par = cfg.parallel
    if lo.base == "nf4" and par.tp > 1 and mc is not None:
        check_nf4_shards(mc, par.tp, lo.targets)
    if lo.dropout > 0 and par.tp > 1:  # each tp rank would draw its own mask of one input
        raise ConfigError(f"lora.dropout = {lo.dropout} with parallel.tp = {par.tp} is not "
                          f"supported (the ranks' masks would differ); use lora.dropout = 0")
    if par.ep > 1 or par.cp > 1:
        raise ConfigError("lora.rank > 0 runs with parallel.ep = 1 and parallel.cp = 1 for "
                          "now; set them to 1")
    if lo.base != "none" and not (cfg.model.hf_path or cfg.model.init_from):
        raise ConfigError(f"lora.base = {lo.base} quantises pretrained weights, but "
                          f"model.hf_path and model.init_from are empty; set one to the base "
                          f"model (or lora.base = none)")


def check_nf4_shards(mc, tp: int, targets: str) -> None:
    """Under tp each rank quantises its own shard of a targeted linear (finetune/
    tensor_parallel.py), so NF4's blocks of 64 must tile the shard: a shard of another size
    would end in a padded block that no whole-tensor layout has. int8 (one scale per output
    row of the shard) holds any shard."""
    d, h, f = mc.dim_per_head, mc.hidden_size, mc.intermediate_size
    q, kv = mc.num_heads * d // tp, max(mc.num_kv_heads // tp, 1) * d
    shards = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q)}
    if not mc.num_experts:
        shards.update(gate_proj=(f // tp, h), up_proj=(f // tp, h), down_proj=(h, f // tp))
    wanted = {t.strip() for t in targets.split(",") if t.strip()}
    for name, (rows, cols) in shards.items():
        if ("all-linear" in wanted or name in wanted) and (rows * cols) % NF4_BLOCK:
            raise ConfigError(f"lora.base = nf4 with parallel.tp = {tp}: each rank's shard of "
                              f"{name} is {rows}x{cols} = {rows * cols} weights, not a "
                              f"multiple of the NF4 block ({NF4_BLOCK}); pick another "
                              f"parallel.tp or lora.base = int8")
