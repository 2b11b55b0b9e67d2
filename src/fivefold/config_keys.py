"""Every config key with its default and meaning, for `fivefold train --help`.

The meaning is the comment on the key's line in the config dataclasses (one module of the
config package per section, models/presets.py for the model fields), so the help cannot
drift from the code; `MEANINGS` fills in the keys whose names say it all to a reader of the
source but not to a user at the command line. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

from fivefold import config
from fivefold.models.presets import ModelConfig, preset

MEANINGS = {
    "model.preset": "a built-in model shape (tiny-bpe, tiny, llama-3.1-8b, ...)",
    "model.hf_path": "a local Hugging Face model directory (config.json + safetensors) to "
                     "train from",
    "model.init_from": "a fivefold checkpoint (a step_* directory or a checkpoint.dir) whose "
                       "weights start this run, with a fresh optimizer at step 0",
    "parallel.layout": "manual: the [parallel] keys are the layout; auto: the planner picks it "
                       "for the launched ranks, keeping every parallel key that is set",
    "parallel.dp": "data-parallel replicas",
    "parallel.tp": "tensor-parallel ranks (within a node)",
    "parallel.pp": "pipeline stages",
    "parallel.cp": "context-parallel ranks (the sequence is split over them)",
    "parallel.ep": "expert-parallel ranks (mixture-of-experts models)",
    "parallel.sp_saved_input": "full | shard: what SP column linears keep for backward",
    "train.steps": "optimizer steps of the run (the lr schedule spans them)",
    "train.seq_len": "tokens per sequence",
    "train.lr": "peak learning rate",
    "train.min_lr": "learning rate at the end of the decay",
    "train.weight_decay": "AdamW decoupled weight decay (not on norms and biases)",
    "train.beta1": "AdamW first-moment decay",
    "train.beta2": "AdamW second-moment decay",
    "train.eps": "AdamW epsilon",
    "train.seed": "seed of weights, data order and sampling (0 to 2**32 - 1)",
    "train.deterministic": "use only deterministic kernels (slower on GPU)",
    "train.eval_batches": "held-out global batches per validation",
    "data.val_fraction": "share of the token file held out for validation",
    "checkpoint.dir": "where checkpoints are written (step_N directories and `latest`)",
    "checkpoint.keep": "checkpoints kept; older steps of this run are removed",
    "log.dir": "run directory: metrics.jsonl and TensorBoard events",
    "log.every": "print a progress line every this many steps",
    "log.progress": "show progress (a bar on a terminal)",
    "log.tensorboard": "write TensorBoard events (needs the tensorboard package)",
    "model.name": "a label for the model",
    "model.vocab_size": "tokens in the vocabulary",
    "model.hidden_size": "width of the residual stream",
    "model.intermediate_size": "width of the MLP",
    "model.num_layers": "transformer blocks",
    "model.num_heads": "attention (query) heads",
    "model.num_kv_heads": "key/value heads (grouped-query attention)",
    "model.max_seq_len": "longest sequence the model accepts",
    "model.rope_theta": "RoPE base frequency",
    "model.rope_scaling": "Llama-3.1 RoPE frequency scaling table, or none",
    "model.norm_eps": "epsilon of the normalisation layers",
    "model.tie_embeddings": "share the input embedding with the output head",
    "model.qkv_bias": "biases on the q, k, v projections (Qwen2)",
    "model.init_std": "standard deviation of the initial weights",
    "model.num_experts": "experts per MoE layer (0: a dense model)",
    "model.experts_top_k": "experts each token is routed to",
    "model.moe_intermediate_size": "width of each expert's MLP",
    "model.routed_scaling_factor": "scale of the routed experts' output (DeepSeek)",
    "model.router_topk_groups": "expert groups kept per token (group-limited routing)",
}

_LINE = re.compile(r"^\s+(\w+)\s*:[^=]*=.*?(?:#\s*(.*))?$")


def _comments(cls) -> dict[str, str]:
    """{field: the comment on its line} from the class's source."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = _LINE.match(line)
        if m and m.group(2):
            out[m.group(1)] = m.group(2).strip()
    return out


def _default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _show(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    return repr(value) if isinstance(value, str) else str(value)


def all_keys() -> list[tuple[str, str, str]]:
    """(section.key, default, meaning) for every key `--section.key` accepts."""
    rows = []
    for name in config.SECTIONS:
        cls = config.section_class(name)
        notes = _comments(cls)
        for f in dataclasses.fields(cls):
            if f.name == "overrides":
                continue
            key = f"{name}.{f.name}"
            rows.append((key, _show(_default(f)), notes.get(f.name) or MEANINGS.get(key, "")))
    tiny = preset(config.ModelSection().preset)
    notes = _comments(ModelConfig)
    for f in dataclasses.fields(ModelConfig):
        key = f"model.{f.name}"
        rows.append((key, _show(getattr(tiny, f.name)),
                     notes.get(f.name) or MEANINGS.get(key, "")))
    return rows


def describe_keys() -> str:
    rows = all_keys()
    width = max(len(k) + len(d) for k, d, _ in rows) + 5
    lines = []
    for key, default, meaning in rows:
        if key == "model.name":
            lines.append(f"  model fields (defaults of the {config.ModelSection().preset} preset; "
                         f"any may be overridden):")
        left = f"  {key} = {default}"
        lines.append(f"{left:<{width}} {meaning}".rstrip())
    return "\n".join(lines)
