"""`fivefold convert`: move weights between Hugging Face directories and fivefold checkpoints.

    fivefold convert --hf DIR --to-hf OUT [--max-shard-size 2GB] [--dtype bf16]
        re-write a Hugging Face model (reshard, change dtype); tokenizer files come along
    fivefold convert --checkpoint DIR --to-hf OUT
        export a fivefold training checkpoint for transformers, vLLM, llama.cpp ...
    fivefold convert --checkpoint DIR --to-hf OUT --peft [--base-hf HF_DIR]
        a LoRA run's adapters as a PEFT directory; its base_model_name_or_path is a directory
        transformers loads: --base-hf, else the run's model.hf_path, else the base the
        adapters sit on written beside it as OUT-base (a run started from model.init_from,
        or from a preset; a QLoRA base dequantised), so that
        `AutoPeftModelForCausalLM.from_pretrained(OUT)` gives fivefold's logits

To train from Hugging Face weights, no conversion is needed: `fivefold train
--model.hf_path DIR` reads them directly, under any layout.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from fivefold.config import ArgumentParser, ConfigError, writable_dir
from fivefold.config.rules import QUANTIZED_MARKER

# Files of a Hugging Face model directory that are not weights and travel unchanged.
COMPANION_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "chat_template.jinja")
TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
DTYPES = ("keep", "fp32", "bf16", "fp16")


def parse_size(text: str) -> int:
    """'5GB', '500MB', '64KiB' or a plain byte count -> bytes (GB = 10**9, GiB = 2**30)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)\s*", text, flags=re.IGNORECASE)
    if not m:
        raise ConfigError(f"--max-shard-size {text!r} is not a size; write e.g. 5GB or 500MB")
    number, unit = float(m.group(1)), m.group(2).upper().rstrip("B")
    scale = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
             "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}[unit]
    size = int(number * scale)
    if size <= 0:
        raise ConfigError(f"--max-shard-size {text!r} must be positive")
    return size


def _torch_dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(name)


def hf_to_hf(src: str | Path, outdir: str | Path, max_shard_bytes: int,
             dtype: str = "keep") -> Path:
    """Load a Hugging Face model with fivefold and write it again (round trip, reshard)."""
    import torch

    from fivefold.models.hf import load_hf, save_hf

    src = Path(src)
    source_config = json.loads((src / "config.json").read_text()) if (
        src / "config.json").is_file() else {}
    # Load in the stored dtype unless asked otherwise, so a bf16 model stays bf16.
    stored = getattr(torch, str(source_config.get("torch_dtype") or source_config.get("dtype")),
                     None)
    stored = stored if isinstance(stored, torch.dtype) else torch.float32
    model = load_hf(src, dtype=_torch_dtype(dtype) or stored)
    token_ids = {k: source_config[k] for k in TOKEN_ID_KEYS if k in source_config}
    companions = [src / name for name in COMPANION_FILES if (src / name).is_file()]
    return save_hf(model, model.cfg, outdir, max_shard_bytes=max_shard_bytes,
                   extra_config=token_ids, extra_files=companions)


def export_checkpoint_to_hf(checkpoint_dir: str | Path, outdir: str | Path,
                            max_shard_bytes: int | None = None, dtype: str = "keep",
                            adapters: str = "merge") -> Path:
    """Write a fivefold training checkpoint as a Hugging Face model directory, with the
    tokenizer files transformers loads (models/hf_tokenizer.py): the run's tokenizer, or
    the files of the Hugging Face base whose tokenizer the run used. A LoRA run's adapters
    are merged in (`adapters` "merge") or left out ("drop": the base they sit on)."""
    import tempfile

    from fivefold.finetune.attach import load_for_inference
    from fivefold.finetune.inject import merge_and_unload, unload
    from fivefold.models.hf import DEFAULT_MAX_SHARD_BYTES, save_hf
    from fivefold.models.hf_tokenizer import base_tokenizer_dir, write_tokenizer_files

    model, model_cfg, tokenizer_spec, lora = load_for_inference(str(checkpoint_dir))
    if lora:  # a LoRA run: the base with W + scaling · B A folded in, or the base alone
        model = merge_and_unload(model) if adapters == "merge" else unload(model)
    if _torch_dtype(dtype) is not None:
        model = model.to(_torch_dtype(dtype))
    base = base_tokenizer_dir(tokenizer_spec, _run_hf_path(Path(checkpoint_dir)))
    with tempfile.TemporaryDirectory() as staging:
        if base is not None:
            extra = [base / name for name in COMPANION_FILES if (base / name).is_file()]
            base_config = json.loads((base / "config.json").read_text())
            token_ids = {k: base_config[k] for k in TOKEN_ID_KEYS if k in base_config}
        else:
            token_ids = write_tokenizer_files(tokenizer_spec, model_cfg.max_seq_len,
                                              Path(staging))
            extra = sorted(Path(staging).iterdir())
        return save_hf(model, model_cfg, outdir, extra_config=token_ids, extra_files=extra,
                       max_shard_bytes=max_shard_bytes or DEFAULT_MAX_SHARD_BYTES)


