"""The command line: bad input gives one line and exit code 2; the main job runs end to end."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from common import small_config

from fivefold.cli import main
from fivefold.data.prepare import prepare
from fivefold.train.trainer import Trainer

# The tests' model: the byte tokenizer with tiny's vocabulary, one sequence per micro-batch.
SMALL = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "2", "--train.seq_len", "32", "--train.gbs", "4", "--train.steps", "3",
         "--train.eval_every", "0", "--log.progress", "false", "--log.tensorboard", "false"]


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.err


@pytest.fixture
def workdir(tmp_path):
    """A token file, a corrupt one, an empty text file and a checkpoint of another model."""
    text = tmp_path / "text.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 40)
    prepare([str(text)], str(tmp_path / "tokens.bin"))
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes((tmp_path / "tokens.bin").read_bytes()[:-7])
    (tmp_path / "corrupt.bin.json").write_text((tmp_path / "tokens.bin.json").read_text())
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "bad.toml").write_text("[train\nsteps = 3\n")
    (tmp_path / "garbled" / "step_00000001").mkdir(parents=True)
    (tmp_path / "garbled" / "step_00000001" / "meta.json").write_text("{")
    other = small_config(tmp_path, "--model.hidden_size", "64",
                         "--checkpoint.dir", str(tmp_path / "other"))
    t = Trainer(other, quiet=True)
    t.train_step()
    t.save_checkpoint()
    return tmp_path


def bad_inputs(w: Path):
    ck = ["--checkpoint.dir", str(w / "ck"), "--log.dir", str(w / "log")]
    return {
        "unknown key": (["train", "--train.lrr", "1e-3"], "did you mean 'lr'"),
        "unknown section": (["train", "--trian.lr", "1e-3"], "did you mean 'train'"),
        "wrong type": (["train", "--train.steps", "many"], "train.steps"),
        "gbs vs mbs": (["train", "--train.gbs", "6", "--parallel.mbs", "4"], "train.gbs = 6"),
        "missing data": (["train", "--data.path", str(w / "nope.bin")], "data.path"),
        "empty corpus": (["prepare", str(w / "empty.txt"), "-o", str(w / "e.bin")],
                         "hold no text"),
        "corrupt tokens": (["train", "--data.path", str(w / "corrupt.bin"), *SMALL, *ck],
                           "corrupt.bin"),
        "vocab too small": (["train", "--model.vocab_size", "100", *SMALL, *ck], "vocab_size"),
        "corpus BPE, byte vocabulary": (["train", *SMALL, "--data.tokenizer", "corpus-bpe", *ck],
                                        "or data.tokenizer = byte"),
        "other model's checkpoint": (
            ["train", *SMALL, "--checkpoint.dir", str(w / "other"), "--checkpoint.resume",
             "latest", "--log.dir", str(w / "log")], "hidden_size = 64"),
        "bad choice": (["train", "--train.precision", "fp64"], "train.precision"),
        "missing config": (["train", "--config", str(w / "none.toml")], "none.toml"),
        "bad toml": (["train", "--config", str(w / "bad.toml")], "not valid TOML"),
        "negative lr": (["train", "--train.lr", "-1"], "train.lr"),
        "seq_len too long": (["train", "--train.seq_len", "4096"], "max_seq_len"),
        "tp vs heads": (["train", "--parallel.tp", "3"], "parallel.tp = 3"),
        "sp without tp": (["train", "--parallel.sp", "true"], "parallel.sp"),
        "vocab below tp": (["train", "--model.vocab_size", "5", "--parallel.tp", "4"],
                           "only padding rows"),
        "pipeline stages": (["train", "--parallel.pp", "8"], "model.num_layers = 4"),
        "too few micro-batches": (["train", "--parallel.pp", "2", "--parallel.schedule",
                                   "dualpipev", "--parallel.mbs", "8"], "dualpipev"),
        "unknown preset": (["train", "--model.preset", "llama-9b"], "model.preset"),
        "kv heads": (["train", "--model.num_kv_heads", "3"], "num_kv_heads"),
        "resume path": (["train", "--checkpoint.resume", str(w / "nowhere")], "checkpoint.resume"),
        "not launched": (["train", "--parallel.dp", "2", *SMALL, *ck], "torchrun"),
        "unknown command": (["trian"], "unknown command"),
        "cp chunks": (["train", "--parallel.cp", "3"], "2·parallel.cp = 6"),
        "cp scheme": (["train", "--parallel.cp_comm", "ulysses"], "parallel.cp_comm"),
        "cp not launched": (["train", "--parallel.cp", "2", *SMALL, *ck], "torchrun"),
        "experts top-k": (["train", "--model.num_experts", "4", "--model.experts_top_k", "8",
                           "--model.moe_intermediate_size", "32"], "model.experts_top_k = 8"),
        "whole q/k norm under tp": (["train", "--model.qk_norm", "true", "--model.qk_norm_whole",
                                     "true", "--parallel.tp", "2"], "model.qk_norm_whole"),
        "experts with sp": (["train", "--model.num_experts", "4", "--model.experts_top_k", "2",
                             "--model.moe_intermediate_size", "32", "--parallel.tp", "2",
                             "--parallel.sp", "true"], "sequence parallelism"),
        "experts over ep": (["train", "--model.num_experts", "6", "--model.experts_top_k", "2",
                             "--model.moe_intermediate_size", "32", "--parallel.dp", "4",
                             "--parallel.ep", "4"], "parallel.ep = 4 does not divide model"),
        "ep over dp·cp": (["train", "--model.num_experts", "4", "--model.experts_top_k", "2",
                           "--model.moe_intermediate_size", "32", "--parallel.dp", "3",
                           "--parallel.ep", "2"], "does not divide parallel.dp·cp = 3"),
        "ep without experts": (["train", "--parallel.dp", "2", "--parallel.ep", "2"],
                               "needs a mixture-of-experts model"),
        "eval batches": (["train", "--train.eval_batches", "0"], "train.eval_batches"),
        "adam eps": (["train", "--train.eps", "-1"], "train.eps"),
        "garbled checkpoint": (["generate", "--checkpoint", str(w / "garbled" / "step_00000001"),
                                "--prompt", "x"], "garbled"),
        "missing argument": (["generate", "--prompt", "x"], "--checkpoint --hf is required"),
        "argument type": (["generate", "--checkpoint", str(w / "other"), "--prompt", "x",
                           "--max-new-tokens", "many"], "invalid int value: 'many'"),
        "no output": (["prepare", str(w / "text.txt")], "-o/--out"),
        "convert source": (["convert", "--to-hf", str(w / "out")], "--hf --checkpoint"),
        "fp8 all-gather without zero 3": (["train", "--parallel.fp8_allgather", "true",
                                           "--train.precision", "fp8", "--train.fp8_recipe",
                                           "tensorwise"], "got zero = 0"),
        "fp8 all-gather without fp8": (["train", "--parallel.fp8_allgather", "true",
                                        "--parallel.zero", "3"], "precision = 'auto'"),
        "fp8 all-gather rowwise": (["train", "--parallel.fp8_allgather", "true", "--parallel.zero",
                                    "3", "--train.precision", "fp8", "--train.fp8_recipe",
                                    "rowwise"], "recipe = 'rowwise'"),
    }


def test_bad_inputs_give_one_line_and_exit_2(workdir, capsys):
    cases = bad_inputs(workdir)
    assert len(cases) >= 15
    before = sorted(p.name for p in (workdir / "other").rglob("*"))
    for name, (args, expected) in cases.items():
        code, err = run_cli(args, capsys)
        lines = err.strip().splitlines()
        assert code == 2, (name, err)
        assert len(lines) == 1 and "error: " in lines[0], (name, err)
        assert expected in lines[0], (name, lines[0])
    # Nothing written: no checkpoint or log directory appeared, the old checkpoint is intact.
    assert not (workdir / "ck").exists() and not (workdir / "log").exists()
    assert sorted(p.name for p in (workdir / "other").rglob("*")) == before


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fivefold.cli", "train", "--train.gbs", "5",
                           "--parallel.mbs", "2"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: train.gbs = 5 is not divisible by parallel.mbs × parallel.dp = 2; make gbs a "
        "multiple of it"]
    assert "Traceback" not in proc.stderr and not any(tmp_path.iterdir())


KILLER = textwrap.dedent("""
    import os, signal, sys
    import fivefold.train.checkpoint as ck
    from fivefold import config
    from fivefold.train.loop import run
    real_sync = ck._fsync_tree
    def sync_then_die(path):
        real_sync(path)
        if path.name == "step_00000004.tmp":  # written and flushed, not yet published
            os.kill(os.getpid(), signal.SIGKILL)
    ck._fsync_tree = sync_then_die
    run(config.load(None, sys.argv[1:]))
