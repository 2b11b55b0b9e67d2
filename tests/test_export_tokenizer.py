"""A byte-level run exported for Hugging Face (models/hf_tokenizer.py), and --hf directories
without a tokenizer. The BPE export (the default run's corpus-bpe) is tested end to end in
tests/test_life.py. Oracle: transformers' AutoTokenizer and AutoModelForCausalLM."""

import json
import socket

import pytest
import torch

from fivefold.cli import main
from fivefold.train.trainer import Trainer
from tests.common import small_config

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    cfg = small_config(root, "--train.steps", "2", "--model.init_std", "0.2")
    trainer = Trainer(cfg, quiet=True)
    for _ in range(2):
        trainer.train_step()
    trainer.save_checkpoint()
    trainer.close()
    assert main(["convert", "--checkpoint", str(root / "ckpt"), "--to-hf",
                 str(root / "hf")]) == 0
    return root


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_a_byte_run_exports_a_tokenizer_transformers_loads(byte_export, capsys):
    hf_dir = byte_export / "hf"
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    text = "ROMEO: héllo wörld\n  €"
    assert tok(text)["input_ids"] == list(text.encode("utf-8"))  # ids are the bytes
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 0  # NUL, the separator
    assert json.loads((hf_dir / "tokenizer_config.json").read_text())["model_max_length"] == \
        json.loads((hf_dir / "config.json").read_text())["max_position_embeddings"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    out = model.generate(**tok("ROMEO:", return_tensors="pt"), max_new_tokens=10,
                         do_sample=False)
    code, printed, err = run(capsys, "generate", "--checkpoint", str(byte_export / "ckpt"),
                             "--prompt", "ROMEO:", "--greedy", "--max-new-tokens", "10")
    assert code == 0, err
    assert tok.decode(out[0], skip_special_tokens=True) == printed.removesuffix("\n")


def test_quantize_records_the_exported_tokenizer(byte_export, capsys):
    """The issue's failure: quantize --hf recorded "byte" for any export and generate from
    the quantised checkpoint then died on ids past 255."""
    q = byte_export / "q"
    code, _, err = run(capsys, "quantize", "--hf", str(byte_export / "hf"), "--method", "int8",
                       "--out", str(q))
    assert code == 0, err
    assert json.loads((q / "quantized.json").read_text())["tokenizer"] == "tokenizer.json"
    code, printed, err = run(capsys, "generate", "--checkpoint", str(q), "--prompt", "ROMEO:",
                             "--greedy", "--max-new-tokens", "6")
    assert code == 0 and printed.startswith("ROMEO:"), err


@pytest.mark.parametrize("command", [["generate", "--prompt", "x"], ["eval"],
                                     ["quantize", "--method", "int8", "--out", "unused"],
                                     ["serve", "--port", "free"]])
def test_hf_without_a_tokenizer_is_one_line(byte_export, tmp_path, capsys, command):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((byte_export / "hf" / name).read_bytes())
    if command[-1] == "free":  # serve checks its port first: one nobody holds
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            command = [*command[:-1], str(s.getsockname()[1])]
    code, out, err = run(capsys, command[0], "--hf", str(bare), *command[1:])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "has no tokenizer.json; give --tokenizer" in err
    assert not (tmp_path / "unused").exists()
