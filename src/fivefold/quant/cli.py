"""`fivefold quantize`: a float checkpoint (or Hugging Face directory) in, a quantised
checkpoint out, with its size report.

    fivefold quantize --checkpoint C | --hf DIR --method int8|int4|awq|nf4|mxfp4
                      [--group-size 128] [--symmetric] [--calib TOKENS]
                      [--calib-samples 128] [--calib-seq-len 512] [--no-clip]
                      [--duo] [--awq-loss module|layer] [--alpha-grid 20]
                      [--awq-held-out 0] [--awq-select layer|logits]
                      [--awq-rounding rtn|gptq]
                      [--include-head] --out Q [--overwrite]

Every input is checked before the model is changed and before anything is written: the
method, the group size against every linear's input dimension, the calibration file's
length, the output directory. AWQ calibrates on `--calib` (a token file from `fivefold
prepare`) or, for a fivefold checkpoint, on the training split of the data it was trained
on (the bundled corpus when data.path was empty).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from fivefold.config import ArgumentParser, ConfigError, suggest
from fivefold.data.tokenizer import HF_TOKENIZER_HELP, hf_tokenizer_spec
from fivefold.numerics.intx import DEFAULT_GROUP_SIZE
from fivefold.quant.awq import (
    ALPHA_GRID,
    HELD_OUT,
    LOSSES,
    ROUNDING,
    ROUNDINGS,
    SELECTS,
    split_calibration,
)
from fivefold.quant.convert import METHODS, QuantSpec, check_shapes, quantize_

DEFAULT_CALIB_SAMPLES = 128    # AWQ §4: 128 samples of 512 tokens (from the Pile)
DEFAULT_CALIB_SEQ_LEN = 512


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fivefold quantize",
                       description="Quantise a model's linear layers (weight-only) and write a "
                                   "checkpoint that generate, eval and serve load.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a fivefold checkpoint directory")
    source.add_argument("--hf", help="a Hugging Face model directory")
    p.add_argument("--tokenizer", help=HF_TOKENIZER_HELP)
    p.add_argument("--method", required=True, help=f"one of {', '.join(METHODS)}")
    p.add_argument("--group-size", type=int, default=None,
                   help="int4/awq: input columns per scale (default 128)")
    p.add_argument("--symmetric", action="store_true",
                   help="int4/awq: symmetric codes (-8..7) instead of a zero point")
    p.add_argument("--calib", help="awq: a token file (fivefold prepare) to calibrate on")
    p.add_argument("--calib-samples", type=int, default=DEFAULT_CALIB_SAMPLES,
                   help=f"awq: calibration sequences, evenly spaced over --calib (default "
                        f"{DEFAULT_CALIB_SAMPLES})")
    p.add_argument("--calib-seq-len", type=int, default=None,
                   help=f"tokens per calibration sequence (default {DEFAULT_CALIB_SEQ_LEN}, at "
                        f"most the model's max_seq_len; from a fivefold checkpoint without "
                        f"--calib, at most the train.seq_len it was trained at)")
    p.add_argument("--no-clip", action="store_true", help="awq: skip the clipping search")
    p.add_argument("--duo", action="store_true",
                   help="awq: AutoAWQ's duo scaling s = mean|x|^a / mean|w|^(1-a) instead "
                        "of llm-awq's s = mean|x|^a (with --awq-held-out: duo only)")
    p.add_argument("--awq-loss", default=None,
                   help="awq: where each group's error is measured: module (default: the "
                        "attention, the MLP or the linear, as llm-awq) or layer (the decoder "
                        "layer's output)")
    p.add_argument("--awq-held-out", type=float, default=None,
                   help=f"awq: share of the calibration sequences each group's scale is chosen "
                        f"on (among alpha 0, llm-awq's and duo scaling's best), apart from "
                        f"those alpha is searched on (default {HELD_OUT:g}: llm-awq's choice, on "
                        f"all of them)")
    p.add_argument("--awq-select", default=None,
                   help="awq: what the held-out choice measures: layer (default: the decoder "
                        "layer's output error) or logits (the float model's next-token "
                        "distribution against the model's, KL)")
    p.add_argument("--awq-rounding", default=None,
                   help=f"awq: how the scaled weights are rounded: gptq (error-compensating, "
                        f"on the calibration inputs) or rtn (to nearest, llm-awq's); default "
                        f"{ROUNDING}")
    p.add_argument("--alpha-grid", type=int, default=None,
                   help=f"awq: N, the alpha search's points i/N for i < N (default "
                        f"{ALPHA_GRID}, llm-awq's)")
    p.add_argument("--include-head", action="store_true",
                   help="quantise the output head too (untied heads only)")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    return p


def load_float(args):
    """(model fp32 on CPU, model_cfg, tokenizer spec, source record, training data meta: the
    run's [data] section with the train.seq_len it was read at, None for --hf)."""
    from fivefold.quant.io import is_quantized

    if args.hf:
        from fivefold.models.hf import load_hf

        directory = Path(args.hf)
        if not (directory / "config.json").is_file():
            raise ConfigError(f"--hf {directory} has no config.json; give a Hugging Face "
                              f"checkpoint directory")
        tokenizer = hf_tokenizer_spec(directory, args.tokenizer)  # one line, before loading
        model = load_hf(directory, dtype=torch.float32)
        return model, model.cfg, tokenizer, {"hf": str(directory.resolve())}, None
    if args.tokenizer:
        raise ConfigError("--tokenizer names the tokenizer of an --hf directory; a checkpoint "
                          "records its own, so drop --tokenizer")
    if is_quantized(args.checkpoint):
        raise ConfigError(f"--checkpoint {args.checkpoint} is already quantised; give the "
                          f"float checkpoint it was made from")
    from fivefold.finetune.attach import load_for_inference
    from fivefold.train.checkpoint import read_meta

    model, model_cfg, tokenizer, lora = load_for_inference(args.checkpoint)
    if lora:
        raise ConfigError(f"--checkpoint {args.checkpoint} is a LoRA run; merge its adapters "
                          f"first (fivefold convert --checkpoint ... --to-hf DIR) and quantise "
                          f"that directory with --hf")
    path = Path(args.checkpoint)
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text().strip()
    config = read_meta(path, fix="--checkpoint").get("config") or {}
    data = {**(config.get("data") or {}),
            "seq_len": (config.get("train") or {}).get("seq_len")}
    return model.float(), model_cfg, tokenizer, {"checkpoint": str(path.resolve())}, data


def calibration_tokens(args, model_cfg, tokenizer, data: dict | None) -> torch.Tensor:
    """(samples, seq_len) token ids, evenly spaced over the calibration stream."""
    from fivefold.data.dataset import TokenDataset, default_corpus_tokens
    from fivefold.data.loader import split_bounds

    seq_len = min(args.calib_seq_len or DEFAULT_CALIB_SEQ_LEN, model_cfg.max_seq_len)
    if args.calib_seq_len is None and not args.calib and data and data.get("seq_len"):
        # Calibrating on its own training text, a model is measured where it was trained:
        # activations past the trained length are ones it never produced in training (a
        # default model trained at 128 closed 22% of RTN's gap calibrated at 512, 36% at 128).
        seq_len = min(seq_len, int(data["seq_len"]))
    if seq_len < 1 or args.calib_samples < 1:
        raise ConfigError("--calib-samples and --calib-seq-len must be >= 1")
    if args.calib:
        ds, start, end, name = TokenDataset.open(args.calib), 0, None, f"--calib {args.calib}"
        end = ds.num_tokens
    elif data is not None:
        spec = tokenizer.get("path") if isinstance(tokenizer, dict) else tokenizer
        path = data.get("path") or default_corpus_tokens(spec or "byte")
        ds = TokenDataset.open(path)
        start, end = split_bounds(ds.num_tokens, float(data.get("val_fraction", 0.0)), "train")
        name = f"the training split of {path}"
    else:
        raise ConfigError("--method awq with --hf needs calibration text: give --calib "
                          "TOKENS (a token file from fivefold prepare)")
    if ds.vocab_size > model_cfg.vocab_size:
        raise ConfigError(f"{name} uses a vocabulary of {ds.vocab_size}, larger than the "
                          f"model's {model_cfg.vocab_size}; prepare it with the model's "
                          f"tokenizer")
    available = end - start
    if available < seq_len:
        raise ConfigError(f"{name} has {available} tokens, fewer than one calibration "
                          f"sequence of {seq_len}; give a longer file or lower --calib-seq-len")
    starts = np.linspace(start, end - seq_len, args.calib_samples).round().astype(np.int64)
    rows = [np.asarray(ds.tokens[s:s + seq_len], dtype=np.int64) for s in starts]
    return torch.from_numpy(np.stack(rows))


def check_inputs(args) -> QuantSpec:
    if args.method not in METHODS:
        raise ConfigError(f"--method '{args.method}' is unknown{suggest(args.method, METHODS)}; "
                          f"use one of {', '.join(METHODS)}")
    # Options that only some methods read: given to another they would be ignored silently.
    for flag, given, methods in (("--symmetric", args.symmetric, ("int4", "awq")),
                                 ("--group-size", args.group_size is not None, ("int4", "awq")),
                                 ("--calib", args.calib is not None, ("awq",))):
        if given and args.method not in methods:
            fixed = {"int8": "one scale per output row", "nf4": "NF4's fixed 64-weight blocks "
                     "and table", "mxfp4": "MXFP4's fixed 32-weight blocks", "int4":
                     "round-to-nearest without calibration"}.get(args.method, "")
            raise ConfigError(f"{flag} applies to --method {' or '.join(methods)} only, not "
                              f"{args.method} ({fixed}); drop it")
    if args.group_size is None:
        args.group_size = DEFAULT_GROUP_SIZE
    if args.group_size <= 0 or args.group_size % 2:
        raise ConfigError(f"--group-size {args.group_size} must be a positive even number "
                          f"(128 is the usual choice)")
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise ConfigError(f"--out {out} already exists; give a new directory or add "
                          f"--overwrite to replace it")
    source = Path(args.checkpoint or args.hf).resolve()
    if out.resolve() == source or source.is_relative_to(out.resolve()):
        raise ConfigError(f"--out {out} would replace the model being quantised; give "
                          f"another directory")
    check_awq_options(args)
    return QuantSpec(args.method, args.group_size, args.symmetric, args.include_head)


def check_awq_options(args) -> None:
    """AWQ's search options: valid values, and only with --method awq (elsewhere they would
    be ignored silently). Fills in the defaults."""
    given = [flag for flag, value in (("--no-clip", args.no_clip), ("--duo", args.duo),
                                      ("--awq-loss", args.awq_loss),
                                      ("--alpha-grid", args.alpha_grid),
                                      ("--awq-held-out", args.awq_held_out),
                                      ("--awq-select", args.awq_select),
                                      ("--awq-rounding", args.awq_rounding))
             if value not in (None, False)]
    if args.method != "awq" and given:
        raise ConfigError(f"{given[0]} applies to --method awq only, not {args.method}; "
                          f"drop it or use --method awq")
    if args.awq_loss is None:
        args.awq_loss = "module"
    elif args.awq_loss not in LOSSES:
        raise ConfigError(f"--awq-loss '{args.awq_loss}' is unknown"
                          f"{suggest(args.awq_loss, LOSSES)}; use one of {', '.join(LOSSES)}")
    if args.awq_held_out is None:
        args.awq_held_out = HELD_OUT
    elif not 0 <= args.awq_held_out < 1:
        raise ConfigError(f"--awq-held-out {args.awq_held_out:g} must be in [0, 1) (a share "
                          f"of the calibration sequences; default {HELD_OUT:g})")
    if args.awq_select is not None and args.awq_held_out == 0:
        raise ConfigError("--awq-select chooses on held-out sequences; give --awq-held-out "
                          "(for example 0.5) or drop it")
    if args.awq_select is None:
        args.awq_select = "layer"
    elif args.awq_select not in SELECTS:
        raise ConfigError(f"--awq-select '{args.awq_select}' is unknown"
                          f"{suggest(args.awq_select, SELECTS)}; use one of {', '.join(SELECTS)}")
    if args.awq_rounding is None:
        args.awq_rounding = ROUNDING
    elif args.awq_rounding not in ROUNDINGS:
        raise ConfigError(f"--awq-rounding '{args.awq_rounding}' is unknown"
                          f"{suggest(args.awq_rounding, ROUNDINGS)}; use one of "
                          f"{', '.join(ROUNDINGS)}")
    try:
        if args.calib_samples >= 1:     # below 1: refused with the calibration's length
            split_calibration(torch.zeros(args.calib_samples, 1), args.awq_held_out)
    except ValueError as e:
        raise ConfigError(f"--calib-samples {args.calib_samples} with --awq-held-out "
                          f"{args.awq_held_out:g}: {e}") from None
    if args.alpha_grid is None:
        args.alpha_grid = ALPHA_GRID
    elif args.alpha_grid < 2:
        raise ConfigError(f"--alpha-grid {args.alpha_grid} must be >= 2 (alpha 0 and 1 at "
                          f"least; {ALPHA_GRID} is AWQ's choice)")


def run(args) -> int:
    from fivefold.quant.io import describe_size, save_quantized, size_report, tensor_bytes

    spec = check_inputs(args)
    started = time.perf_counter()
    model, model_cfg, tokenizer, source, data = load_float(args)
    if spec.include_head and model.lm_head is None:
        raise ConfigError("--include-head: this model ties its head to the embedding, which "
                          "stays float; drop --include-head")
    try:
        check_shapes(model, spec)
    except ValueError as e:
        raise ConfigError(f"--group-size {spec.group_size} does not fit: {e}; give a group "
                          f"size that divides every linear's input dimension") from None
    float_bytes = tensor_bytes(model.state_dict().values())
    extra = {}
    if spec.method == "awq":
        from fivefold.quant.awq import apply_awq

        tokens = calibration_tokens(args, model_cfg, tokenizer, data)
        print(f"AWQ: calibrating on {tokens.shape[0]} x {tokens.shape[1]} tokens", flush=True)
        report = apply_awq(model, tokens, spec.group_size, spec.symmetric,
                           clip=not args.no_clip, n_grid=args.alpha_grid,
                           log=lambda line: print(line, flush=True),
                           duo=True if args.duo else None, loss=args.awq_loss,
                           held_out=args.awq_held_out, select=args.awq_select,
                           rounding=args.awq_rounding)
        print(report.summary())
        extra["awq"] = {"calib_samples": int(tokens.shape[0]),
                        "calib_seq_len": int(tokens.shape[1]), "clip": not args.no_clip,
                        "duo": args.duo, "loss": args.awq_loss,
                        "alpha_grid": args.alpha_grid,
                        "held_out": args.awq_held_out, "select": args.awq_select,
                        "rounding": args.awq_rounding,
                        "alphas": [g.alpha for g in report.groups],
                        "choices": [g.choice for g in report.groups],
                        "calib_error_vs_rtn": report.error_ratio()}
    names = quantize_(model, spec)
    size = size_report(float_bytes, 4, model)   # loaded in fp32
    out = save_quantized(model, model_cfg, spec, args.out, tokenizer, source, size,
                         overwrite=args.overwrite, extra=extra)
    print(f"quantised {len(names)} linears with {spec.method} in "
          f"{time.perf_counter() - started:.1f} s")
    print(describe_size(size))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error, or the help
        return int(e.code or 0)
    try:
        return run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