""")


def test_sigkill_during_save_leaves_previous_checkpoint_usable(tmp_path):
    args = [*SMALL[:-12], "--train.seq_len", "32", "--train.gbs", "4", "--train.eval_every", "0",
            "--log.progress", "false", "--log.tensorboard", "false", "--train.device", "cpu",
            "--train.steps", "6", "--train.warmup_steps", "0", "--checkpoint.every", "2",
            "--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log")]
    proc = subprocess.run([sys.executable, "-c", KILLER, *args], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (tmp_path / "ck" / "latest").read_text() == "step_00000002"
    assert (tmp_path / "ck" / "step_00000004.tmp").is_dir()  # the interrupted save

    from fivefold import config

    resumed = Trainer(config.load(None, [*args, "--checkpoint.resume", "latest"]), quiet=True)
    assert resumed.step == 2
    after = [resumed.train_step()["loss"] for _ in range(4)]
    straight = Trainer(config.load(None, [*args, "--checkpoint.resume", "never"]), quiet=True)
    losses = [straight.train_step()["loss"] for _ in range(6)]
    assert after == losses[2:]
    resumed.save_checkpoint()  # the next save clears the leftover .tmp
    assert not (tmp_path / "ck" / "step_00000004.tmp").exists()


def test_train_then_generate_end_to_end(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    train = subprocess.run(
        [sys.executable, "-m", "fivefold.cli", "train", *SMALL, "--train.steps", "6",
         "--train.eval_every", "3", "--log.tensorboard", "true", "--log.progress", "true",
         "--checkpoint.dir", str(tmp_path / "ck"),
         "--log.dir", str(tmp_path / "log"), "--log.every", "1"],
        capture_output=True, text=True, env=env)
    assert train.returncode == 0, train.stderr
    records = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").open()]
    steps = [r for r in records if r["kind"] == "train"]
    vals = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and [r["step"] for r in vals] == [3, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "memory_bytes"):
        assert key in steps[0]
    assert list((tmp_path / "log" / "tensorboard").glob("events.out.tfevents.*"))
    assert "val_loss" in train.stdout and "step      6" in train.stdout
    # The planner's prediction at start, and the measured model states after step 1.
    assert "plan: model states" in train.stdout and "MiB allocated (activations" in train.stdout
    assert "model states per rank, planned/measured MiB" in train.stdout
    gen = subprocess.run(
        [sys.executable, "-m", "fivefold.cli", "generate", "--checkpoint", str(tmp_path / "ck"),
         "--prompt", "It was", "--max-new-tokens", "20", "--greedy"],
        capture_output=True, text=True, env=env)
    assert gen.returncode == 0, gen.stderr
    assert gen.stdout.startswith("It was") and len(gen.stdout) > len("It was")


@pytest.mark.parametrize("args, mbs", [
    ([], 16),                                                # the default job: one micro-batch
    (["--parallel.dp", "2"], 8),                             # the rank's share
    (["--parallel.pp", "2"], 1),                             # pipelines: most micro-batches
    (["--train.seq_len", "1024", "--train.gbs", "48"], 4),   # within 4096 tokens
    (["--train.seq_len", "512", "--train.gbs", "10"], 5),    # a divisor of the batch
    (["--train.seq_len", "2048", "--model.max_seq_len", "4096", "--parallel.cp", "2",
      "--train.gbs", "8"], 4),                               # tokens per rank: seq / cp
    (["--model.preset", "llama-3.1-8b", "--train.seq_len", "8192", "--train.gbs", "32"], 1),
    (["--parallel.mbs", "2"], 2),                            # a given mbs is kept
])
def test_auto_micro_batch(args, mbs):
    """parallel.mbs = 0 becomes the largest divisor of the rank's batch within 4096 tokens
    per rank (1 under a pipeline), before anything else reads it."""
    from fivefold import config

    cfg = config.load(None, args)
    assert cfg.parallel.mbs == mbs
    assert cfg.train.gbs % (cfg.parallel.mbs * cfg.parallel.dp) == 0


def test_example_configs_load_and_tiny_is_the_default():
    """Every shipped example passes validation, and examples/tiny.toml is the built-in
    default job written out (only its run directories differ)."""
    from fivefold import config

    examples = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.toml"))
    assert len(examples) >= 3
    loaded = {p.stem: config.load(p) for p in examples}
    tiny, default = loaded["tiny"].to_dict(), config.load(None).to_dict()
    for d in (tiny, default):
        del d["checkpoint"]["dir"], d["log"]["dir"]
    assert tiny == default
    # The planner reads the file without validating it, and plans the micro-batch auto picks.
    from fivefold.plan.inputs import read_training_config, training_plan_inputs

    tiny_toml = next(p for p in examples if p.stem == "tiny")
    _, layout = training_plan_inputs(read_training_config(tiny_toml))
    assert layout.mbs == 16 == loaded["tiny"].parallel.mbs


def test_the_corpus_tokenizer_follows_the_vocabulary():
    """data.tokenizer = auto: the shipped BPE for a model that can hold its 2048 tokens, bytes
    for the byte-vocabulary presets; an explicit choice is kept."""
    from fivefold.config import corpus_tokenizer
    from fivefold.models.presets import preset

    assert corpus_tokenizer("auto", preset("tiny-bpe").vocab_size) == "corpus-bpe"
    assert corpus_tokenizer("auto", preset("llama-25m").vocab_size) == "corpus-bpe"
    assert corpus_tokenizer("auto", preset("tiny").vocab_size) == "byte"
    assert corpus_tokenizer("auto", preset("tiny-moe").vocab_size) == "byte"
    assert corpus_tokenizer("auto", 2047) == "byte"
    assert corpus_tokenizer("byte", 4096) == "byte"
    assert corpus_tokenizer("corpus-bpe", 256) == "corpus-bpe"  # then refused, with the fix


def test_python_dash_m_runs_the_same_command_line():
    """`python -m fivefold` is the `fivefold` script: the same help, the same bad-input exit."""
    ok = subprocess.run([sys.executable, "-m", "fivefold", "help"], capture_output=True,
                        text=True, timeout=120)
    assert ok.returncode == 0 and "train" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "fivefold", "--nonsense"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
