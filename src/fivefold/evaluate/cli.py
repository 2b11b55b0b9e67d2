"""`fivefold eval`: perplexity, task generation scored with BLEU/ROUGE, or saved predictions.

    fivefold eval --checkpoint C [--data TOKENS]          perplexity (validation split)
    fivefold eval --hf DIR --data tasks.jsonl --out preds.jsonl   greedy predictions + scores
    fivefold eval --predictions preds.jsonl               scores, no model

`--data` ending in .jsonl is a task file; anything else is a token file from
`fivefold prepare`. Without `--data` a checkpoint is scored on the validation split of the
data it was trained on (data.path or the bundled corpus, data.val_fraction, train.seq_len),
an HF model on the bundled corpus's last 5% in its own tokenizer. Every input is checked
before a model is loaded or a file written; `--json` ends stdout with one JSON object.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from fivefold.config import ArgumentParser, ConfigError

DEFAULT_VAL_FRACTION = 0.05  # data.val_fraction's default, for an HF model's corpus split
DEFAULT_HF_SEQ_LEN = 2048


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fivefold eval",
                       description="Perplexity of a model, or BLEU/ROUGE of its greedy "
                                   "continuations of a task file, or of saved predictions.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a fivefold checkpoint (step_* or its root)")
    source.add_argument("--hf", help="a Hugging Face model directory")
    source.add_argument("--predictions",
                        help="a JSON-lines file with \"prediction\" and \"reference\" on each "
                             "line: score it without a model")
    p.add_argument("--tokenizer", help="with --hf: the tokenizer the model was trained with, "
                   "when the directory has no tokenizer.json: byte, corpus-bpe or a file")
    p.add_argument("--data", help="a token file (perplexity) or a .jsonl task file of "
                                  "{\"prompt\", \"reference\"} lines (generation)")
    p.add_argument("--out", help="where to write the task file with \"prediction\" added")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=0,
                   help="perplexity window (0: the checkpoint's train.seq_len, or "
                        f"min(max_seq_len, {DEFAULT_HF_SEQ_LEN}) for --hf)")
    p.add_argument("--batch-size", type=int, default=8, help="perplexity windows per forward")
    p.add_argument("--max-tokens", type=int, default=0,
                   help="score only the first N tokens of the stream (0: all)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--dtype", default="fp32", choices=("auto", "fp32", "bf16"))
    p.add_argument("--lm-eval", metavar="TASKS",
                   help="comma-separated lm-evaluation-harness tasks to run on the model")
    p.add_argument("--lm-eval-include", metavar="DIR",
                   help="a folder of lm-eval task YAML files: only its tasks are indexed")
    p.add_argument("--limit", type=int, default=0, help="lm-eval: examples per task (0: all)")
    p.add_argument("--json", action="store_true",
                   help="end stdout with one JSON object of every number and what was run")
    return p


def _is_tasks(path: str | None) -> bool:
    return bool(path) and Path(path).suffix == ".jsonl"


def check_args(args) -> None:
    """Every refusal that needs no model, before anything is loaded or written."""
    if args.predictions and (args.data or args.out):
        raise ConfigError("--predictions scores a file as it is; leave out --data and --out "
                          "(or give --checkpoint/--hf to generate)")
    if args.lm_eval and (args.predictions or args.data or args.out):
        raise ConfigError("--lm-eval runs its own tasks on --checkpoint/--hf; leave out "
                          "--predictions, --data and --out")
    if args.lm_eval_include and not args.lm_eval:
        raise ConfigError("--lm-eval-include names task files for --lm-eval; give --lm-eval "
                          "TASKS too")
    if args.lm_eval_include and not Path(args.lm_eval_include).is_dir():
        raise ConfigError(f"--lm-eval-include {args.lm_eval_include} is not a folder of task "
                          f"YAML files")
    if args.limit < 0:
        raise ConfigError(f"--limit {args.limit} must be >= 0 (0: every example)")
    if args.out and not _is_tasks(args.data):
        raise ConfigError("--out writes predictions, which need --data TASKS.jsonl; leave out "
                          "--out for perplexity")
    if args.out and Path(args.out).exists() and not args.overwrite:
        raise ConfigError(f"--out {args.out} exists; give another path or --overwrite")
    if args.out and args.data and Path(args.out).resolve() == Path(args.data).resolve():
        raise ConfigError(f"--out {args.out} is the task file itself; write elsewhere")
    for name in ("max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    for name in ("seq_len", "max_tokens"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 0 "
                              f"(0: the default)")
    if args.data and not Path(args.data).is_file():
        raise ConfigError(f"--data {args.data} does not exist; give a token file from "
                          f"`fivefold prepare` or a .jsonl task file")


def score_predictions(path: str) -> dict:
    from fivefold.evaluate.tasks import read_jsonl
    from fivefold.evaluate.text_metrics import text_scores

    records = read_jsonl(path, ("prediction", "reference"))
    return text_scores([r["prediction"] for r in records], [r["reference"] for r in records])


def run_tasks(args, tasks: list[dict], model, codec) -> dict:
    from fivefold.evaluate.tasks import encode_prompts, greedy_predictions, write_jsonl
    from fivefold.evaluate.text_metrics import text_scores

    prompts = encode_prompts(tasks, codec.encode, args.max_new_tokens, model.cfg.max_seq_len,
                             args.data)
    predictions = greedy_predictions(model, codec, prompts, args.max_new_tokens)
    scores = text_scores(predictions, [t["reference"] for t in tasks])  # before writing
    if args.out:
        write_jsonl(args.out, [{**t, "prediction": p} for t, p in zip(tasks, predictions)])
    return scores


def perplexity_source(args) -> tuple:
    """(tokens, description, seq_len or None: the model's choice) of what perplexity is
    taken over; read and checked before any model is loaded."""
    from fivefold.evaluate import perplexity as ppl

    if args.data:
        tokens, what, seq_len = ppl.token_file(args.data), f"token file {args.data}", None
    elif args.checkpoint:
        from fivefold.evaluate.loading import checkpoint_meta

        tokens, what, seq_len = ppl.checkpoint_validation(checkpoint_meta(args.checkpoint))
    else:
        from fivefold.data.dataset import default_corpus_tokens
        from fivefold.data.tokenizer import hf_tokenizer_spec

        tokenizer = hf_tokenizer_spec(Path(args.hf), args.tokenizer)
        path = default_corpus_tokens(tokenizer)
        tokens = ppl.validation_tokens(path, DEFAULT_VAL_FRACTION)
        what = f"bundled corpus, last {DEFAULT_VAL_FRACTION:g}, in {tokenizer}"
        seq_len = None
    return tokens, what, args.seq_len or seq_len


def evaluate(args) -> dict:
    """The numbers and what was run, as --json prints them."""
    run = {"source": {k: getattr(args, k) for k in ("checkpoint", "hf", "predictions")
                      if getattr(args, k)}}
    result = dict.fromkeys(("perplexity", "loss", "tokens", "bleu", "rouge1", "rouge2",
                            "rougeL", "examples"))
    started = time.perf_counter()
    if args.predictions:
        run["task"] = "score predictions"
        result.update(score_predictions(args.predictions))
    elif args.lm_eval:
        from fivefold.evaluate.harness import FivefoldLM, task_manager
        from fivefold.evaluate.harness import run_tasks as run_lm_eval

        tasks = [t.strip() for t in args.lm_eval.split(",") if t.strip()]
        manager = task_manager(tasks, args.lm_eval_include)  # before the model loads
        lm = FivefoldLM(checkpoint=args.checkpoint, hf=args.hf, device=args.device,
                        dtype=args.dtype, tokenizer=args.tokenizer)
        run.update(task="lm-eval", tasks=tasks, include=args.lm_eval_include,
                   limit=args.limit or None)
        result["lm_eval"] = run_lm_eval(lm, tasks, limit=args.limit or None, manager=manager)
    else:
        from fivefold.evaluate.loading import load_model
        from fivefold.evaluate.tasks import read_jsonl

        # The data first: a bad line or token file is one line before a model is loaded.
        tasks = read_jsonl(args.data, ("prompt", "reference")) if _is_tasks(args.data) else None
        source = None if tasks else perplexity_source(args)
        model, codec = load_model(SimpleNamespace(**vars(args)))
        if tasks:
            run.update(task="generate", data=args.data, out=args.out, decoding="greedy",
                       max_new_tokens=args.max_new_tokens)
            result.update(run_tasks(args, tasks, model, codec))
        else:
            from fivefold.evaluate.perplexity import perplexity

            tokens, what, seq_len = source
            if seq_len is None:  # a token file: the model's context; the corpus: at most 2048
                seq_len = model.cfg.max_seq_len if args.data else min(model.cfg.max_seq_len,
                                                                      DEFAULT_HF_SEQ_LEN)
            got = perplexity(model, tokens, seq_len, args.batch_size, args.max_tokens or None)
            run.update(task="perplexity", data=what, seq_len=got.seq_len, windows=got.windows)
            result.update(perplexity=got.perplexity, loss=got.loss, tokens=got.tokens)
        param = next(model.parameters())
        run.update(device=str(param.device), dtype=str(param.dtype).removeprefix("torch."))
    run["seconds"] = round(time.perf_counter() - started, 3)
    return {**result, "run": run}


def report(result: dict) -> str:
    lines = []
    if result["perplexity"] is not None:
        lines.append(f"perplexity {result['perplexity']:.4f} (loss {result['loss']:.4f} nats a "
                     f"token) over {result['tokens']:,} tokens")
    if result["bleu"] is not None:
        lines.append(f"BLEU {result['bleu']:.2f}  ROUGE-1 {result['rouge1']:.4f}  ROUGE-2 "
                     f"{result['rouge2']:.4f}  ROUGE-L {result['rougeL']:.4f}  "
                     f"({result['examples']} examples)")
    for task, metrics in (result.get("lm_eval") or {}).items():
        lines.append(f"lm-eval {task}: " + ", ".join(f"{k} {v:.6g}" for k, v in metrics.items()))
    run = result["run"]
    lines.append("run: " + ", ".join(f"{k} {v}" for k, v in run.items() if k != "source")
                 + ", " + ", ".join(f"--{k} {v}" for k, v in run["source"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed its one-line error, or the help
        return int(e.code or 0)
    try:
        check_args(args)
        result = evaluate(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report(result))
    if args.json:
        print(json.dumps(result))
    return 0
