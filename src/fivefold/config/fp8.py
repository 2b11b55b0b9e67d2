"""The FP8 keys of [train] and their rules (the keys are fields of TrainSection).

    precision = "fp8"        bf16 parameters and activations, fp32 master weights and
                             optimizer states (as bf16), and FP8 GEMMs in every linear
                             layer not kept out (lowp/)
    fp8_recipe               "blockwise" (DeepSeek-V3: 1x128 tiles, 128x128 weight blocks),
                             "rowwise", "rowwise_gw_hp" (the weight gradient in bf16:
                             torchao's ROWWISE_WITH_GW_HP) or "tensorwise" (torchao's)
    fp8_scaling              "dynamic" (default: each cast's scale from the tensor's own
                             amax) or "delayed" (tensorwise only: from an amax history of
                             earlier steps, Transformer Engine's DelayedScaling; lowp/delayed.py)
    fp8_history_len          delayed scaling's history length in steps (default 16, 1..1024)
    fp8_grad_format          "auto" (the recipe's own: e5m2 for tensorwise, e4m3 for the
                             others), "e4m3" or "e5m2": the format of the output gradient
    fp8_keep_out             comma list of module-name patterns whose linears stay in bf16,
                             on top of what always does (embedding, output head, norms,
                             attention's softmax, MoE routers and gates)
    fp8_kernel               blockwise only: "scaled_mm" runs its GEMMs on cuBLASLt's
                             blockwise FP8 kernel (CUDA, compute capability 9.x; weights in
                             whole 128x128 blocks), "emulated" in 128-wide K slices on any
                             device, "auto" (default) the kernel where the device and every
                             FP8 weight allow it, else the emulation (lowp/convert.py says
                             which, in one line, when the model is built)

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
  - fp8_kernel other than "auto" with a recipe other than blockwise (tensorwise and
    rowwise always run torch._scaled_mm); fp8_kernel = "scaled_mm" with train.device =
    "cpu" or a model width (hidden, q/o, k/v, MLP, expert widths; per tp rank) that is not
    a multiple of 128. Whether the device has the kernel is known only on it: lowp/convert.py
    refuses there, in one line too.
  - fp8_scaling = "delayed" with a recipe other than tensorwise; fp8_history_len outside
    1..1024 or set with dynamic scaling. With parallel.fp8_allgather the gather casts each
    linear's weight, and each routed expert's, with its history's scale
    (parallel/zero3_fp8.py). Routed experts keep a history per expert and projection.
    Under dp, cp and tp the step's amax records are reduced over a pipeline stage's ranks
    (lowp/delayed.py; every rank without pp); recomputation records idempotently (the
    same scale, the same amax folded again).
A keep-out pattern that matches no linear of the model is refused when the model is built
(lowp/convert.py), where the module names exist, and by `fivefold plan`, which writes the
names the engine's model gives (plan/fp8_linears.py); both match with `keep_out_matches`.
"""

from __future__ import annotations

import fnmatch

from fivefold.config.rules import choice
from fivefold.errors import ConfigError

FP8_RECIPES = ("blockwise", "rowwise", "rowwise_gw_hp", "tensorwise")
FP8_SCALINGS = ("dynamic", "delayed")
MAX_HISTORY_LEN = 1024  # Transformer Engine's default amax_history_len
FP8_GRAD_FORMATS = ("auto", "e4m3", "e5m2")
FP8_BLOCK = 128  # DeepSeek-V3's tile and block edge (numerics/formats.py, which needs torch)
FP8_KERNELS = ("auto", "scaled_mm", "emulated")
FP8_DEFAULTS = {"fp8_recipe": "blockwise", "fp8_grad_format": "auto", "fp8_keep_out": "",
                "fp8_kernel": "auto", "fp8_scaling": "dynamic", "fp8_history_len": 16}
# Linears kept in high precision by name whatever train.fp8_keep_out says: the output head
# and a shared expert's gate (lowp/convert.py; DeepSeek-V3 §3.3.1).
ALWAYS_KEPT_OUT = ("lm_head", "*.shared_expert_gate")


def parse_keep_out(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def keep_out_matches(name: str, pattern: str) -> bool:
    """Whether keep-out `pattern` names module `name`: an fnmatch of the name, or of a module
    above it ("layers.0" keeps out the first block), or a bare leaf name anywhere
    ("down_proj"). The engine (lowp/convert.py) and the planner (plan/fp8_linears.py) both
    match with this."""
    return (fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, pattern + ".*")
            or ("." not in pattern and name.rsplit(".", 1)[-1] == pattern))


