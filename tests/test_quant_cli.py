"""`fivefold quantize` end to end: a checkpoint that `fivefold generate` loads, and the bad
inputs (one line on stderr, exit 2, nothing written or overwritten)."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from common import small_config

from fivefold.cli import main
from fivefold.data.prepare import prepare
from fivefold.models.hf import save_hf
from fivefold.models.init import build_model
from fivefold.models.presets import ModelConfig
from fivefold.quant.convert import quantize_
from fivefold.quant.io import load_quantized
from fivefold.train.trainer import Trainer

CFG = ModelConfig(name="q", vocab_size=256, hidden_size=128, intermediate_size=256,
                  num_layers=2, num_heads=4, num_kv_heads=4, max_seq_len=128, init_std=0.05)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """An HF directory of a small byte-vocabulary model, and token files: one of a few
    thousand tokens, one of 20."""
    root = tmp_path_factory.mktemp("quant")
    model = build_model(CFG, seed=3)
    save_hf(model, CFG, root / "hf")
    text = root / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 80)
    prepare([str(text)], str(root / "calib.bin"))
    short = root / "short.txt"
    short.write_text("too short")
    prepare([str(short)], str(root / "short.bin"))
    return root


def digest(directory: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(directory.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def hf_byte(work) -> list[str]:
    """--hf of the byte-vocabulary model, which has no tokenizer.json: --tokenizer says so."""
    return ["--hf", str(work / "hf"), "--tokenizer", "byte"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("method", ["int8", "int4", "nf4", "mxfp4"])
def test_quantize_then_generate(work, capsys, method):
    out = work / f"q-{method}"
    code, stdout, err = run(capsys, "quantize", *hf_byte(work), "--method", method,
                            "--out", str(out))
    assert code == 0, err
    assert "size: linears" in stdout and f"with {method}" in stdout
    model, _, _ = load_quantized(out)
    # the saved model is exactly the float model quantised in memory
    expected = build_model(CFG, seed=3)
    quantize_(expected, method)
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(tokens), expected(tokens))
    code, stdout, err = run(capsys, "generate", "--checkpoint", str(out), "--prompt", "the",
                            "--max-new-tokens", "8", "--greedy")
    assert code == 0, err
    assert stdout.startswith("the")


def test_awq_with_a_calibration_file(work, capsys):
    out = work / "q-awq"
    code, stdout, err = run(capsys, "quantize", *hf_byte(work), "--method", "awq",
                            "--calib", str(work / "calib.bin"), "--calib-samples", "8",
                            "--calib-seq-len", "64", "--out", str(out))
    assert code == 0, err
    assert "AWQ: calibrating on 8 x 64 tokens" in stdout
    assert "8 linear groups searched" in stdout
    code, _, err = run(capsys, "generate", "--checkpoint", str(out), "--prompt", "the",
                       "--max-new-tokens", "4", "--greedy")
    assert code == 0, err


def test_awq_search_options_reach_the_search(work, capsys):
    """--duo --awq-loss layer --alpha-grid 5 --no-clip: the written model equals apply_awq
    with those options in memory, and the manifest records them."""
    from fivefold.quant.awq import apply_awq
    from fivefold.quant.cli import build_parser, calibration_tokens

    out = work / "q-awq-options"
    argv = [*hf_byte(work), "--method", "awq", "--calib", str(work / "calib.bin"),
            "--calib-samples", "4", "--calib-seq-len", "32", "--duo", "--awq-loss", "layer",
            "--alpha-grid", "5", "--no-clip", "--out", str(out)]
    code, stdout, err = run(capsys, "quantize", *argv)
    assert code == 0, err
    manifest = json.loads((out / "quantized.json").read_text())["awq"]
    assert (manifest["duo"], manifest["loss"], manifest["alpha_grid"], manifest["clip"]) == (
        True, "layer", 5, False)
    assert set(manifest["alphas"]) <= {0.0, 0.2, 0.4, 0.6, 0.8}   # i / 5, llm-awq's grid
    expected = build_model(CFG, seed=3)
    tokens = calibration_tokens(build_parser().parse_args(argv), CFG, "byte", None)
    apply_awq(expected, tokens, duo=True, loss="layer", n_grid=5, clip=False)
    quantize_(expected, "awq")
    model, _, _ = load_quantized(out)
    probe = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(probe), expected(probe))


def test_held_out_choice_reaches_the_search(work, capsys):
    """--awq-held-out 0.5 --awq-select logits: the written model equals apply_awq with those
    options in memory, and the manifest records the choice of every group."""
    from fivefold.quant.awq import apply_awq
    from fivefold.quant.cli import build_parser, calibration_tokens

    out = work / "q-awq-held-out"
    argv = [*hf_byte(work), "--method", "awq", "--calib", str(work / "calib.bin"),
            "--calib-samples", "4", "--calib-seq-len", "32", "--awq-held-out", "0.5",
            "--awq-select", "logits", "--alpha-grid", "5", "--out", str(out)]
    code, stdout, err = run(capsys, "quantize", *argv)
    assert code == 0, err
    manifest = json.loads((out / "quantized.json").read_text())["awq"]
    assert (manifest["held_out"], manifest["select"]) == (0.5, "logits")
    assert set(manifest["choices"]) <= {"rtn", "plain", "duo"}
    assert "on 2 held-out sequences" in stdout
    expected = build_model(CFG, seed=3)
    tokens = calibration_tokens(build_parser().parse_args(argv), CFG, "byte", None)
    apply_awq(expected, tokens, n_grid=5, held_out=0.5, select="logits")
    quantize_(expected, "awq")
    model, _, _ = load_quantized(out)
    probe = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(probe), expected(probe))


def test_awq_rounding_reaches_the_search(work, capsys):
    """--awq-rounding gptq: the written model equals apply_awq(rounding="gptq") in memory
    (GPTQ's values lie on the grid the int4 layer stores), and the manifest records it."""
    from fivefold.quant.awq import apply_awq
    from fivefold.quant.cli import build_parser, calibration_tokens

    out = work / "q-awq-gptq"
    argv = [*hf_byte(work), "--method", "awq", "--calib", str(work / "calib.bin"),
            "--calib-samples", "4", "--calib-seq-len", "32", "--alpha-grid", "5",
            "--awq-rounding", "gptq", "--out", str(out)]
    code, stdout, err = run(capsys, "quantize", *argv)
    assert code == 0, err
    assert "rounded by GPTQ" in stdout
    assert json.loads((out / "quantized.json").read_text())["awq"]["rounding"] == "gptq"
    expected = build_model(CFG, seed=3)
    tokens = calibration_tokens(build_parser().parse_args(argv), CFG, "byte", None)
    apply_awq(expected, tokens, n_grid=5, rounding="gptq")
    quantize_(expected, "awq")
    model, _, _ = load_quantized(out)
    probe = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(probe), expected(probe))


