"""The bad-input sweep: every command, every kind of mistake, each one line and an exit code.

`make_world(root)` builds the inputs once (broken Hugging Face directories, a token file, a
damaged copy of a run); `cases(world)` lists (name, argv, exit code, text the line must hold).
tests/test_safety.py runs them in-process after a completed run and checks that run's files
byte for byte; bench/runs/bad_inputs.py runs them as real processes and prints the table.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

# The tests' model: the byte tokenizer with tiny's vocabulary, one sequence per micro-batch.
SMALL = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "2", "--train.seq_len", "32", "--train.gbs", "4", "--train.eval_every", "0",
         "--train.warmup_steps", "0", "--train.device", "cpu", "--log.progress", "false",
         "--log.tensorboard", "false"]
UNWRITABLE = "/sys/kernel/fivefold-sweep"  # refuses writes even to root


def dirs(run: Path) -> list[str]:
    return ["--checkpoint.dir", str(run / "ck"), "--log.dir", str(run)]


def make_world(root: Path, finished_run: Path) -> dict[str, Path]:
    """Inputs the cases need, next to (never inside) the completed run."""
    import torch

    from fivefold.data.prepare import prepare
    from fivefold.models.hf import save_hf
    from fivefold.models.init import build_meta
    from fivefold.models.presets import preset

    w = {"run": finished_run, "root": root}
    (root / "text.txt").write_text("To be, or not to be, that is the question. " * 20)
    (root / "empty.txt").write_text("")
    (root / "empty.bin").write_bytes(b"")  # a token file with nothing in it, no metadata
    prepare([str(root / "text.txt")], str(root / "tokens.bin"))
    (root / "bad.toml").write_text("[train\nsteps = 3\n")
    (root / "tasks.jsonl").write_text('{"prompt": "To be", "reference": "or not"}\n')
    (root / "tasks_noref.jsonl").write_text('{"prompt": "a", "reference": "b"}\n'
                                            '{"prompt": "To be"}\n')
    (root / "afile").write_text("not a directory")
    (root / "full").mkdir()
    (root / "full" / "x").write_text("taken")
    (root / "adir").mkdir()
    cfg = preset("tiny").replace(hidden_size=32, intermediate_size=64, num_layers=2)
    model = build_meta(cfg)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    save_hf(model, cfg, root / "hf_good", max_shard_bytes=10**9)
    good = json.loads((root / "hf_good" / "config.json").read_text())
    for name, change in (("hf_heads0", {"num_attention_heads": 0}),
                         ("hf_hidden_str", {"hidden_size": "128"}),
                         ("hf_vocab_null", {"vocab_size": None})):
        shutil.copytree(root / "hf_good", root / name)
        (root / name / "config.json").write_text(json.dumps({**good, **change}))
    shutil.copytree(root / "hf_good", root / "hf_truncated")
    weights = root / "hf_truncated" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    shutil.copytree(finished_run / "ck", root / "damaged")
    latest = root / "damaged" / (root / "damaged" / "latest").read_text().strip()
    os.truncate(next(latest.glob("*.distcp")), 5000)
    w["damaged_step"] = latest
    shutil.copytree(finished_run / "ck", root / "incomplete")  # a step without its manifest
    unvouched = root / "incomplete" / (root / "incomplete" / "latest").read_text().strip()
    (unvouched / "manifest.json").unlink()
    w["incomplete_step"] = unvouched
    from fivefold.quant.cli import main as quantize

    assert quantize(["--checkpoint", str(finished_run / "ck"), "--method", "int8", "--out",
                     str(root / "q_int8")]) == 0
    w.update({k: root / k for k in ("hf_good", "hf_heads0", "hf_hidden_str", "hf_vocab_null",
                                     "hf_truncated", "damaged", "tokens.bin", "tasks.jsonl",
                                     "tasks_noref.jsonl", "q_int8")})
    return w


def cases(w: dict[str, Path]) -> list[tuple[str, list[str], int, str]]:
    r, run = w["root"], w["run"]
    new = dirs(r / "fresh")  # a run directory nothing has been written to
    t = ["train", *SMALL, *new]
    gen = ["--prompt", "hi", "--max-new-tokens", "2"]
    ck = str(run / "ck")
    plan = ["plan", "--model", "tiny", "--gpus", "1", "--seq-len", "128", "--gbs", "4"]
    sched = ["schedule", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4"]
    return [
        # train: values
        ("lr nan", [*t, "--train.lr", "nan"], 2, "train.lr = 'nan' is not a finite"),
        ("lr inf", [*t, "--train.lr", "inf"], 2, "train.lr = 'inf' is not a finite"),
        ("lr negative", [*t, "--train.lr", "-1"], 2, "train.lr = -1.0 must be > 0"),
        ("seed negative", [*t, "--train.seed", "-1"], 2, "train.seed = -1"),
        ("seed too big", [*t, "--train.seed", str(2**40)], 2, "train.seed"),
        ("timeout zero", [*t, "--parallel.timeout_s", "0"], 2, "parallel.timeout_s = 0.0"),
        ("timeout below floor", [*t, "--parallel.timeout_s", "0.01"], 2, "floor of 5 s"),
        ("bucket nan", [*t, "--parallel.bucket_mb", "nan"], 2, "parallel.bucket_mb = 'nan'"),
        ("bucket zero", [*t, "--parallel.bucket_mb", "0"], 2, "parallel.bucket_mb = 0.0"),
        ("steps zero", [*t, "--train.steps", "0"], 2, "train.steps = 0"),
        ("steps word", [*t, "--train.steps", "many"], 2, "not an integer"),
        ("min_lr above lr", [*t, "--train.min_lr", "1"], 2, "train.min_lr"),
        ("beta out of range", [*t, "--train.beta2", "1.5"], 2, "train.beta2"),
        ("muon coefficient nan", [*t, "--train.optimizer", "muon",
                                  "--optim.muon_ns_coefficients", "1,2,nan"], 2,
         "optim.muon_ns_coefficients = '1,2,nan' must be three finite numbers"),
        ("muon coefficient inf", [*t, "--train.optimizer", "muon",
                                  "--optim.muon_ns_coefficients", "1,inf,2"], 2,
         "optim.muon_ns_coefficients = '1,inf,2' must be three finite numbers"),
        ("unknown key", [*t, "--train.lrr", "1"], 2, "did you mean 'lr'"),
        ("unknown section", [*t, "--trian.lr", "1"], 2, "did you mean 'train'"),
        ("override no value", [*t, "--train.lr"], 2, "has no value"),
        ("stray word", [*t, "oops"], 2, "unexpected argument 'oops'"),
        ("misspelt option", [*t, "--overwite"], 2,
         "unknown option --overwite (did you mean '--overwrite'?)"),
        ("schedule without pp", [*t, "--parallel.schedule", "zb"], 2,
         "parallel.schedule = 'zb' needs parallel.pp > 1"),
        ("gbs vs mbs", [*t, "--train.gbs", "6", "--parallel.mbs", "4"], 2, "train.gbs = 6"),
        ("bad precision", [*t, "--train.precision", "fp64"], 2, "train.precision"),
        ("seq_len too long", [*t, "--train.seq_len", "4096"], 2, "max_seq_len"),
        ("tp vs heads", [*t, "--parallel.tp", "3"], 2, "parallel.tp = 3"),
        ("sp without tp", [*t, "--parallel.sp", "true"], 2, "parallel.sp"),
        ("zero stage", [*t, "--parallel.zero", "4"], 2, "parallel.zero = 4"),
        ("hidden size 0", [*t, "--model.hidden_size", "0"], 2, "model.hidden_size = 0"),
        ("kv heads", [*t, "--model.num_kv_heads", "3"], 2, "num_kv_heads"),
        ("unknown preset", [*t, "--model.preset", "llama-9b"], 2, "model.preset"),
        ("not launched", [*t, "--parallel.dp", "2"], 2, "torchrun"),
        # train: parallel.layout = auto
        ("auto bad value", [*t, "--parallel.layout", "fast"], 2, "parallel.layout = 'fast'"),
        ("auto unmet constraint", [*t, "--parallel.layout", "auto", "--parallel.tp", "3"], 2,
         "keeps parallel.tp = 3, and no layout of 1 rank(s)"),
        ("auto budget too small", [*t, "--parallel.layout", "auto",
                                   "--train.memory_budget_gib", "1e-5"], 2,
         "is below what any layout of 1 rank(s) needs; the smallest"),
        ("profile without auto", [*t, "--hw-profile", str(r / "p.json")], 2,
         "--hw-profile ranks layouts for parallel.layout = 'auto'"),
        ("auto profile missing", [*t, "--parallel.layout", "auto", "--hw-profile",
                                  str(r / "p.json")], 2, "--hw-profile"),
        ("launch auto without ranks", ["launch", *t, "--parallel.layout", "auto"], 2,
         "give fivefold launch --nproc-per-node N"),
        # train: settings another setting would ignore
        ("budget without auto", [*t, "--train.memory_budget_gib", "50"], 2,
         "train.memory_budget_gib = 50 bounds train.recompute = 'auto' or parallel.layout"),
        ("budget above the machine", [*t, "--train.recompute", "auto",
                                      "--train.memory_budget_gib", "100000"], 2,
         "more than this machine's"),
        ("microbatch sync at zero 0", [*t, "--parallel.grad_sync", "microbatch"], 2,
         "parallel.zero = 0 keeps no such shard"),
        ("lora with fp8", [*t, "--lora.rank", "4", "--train.precision", "fp8"], 2,
         "lora.rank > 0 with train.precision = 'fp8'"),
        ("data a device", [*t, "--data.path", "/dev/null"], 2,
         "data.path = '/dev/null' is not a regular file"),
        # train: files and directories
        ("config missing", [*t, "--config", str(r / "none.toml")], 2, "does not exist"),
        ("config is a dir", [*t, "--config", str(r / "adir")], 2, "is a directory"),
        ("config bad toml", [*t, "--config", str(r / "bad.toml")], 2, "not valid TOML"),
        ("data missing", [*t, "--data.path", str(r / "no.bin")], 2, "does not exist"),
        ("data is a dir", [*t, "--data.path", str(r / "adir")], 2, "is a directory"),
        ("tokenizer missing", [*t, "--data.tokenizer", str(r / "t.json")], 2, "data.tokenizer"),
        ("checkpoint.dir a file", ["train", *SMALL, "--checkpoint.dir", str(r / "afile")], 2,
         "is a file, not a directory"),
        ("log.dir a file", ["train", *SMALL, "--log.dir", str(r / "afile")], 2, "log.dir"),
        ("checkpoint.dir unwritable", ["train", *SMALL, "--checkpoint.dir", UNWRITABLE], 2,
         "not writable"),
        ("log.dir unwritable", ["train", *SMALL, "--log.dir", UNWRITABLE], 2, "not writable"),
        ("resume path missing", [*t, "--checkpoint.resume", str(r / "nowhere")], 2,
         "checkpoint.resume"),
        # train: an earlier run
        # checkpoint.resume = auto (the default) continues a run; a fresh start is asked for
        ("fresh run over a run", ["train", *SMALL, *dirs(run), "--checkpoint.resume",
                                  "never"], 2, "--overwrite"),
        ("overwrite and resume", ["train", *SMALL, *dirs(run), "--overwrite",
                                  "--checkpoint.resume", "latest"], 2, "give one of them"),
        ("resume, other model", ["train", *SMALL, "--model.hidden_size", "64", *dirs(run),
                                 "--checkpoint.resume", "latest"], 2, "hidden_size = 32"),
        # train: Hugging Face inputs
        ("hf heads 0", [*t, "--model.hf_path", str(w["hf_heads0"])], 2, "num_attention_heads"),
        ("hf hidden str", [*t, "--model.hf_path", str(w["hf_hidden_str"])], 2, "hidden_size"),
        ("hf vocab null", [*t, "--model.hf_path", str(w["hf_vocab_null"])], 2, "vocab_size"),
        ("hf truncated", [*t, "--model.hf_path", str(w["hf_truncated"])], 2, "is damaged"),
        ("hf no config", [*t, "--model.hf_path", str(r / "adir")], 2, "no config.json"),
        # generate
        ("generate no source", ["generate", *gen], 2, "required"),
        ("generate missing", ["generate", "--checkpoint", str(r / "nope"), *gen], 2, "nope"),
        ("generate 0 tokens", ["generate", "--checkpoint", ck, "--prompt", "hi",
                               "--max-new-tokens", "0"], 2, "--max-new-tokens"),
        ("generate top_p", ["generate", "--checkpoint", ck, *gen, "--top-p", "2"], 2, "top"),
        ("generate damaged", ["generate", "--checkpoint", str(w["damaged_step"]), *gen], 2,
         "is damaged"),
        ("generate hf heads 0", ["generate", "--hf", str(w["hf_heads0"]), "--tokenizer", "byte",
                                  *gen], 2,
         "num_attention_heads"),
        ("generate hf truncated", ["generate", "--hf", str(w["hf_truncated"]), "--tokenizer",
                                   "byte", *gen], 2, "is damaged"),
        # convert
        ("convert no output", ["convert", "--checkpoint", ck], 2, "--to-hf"),
        ("convert into non-empty", ["convert", "--checkpoint", ck, "--to-hf", str(r / "full")],
         2, "not empty"),
        ("convert unwritable", ["convert", "--checkpoint", ck, "--to-hf", UNWRITABLE], 2,
         "not writable"),
        ("convert shard size", ["convert", "--checkpoint", ck, "--to-hf", str(r / "o1"),
                                "--max-shard-size", "big"], 2, "--max-shard-size"),
        ("convert damaged", ["convert", "--checkpoint", str(w["damaged_step"]), "--to-hf",
                             str(r / "o2")], 2, "is damaged"),
        ("convert incomplete", ["convert", "--checkpoint", str(w["incomplete_step"]),
                                "--to-hf", str(r / "o5")], 2, "is incomplete"),
        ("convert hf vocab null", ["convert", "--hf", str(w["hf_vocab_null"]), "--to-hf",
                                   str(r / "o3")], 2, "vocab_size"),
        ("convert hf truncated", ["convert", "--hf", str(w["hf_truncated"]), "--to-hf",
                                  str(r / "o4")], 2, "is damaged"),
        # prepare
        ("prepare no output", ["prepare", str(r / "text.txt")], 2, "-o/--out"),
        ("prepare empty", ["prepare", str(r / "empty.txt"), "-o", str(r / "e.bin")], 2,
         "hold no text"),
        ("prepare missing input", ["prepare", str(r / "none.txt"), "-o", str(r / "m.bin")], 2,
         "does not exist"),
        ("prepare exists", ["prepare", str(r / "text.txt"), "-o", str(w["tokens.bin"])], 2,
         "--overwrite"),
        ("prepare into a dir", ["prepare", str(r / "text.txt"), "-o", str(r / "adir")], 2,
         "is a directory"),
        ("prepare unwritable", ["prepare", str(r / "text.txt"), "-o", UNWRITABLE + "/t.bin"],
         2, "not writable"),
        ("prepare tiny vocab", ["prepare", str(r / "text.txt"), "-o", str(r / "v.bin"),
                                "--train-tokenizer", "100"], 2, "too small"),
        # launch
        ("launch nproc 0", ["launch", "--nproc", "0", "train", *SMALL, *new], 2,
         "--nproc-per-node 0 must be >= 1"),
        ("launch nproc vs layout", ["launch", "--nproc-per-node", "3", *t, "--parallel.dp",
                                    "2"], 2, "starts 3 rank(s) but parallel.dp·tp·pp·cp = 2"),
        ("launch misspelt option", ["launch", "--nproc-per-node", "2", *t, "--overwite",
                                    "--parallel.dp", "2"], 2,
         "unknown option --overwite (did you mean '--overwrite'?)"),
        ("launch auto no layout", ["launch", "--nproc-per-node", "3", *t, "--parallel.layout",
                                   "auto"], 2, "no layout of 3 rank(s)"),
        ("launch serve vs tp", ["launch", "--nproc-per-node", "2", "serve", "--hf",
                                str(w["hf_good"]), "--tp", "1"], 2,
         "starts 2 rank(s) but serve --tp 1"),
        ("convert int8", ["convert", "--checkpoint", str(w["q_int8"]), "--to-hf",
                          str(r / "c_int8")], 2, "holds int8 weights written by fivefold"),
        # quantize: options the method would ignore
        ("quantize symmetric nf4", ["quantize", "--checkpoint", ck, "--method", "nf4",
                                    "--symmetric", "--out", str(r / "q1")], 2,
         "--symmetric applies to --method int4 or awq only, not nf4"),
        ("quantize group size int8", ["quantize", "--checkpoint", ck, "--method", "int8",
                                      "--group-size", "64", "--out", str(r / "q2")], 2,
         "--group-size applies to --method int4 or awq only, not int8"),
        ("quantize calib int4", ["quantize", "--checkpoint", ck, "--method", "int4", "--calib",
                                 str(w["tokens.bin"]), "--out", str(r / "q3")], 2,
         "--calib applies to --method awq only, not int4"),
        # plan
        ("plan gpus 0", ["plan", "--model", "tiny", "--gpus", "0"], 2, "error: --gpus 0 must"),
        ("hw memory nan", [*plan, "--hw", "memory_gib=nan"], 2, "memory_gib=nan"),
        ("hw memory negative", [*plan, "--hw", "memory_gib=-5"], 2, "memory_gib=-5"),
        ("hw efficiency 0", [*plan, "--hw", "matmul_efficiency=0"], 2, "matmul_efficiency"),
        ("hw unknown field", [*plan, "--hw", "memroy_gib=80"], 2, "did you mean"),
        ("hw not a number", [*plan, "--hw", "memory_gib=lots"], 2, "not a number"),
        ("hw latency negative", [*plan, "--hw", "inter_latency_us=-1"], 2,
         "inter_latency_us=-1"),
        ("hw headroom over memory", [*plan, "--hw", "memory_headroom_gib=90"], 2,
         "GiB to plan"),
        ("plan unknown convention", [*plan, "--convention", "jax"], 2,
         "--convention 'jax' is unknown"),
        ("plan unknown gpu", [*plan, "--gpu", "h900"], 2, "unknown GPU"),
        ("plan schedule outside convention", ["plan", "--model", "llama-3.1-8b", "--gpus", "8",
                                              "--convention", "deepspeed", "--layout",
                                              "dp=2,pp=4,schedule=zb"], 2,
         "outside the deepspeed convention"),
        ("plan unknown model", ["plan", "--model", "nope", "--gpus", "1"], 2, "nope"),
        ("plan hf heads 0", ["plan", "--model", str(w["hf_heads0"]), "--gpus", "1"], 2,
         "num_attention_heads"),
        ("plan bad layout", [*plan, "--layout", "tp=3"], 2, "tp"),
        ("plan config dir", ["plan", "--config", str(r / "adir")], 2, "is a directory"),
        ("plan top 0", [*plan, "--top", "0"], 2, "--top 0"),
        ("plan fp8 all-gather without fp8", [*plan, "--fp8-allgather"], 2,
         "--fp8-allgather needs --precision fp8"),
        ("plan plot unwritable", [*plan, "--plot", UNWRITABLE], 2, "not writable"),
        # eval
        ("eval no source", ["eval"], 2, "required"),
        ("eval tasks no reference", ["eval", "--checkpoint", ck, "--data",
                                     str(w["tasks_noref.jsonl"]), "--out", str(r / "p.jsonl")],
         2, 'line 2 has no "reference"'),
        ("eval out exists", ["eval", "--checkpoint", ck, "--data", str(w["tasks.jsonl"]),
                             "--out", str(w["tokens.bin"])], 2, "--overwrite"),
        ("eval predictions no field", ["eval", "--predictions", str(w["tasks.jsonl"])], 2,
         'line 1 has no "prediction"'),
        ("eval missing checkpoint", ["eval", "--checkpoint", str(r / "nope")], 2, "nope"),
        ("eval empty token file", ["eval", "--checkpoint", ck, "--data", str(r / "empty.bin")],
         2, "is empty (0 bytes)"),
        # schedule and the command itself
        ("schedule unknown", ["schedule", "--schedule", "nope", "--pp", "2", "--microbatches",
                              "4", "--out", str(r / "s.png")], 2, "nope"),
        ("schedule pp 0", [*sched[:4], "0", *sched[5:], "--out", str(r / "s.png")], 2,
         "error: --pp 0 must be >= 1"),
        ("schedule unwritable", [*sched, "--out", UNWRITABLE + "/s.png"], 2, "not writable"),
        ("unknown command", ["trian"], 2, "unknown command"),
    ]