def unmatched_keep_out(names, patterns) -> str:
    """The one-line error for the first keep-out pattern that names none of `names` (the
    model's FP8-capable modules), or "" when each names one: a typo would otherwise
    silently change nothing."""
    for pattern in patterns:
        if not any(keep_out_matches(name, pattern) for name in names):
            return (f"train.fp8_keep_out pattern '{pattern}' matches no linear layer of the "
                    f"model; name modules such as 'q_proj', 'layers.0', '*.down_proj' or "
                    f"'experts'")
    return ""


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
    choice("train.fp8_kernel", tr.fp8_kernel, FP8_KERNELS)
    choice("train.fp8_scaling", tr.fp8_scaling, FP8_SCALINGS)
    if not (isinstance(tr.fp8_history_len, int) and 1 <= tr.fp8_history_len <= MAX_HISTORY_LEN):
        raise ConfigError(f"train.fp8_history_len = {tr.fp8_history_len} must be an integer in "
                          f"1..{MAX_HISTORY_LEN} (steps of amax history); e.g. 16")
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
    if tr.fp8_kernel != "auto" and tr.fp8_recipe != "blockwise":
        raise ConfigError(f"train.fp8_kernel = '{tr.fp8_kernel}' applies to fp8_recipe = "
                          f"'blockwise' only (tensorwise and rowwise always run "
                          f"torch._scaled_mm); drop train.fp8_kernel")
    if tr.fp8_kernel == "scaled_mm":
        check_kernel_shapes(cfg, mc)
    check_scaling(cfg, mc)


def check_scaling(cfg, mc) -> None:
    """train.fp8_scaling and fp8_history_len (the module docstring's rules)."""
    tr = cfg.train
    if tr.fp8_scaling == "dynamic":
        if tr.fp8_history_len != FP8_DEFAULTS["fp8_history_len"]:
            raise ConfigError(f"train.fp8_history_len = {tr.fp8_history_len} applies to "
                              f"train.fp8_scaling = 'delayed' only; set fp8_scaling = 'delayed' "
                              f"or drop train.fp8_history_len")
        return
    if tr.fp8_recipe != "tensorwise":
        raise ConfigError(f"train.fp8_scaling = 'delayed' with train.fp8_recipe = "
                          f"'{tr.fp8_recipe}': delayed scaling keeps one amax per tensor, for "
                          f"the tensorwise recipe only; set fp8_recipe = 'tensorwise' or "
                          f"fp8_scaling = 'dynamic'")


def check_kernel_shapes(cfg, mc) -> None:
    """fp8_kernel = 'scaled_mm': cuBLASLt's blockwise GEMM takes weights in whole 128x128
    blocks (numerics/fp8_kernel.py), so every FP8 weight's local dims are multiples of 128."""
    if cfg.train.device == "cpu":
        raise ConfigError("train.fp8_kernel = 'scaled_mm' with train.device = 'cpu': the "
                          "blockwise FP8 kernel is CUDA-only (compute capability 9.x); use "
                          "fp8_kernel = 'auto' or 'emulated'")
    tp = cfg.parallel.tp
    widths = [("model.hidden_size", mc.hidden_size, mc.hidden_size),
              ("q/o projections (num_heads x head_dim)", mc.q_size, mc.q_size // tp),
              ("k/v projections (num_kv_heads x head_dim)", mc.kv_size,
               mc.kv_size // tp if mc.num_kv_heads >= tp else mc.dim_per_head),
              ("model.intermediate_size", mc.intermediate_size, mc.intermediate_size // tp)]
    if mc.num_experts:
        widths.append(("model.moe_intermediate_size", mc.moe_intermediate_size,
                       mc.moe_intermediate_size))
    if mc.shared_expert_intermediate_size:
        widths.append(("model.shared_expert_intermediate_size",
                       mc.shared_expert_intermediate_size, mc.shared_expert_intermediate_size))
    for what, size, local in widths:
        if local % FP8_BLOCK:
            per_rank = f" ({local} per tp rank)" if local != size else ""
            raise ConfigError(f"train.fp8_kernel = 'scaled_mm': {what} = {size}{per_rank} is "
                              f"not a multiple of {FP8_BLOCK}, and cuBLASLt's blockwise FP8 "
                              f"GEMM takes weights in whole 128x128 blocks; use fp8_kernel = "
                              f"'auto' (emulated for such shapes) or widths that are multiples "
                              f"of {FP8_BLOCK}")


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