def bad_inputs(work):
    hf = str(work / "hf"), "--tokenizer", "byte"
    existing = work / "existing"
    return {
        "unknown method": (["quantize", "--hf", *hf, "--method", "int3", "--out",
                            str(work / "x1")], "--method 'int3' is unknown"),
        "group size": (["quantize", "--hf", *hf, "--method", "int4", "--group-size", "96",
                        "--out", str(work / "x2")], "--group-size 96 does not fit"),
        "short calibration": (["quantize", "--hf", *hf, "--method", "awq", "--calib",
                               str(work / "short.bin"), "--calib-seq-len", "64", "--out",
                               str(work / "x3")], "fewer than one calibration sequence of 64"),
        "awq without data": (["quantize", "--hf", *hf, "--method", "awq", "--out",
                              str(work / "x4")], "give --calib TOKENS"),
        "unknown awq loss": (["quantize", "--hf", *hf, "--method", "awq", "--awq-loss",
                              "layers", "--out", str(work / "x9")],
                             "--awq-loss 'layers' is unknown"),
        "alpha grid": (["quantize", "--hf", *hf, "--method", "awq", "--alpha-grid", "1",
                        "--out", str(work / "x10")], "--alpha-grid 1 must be >= 2"),
        "awq option without awq": (["quantize", "--hf", *hf, "--method", "int4", "--duo",
                                    "--out", str(work / "x11")],
                                   "--duo applies to --method awq only"),
        "held-out share": (["quantize", "--hf", *hf, "--method", "awq", "--awq-held-out",
                            "1.5", "--out", str(work / "x12")],
                           "--awq-held-out 1.5 must be in [0, 1)"),
        "select without held-out": (["quantize", "--hf", *hf, "--method", "awq",
                                     "--awq-select", "logits", "--out", str(work / "x13")],
                                    "--awq-select chooses on held-out sequences"),
        "unknown awq rounding": (["quantize", "--hf", *hf, "--method", "awq",
                                  "--awq-rounding", "gptqq", "--out", str(work / "x15")],
                                 "--awq-rounding 'gptqq' is unknown"),
        "rounding without awq": (["quantize", "--hf", *hf, "--method", "int4",
                                  "--awq-rounding", "gptq", "--out", str(work / "x16")],
                                 "--awq-rounding applies to --method awq only"),
        "nothing to hold out": (["quantize", "--hf", *hf, "--method", "awq", "--calib-samples",
                                 "1", "--awq-held-out", "0.5", "--out", str(work / "x14")],
                                "cannot be split"),
        "existing output": (["quantize", "--hf", *hf, "--method", "int8", "--out",
                             str(existing)], "already exists"),
        "quantised to train (hf_path)": (["train", "--model.hf_path", str(work / "q-int8"),
                                          "--checkpoint.dir", str(work / "x5")],
                                         "is a quantised checkpoint"),
        "quantised to train (resume)": (["train", "--checkpoint.resume", str(work / "q-int8"),
                                         "--checkpoint.dir", str(work / "x6")],
                                        "is a quantised checkpoint"),
        "quantised to train (dir)": (["train", "--checkpoint.dir", str(work / "q-int8")],
                                     "is a quantised checkpoint"),
        "quantise a quantised one": (["quantize", "--checkpoint", str(work / "q-int8"),
                                      "--method", "int4", "--out", str(work / "x7")],
                                     "already quantised"),
        "convert a quantised one": (["convert", "--checkpoint", str(work / "q-int8"),
                                     "--to-hf", str(work / "x8")],
                                    "holds int8 weights written by fivefold quantize"),
    }