def _export_peft(args, shard: int) -> Path:
    """The adapters, naming a base PEFT loads: --base-hf, the run's model.hf_path, or the
    base the adapters sit on, written first as OUT-base (module docstring)."""
    from fivefold.finetune.attach import export_peft, lora_settings_of

    lora_settings_of(args.checkpoint)  # a LoRA run, or one line before anything is written
    base = args.base_hf or _run_hf_path(Path(args.checkpoint))
    if args.base_hf:
        try:
            model_type = json.loads((Path(args.base_hf) / "config.json").read_text())[
                "model_type"]
        except (OSError, ValueError, KeyError, TypeError):
            model_type = None
        if not model_type:
            raise ConfigError(f"--base-hf {args.base_hf} is not a Hugging Face model directory"
                              f" (no config.json with a model_type); give the directory of "
                              f"`convert --to-hf` or transformers' save_pretrained")
    if not base:  # model.init_from or a preset: no directory transformers loads exists yet
        written = Path(args.to_hf).with_name(Path(args.to_hf).name + "-base")
        if written.exists() and (not written.is_dir() or any(written.iterdir())):
            raise ConfigError(f"the adapter's base goes to {written}, which already exists; "
                              f"remove it, or name a base with --base-hf HF_DIR")
        base = str(export_checkpoint_to_hf(args.checkpoint, written, shard, args.dtype,
                                           adapters="drop").resolve())
        print(f"wrote {written} (the base the adapters sit on)")
    return export_peft(args.checkpoint, args.to_hf, base_model=base)


def _run_hf_path(checkpoint: Path) -> str:
    """The model.hf_path a checkpoint's run trained from ('' if none), from its meta.json
    (already checked by the loader)."""
    if (checkpoint / "latest").is_file():
        checkpoint = checkpoint / (checkpoint / "latest").read_text().strip()
    try:
        meta = json.loads((checkpoint / "meta.json").read_text())
    except (OSError, ValueError):
        return ""
    return ((meta.get("config") or {}).get("model") or {}).get("hf_path") or ""


def _quantized_refusal(checkpoint: Path) -> str:
    """One line for convert --checkpoint of a `fivefold quantize` directory, naming its
    method and the float model it came from (its quantized.json says both)."""
    try:
        manifest = json.loads((checkpoint / QUANTIZED_MARKER).read_text())
    except (OSError, ValueError):
        manifest = {}
    method = (manifest.get("quant") or {}).get("method") or "quantised"
    came = next(iter((manifest.get("source") or {}).values()), "")
    came = f" ({came})" if isinstance(came, str) and came else ""
    return (f"--checkpoint {checkpoint} holds {method} weights written by fivefold quantize; "
            f"convert exports float models only: convert the checkpoint or Hugging Face "
            f"directory it was quantised from{came}, or serve/generate/eval this one directly")


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fivefold convert",
                                description="Convert between Hugging Face and fivefold formats.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="a Hugging Face model directory to read")
    source.add_argument("--checkpoint", help="a fivefold checkpoint directory to read")
    p.add_argument("--to-hf", "--out", dest="to_hf",
                   help="write a Hugging Face model directory here")
    p.add_argument("--peft", action="store_true",
                   help="with --checkpoint of a LoRA run: write only the adapters, as a PEFT "
                        "directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("--base-hf", metavar="HF_DIR",
                   help="with --peft: the Hugging Face directory the adapter names as its base "
                        "(default: the run's model.hf_path; a run without one gets the base "
                        "its adapters sit on written beside OUT, as OUT-base)")
    p.add_argument("--max-shard-size", default="5GB", help="e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--dtype", default="keep", choices=DTYPES,
                   help="the written weights' dtype (default keep: as stored)")
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error, or the help
        return int(e.code or 0)
    try:
        if not args.to_hf:
            raise ConfigError("give --to-hf OUTDIR: the Hugging Face directory to write")
        if args.checkpoint and (Path(args.checkpoint) / QUANTIZED_MARKER).is_file():
            # transformers reads int4/AWQ weights only through the gptqmodel kernels, which do
            # not install here, and int8/nf4/mxfp4 in layouts of bitsandbytes or torchao's
            # own: a directory written for any of them could not be checked here.
            raise ConfigError(_quantized_refusal(Path(args.checkpoint)))
        target = Path(args.to_hf)
        writable_dir("--to-hf", args.to_hf)
        if target.is_dir() and any(target.iterdir()):  # before the (slow) load, not after
            raise ConfigError(f"--to-hf {target} already exists and is not empty; choose a new "
                              f"directory or remove this one")
        shard = parse_size(args.max_shard_size)
        if args.base_hf and not args.peft:
            raise ConfigError("--base-hf names the base of a --peft adapter; add --peft or "
                              "drop --base-hf")
        if args.peft:
            if not args.checkpoint:
                raise ConfigError("--peft exports a LoRA checkpoint's adapters; give "
                                  "--checkpoint DIR")
            out = _export_peft(args, shard)
        elif args.hf:
            out = hf_to_hf(args.hf, args.to_hf, shard, args.dtype)
        else:
            out = export_checkpoint_to_hf(args.checkpoint, args.to_hf, shard, args.dtype)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0
