"""The FP8 keys of [train] and their rules (the keys are fields of TrainSection).

    precision = "fp8"        bf16 parameters and activations, fp32 master weights and
                             optimizer states (as bf16), and FP8 GEMMs in every linear
                             layer not kept out (lowp/)
    fp8_recipe               "blockwise" (DeepSeek-V3: 1x128 tiles, 128x128 weight blocks),
                             "rowwise" or "tensorwise" (torchao's recipes)
    fp8_grad_format          "auto" (the recipe's own: e5m2 for tensorwise, e4m3 for the
                             others), "e4m3" or "e5m2": the format of the output gradient
    fp8_keep_out             comma list of module-name patterns whose linears stay in bf16,
                             on top of what always does (embedding, output head, norms,
                             attention's softmax, MoE routers and gates)

Rules, each a one-line ConfigError:
  - an unknown recipe or gradient format;
  - FP8 keys set while precision is not fp8. In particular fp8 with fp16 is refused:
    precision is one key, "fp8" runs the non-FP8 parts in bf16 (DeepSeek-V3 §3.3), and an
    FP8 GEMM under fp16's loss scale would have to fit two scalings in one range;
  - blockwise under tensor parallelism where a rank's shard of a split dimension is not a
    multiple of 128: a 128-wide tile or 128x128 block would straddle the tp cut, so the
    ranks would quantise other groups than one device does. Rowwise and tensorwise have
    no blocks to straddle.
  - parallel.fp8_allgather without zero = 3, precision fp8 and the tensorwise recipe (one
    scale per weight, so a rank's shard casts as the whole weight does; torchao does the
    FP8 all-gather for tensorwise only).
A keep-out pattern that matches no linear of the model is refused when the model is built
(lowp/convert.py), where the module names exist.
"""

from __future__ import annotations

from fivefold.config.rules import choice
from fivefold.errors import ConfigError

FP8_RECIPES = ("blockwise", "rowwise", "tensorwise")
FP8_GRAD_FORMATS = ("auto", "e4m3", "e5m2")
FP8_BLOCK = 128  # DeepSeek-V3's tile and block edge (numerics/formats.py, which needs torch)
FP8_DEFAULTS = {"fp8_recipe": "blockwise", "fp8_grad_format": "auto", "fp8_keep_out": ""}


def check_fp8(cfg, mc) -> None:
    tr = cfg.train
    choice("train.fp8_recipe", tr.fp8_recipe, FP8_RECIPES)
    if cfg.parallel.fp8_allgather and (cfg.parallel.zero != 3 or tr.precision != "fp8"
                                       or tr.fp8_recipe != "tensorwise"):
        raise ConfigError(f"parallel.fp8_allgather = true needs parallel.zero = 3, "
                          f"train.precision = 'fp8' and train.fp8_recipe = 'tensorwise' (got "
                          f"zero = {cfg.parallel.zero}, precision = '{tr.precision}', recipe "
                          f"= '{tr.fp8_recipe}'); set those or parallel.fp8_allgather = false")
    choice("train.fp8_grad_format", tr.fp8_grad_format, FP8_GRAD_FORMATS)
    if tr.precision != "fp8":
        for key, default in FP8_DEFAULTS.items():
            value = getattr(tr, key)
            if value != default:
                why = (" (fp8 keeps bf16 outside its GEMMs; fp16 with FP8 is not supported)"
                       if tr.precision == "fp16" else "")
                raise ConfigError(f"train.{key} = '{value}' needs train.precision = 'fp8', "
                                  f"not '{tr.precision}'{why}; set train.precision = 'fp8' "
                                  f"or drop train.{key}")
        return
    if tr.fp8_recipe == "blockwise" and cfg.parallel.tp > 1:
        check_block_cuts(cfg.parallel.tp, mc)


def check_block_cuts(tp: int, mc) -> None:
    """Each split dimension of a tensor-parallel linear must leave whole 128-blocks per rank."""
    kv_local = mc.kv_size // tp if mc.num_kv_heads >= tp else mc.dim_per_head
    for what, size, local in (("q/o projections (num_heads x head_dim)", mc.q_size,
                               mc.q_size // tp),
                              ("k/v projections", mc.kv_size, kv_local),
                              ("model.intermediate_size", mc.intermediate_size,
                               mc.intermediate_size // tp)):
        if local % FP8_BLOCK:
            raise ConfigError(f"train.fp8_recipe = 'blockwise' with parallel.tp = {tp}: the "
                              f"{what} of {size} split {tp} ways gives {local} per rank, "
                              f"cutting a 128-wide FP8 block; use a tp that leaves multiples "
                              f"of 128, or fp8_recipe = 'rowwise'")