def test_bad_inputs_are_one_line_exit_2_and_write_nothing(work, capsys):
    if not (work / "q-int8").is_dir():       # run alone: make the quantised checkpoint
        assert main(["quantize", *hf_byte(work), "--method", "int8", "--out",
                     str(work / "q-int8")]) == 0
    (work / "existing").mkdir(exist_ok=True)
    (work / "existing" / "keep.txt").write_text("mine")
    before = {d: digest(work / d) for d in ("existing", "q-int8", "hf")}
    capsys.readouterr()
    for case, (argv, expected) in bad_inputs(work).items():
        code, out, err = run(capsys, *argv)
        assert code == 2, (case, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], (case, err)
    assert before == {d: digest(work / d) for d in ("existing", "q-int8", "hf")}
    assert not any((work / f"x{i}").exists() for i in range(1, 15))


def test_awq_from_a_training_checkpoint_calibrates_on_its_training_split(tmp_path, capsys):
    trainer = Trainer(small_config(tmp_path, "--train.steps", "3"), quiet=True)
    for _ in range(3):
        trainer.train_step()
    trainer.save_checkpoint()
    trainer.close()
    out = tmp_path / "q-awq"
    code, stdout, err = run(capsys, "quantize", "--checkpoint", str(tmp_path / "ckpt"),
                            "--method", "awq", "--group-size", "32", "--calib-samples", "4",
                            "--out", str(out))
    assert code == 0, err
    # Not 512 (the --calib-seq-len default): at most the train.seq_len it was trained at.
    assert "AWQ: calibrating on 4 x 32 tokens" in stdout
    model, cfg, tokenizer = load_quantized(out)
    assert cfg.hidden_size == 32 and tokenizer == "byte"
    code, stdout, err = run(capsys, "generate", "--checkpoint", str(out), "--prompt", "The",
                            "--max-new-tokens", "4", "--greedy")
    assert code == 0, err
