"""`fivefold eval` end to end, in process: every number against an independent oracle.

- Scores of saved predictions equal sacrebleu.corpus_bleu and rouge_score's RougeScorer
  called directly (1e-6).
- Perplexity of an HF model over a token file equals exp of transformers' mean loss over
  the same windows (1e-5 relative, fp32); of a fivefold checkpoint over its validation
  split, the trainer's own validation loss over the same windows (1e-6 relative).
- Greedy task predictions equal transformers' greedy `generate` on the same weights.
- Bad inputs: one line on stderr, exit 2, nothing written or overwritten.
"""

import json
import math
import sys

import pytest
import torch

from fivefold.cli import main
from tests.common import small_config
from tests.eval_models import make_hf_dir

transformers = pytest.importorskip("transformers")
sacrebleu = pytest.importorskip("sacrebleu")
rouge_scorer = pytest.importorskip("rouge_score.rouge_scorer")

PREDICTIONS = [
    {"prediction": "the cat sat on the mat", "reference": "the cat is sitting on the mat"},
    {"prediction": "a quick brown fox jumps", "reference": "the quick brown fox jumped over"},
    {"prediction": "nothing in common", "reference": "entirely different words here"},
]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_dir(tmp_path_factory.mktemp("hf"))


def test_scores_equal_sacrebleu_and_rouge_score(tmp_path, capsys):
    path = write_jsonl(tmp_path / "preds.jsonl", PREDICTIONS)
    code, out, err = run(capsys, "--predictions", str(path), "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    preds = [r["prediction"] for r in PREDICTIONS]
    refs = [r["reference"] for r in PREDICTIONS]
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(preds, [refs]).score, abs=1e-6)
    assert 0 < result["bleu"] < 100
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    for kind in ("rouge1", "rouge2", "rougeL"):
        direct = sum(scorer.score(r, p)[kind].fmeasure for p, r in zip(preds, refs)) / 3
        assert result[kind] == pytest.approx(direct, abs=1e-6)
    assert result["perplexity"] is None and result["examples"] == 3
    assert result["run"]["task"] == "score predictions"


def test_perplexity_of_hf_model_over_a_token_file(hf_dir, tmp_path, capsys):
    from fivefold.data.prepare import prepare

    directory, _, hf = hf_dir
    text = tmp_path / "play.txt"
    text.write_text("But soft, what light through yonder window breaks? It is the east. " * 6)
    tokens = tmp_path / "play.bin"
    prepare([str(text)], str(tokens), tokenizer=str(directory / "tokenizer.json"))
    code, out, err = run(capsys, "--hf", str(directory), "--data", str(tokens), "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    ids = torch.from_numpy(__import__("numpy").fromfile(
        tokens, dtype=json.loads(tokens.with_name("play.bin.json").read_text())["dtype"])
    ).long()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, ids.numel() - 1, 64):  # windows of 64 targets, as documented
            window = ids[start:start + 65][None]
            total += float(hf(input_ids=window, labels=window).loss) * (window.shape[1] - 1)
            count += window.shape[1] - 1
    assert count > 64  # more than one window
    assert result["tokens"] == count == ids.numel() - 1
    assert result["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert result["run"]["seq_len"] == 64 and result["bleu"] is None


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A fivefold checkpoint after one step, and the trainer's validation loss there."""
    from fivefold.train.trainer import Trainer

    root = tmp_path_factory.mktemp("run")
    cfg = small_config(root, "--train.steps", "2", "--train.eval_batches", "2")
    with Trainer(cfg, quiet=True) as trainer:
        trainer.train_step()
        val_loss = trainer.evaluate()["val_loss"]
        trainer.save_checkpoint()
    return root / "ckpt", val_loss


# the trainer's validation: 2 batches of 4 windows of 32 targets from the split's start
VAL_TOKENS = 2 * 4 * 32


def test_checkpoint_perplexity_is_the_trainers_validation_loss(trained, capsys):
    checkpoint, val_loss = trained
    code, out, err = run(capsys, "--checkpoint", str(checkpoint), "--json",
                         "--max-tokens", str(VAL_TOKENS + 1))
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["tokens"] == VAL_TOKENS
    assert result["loss"] == pytest.approx(val_loss, rel=1e-6)
    assert "validation split (last 0.05)" in result["run"]["data"]


def test_a_quantised_checkpoint_is_scored_on_its_sources_split(trained, tmp_path, capsys):
    """`fivefold quantize` output: the validation split of the float checkpoint it came
    from, through the quantised model `fivefold generate` loads (its own perplexity on those
    tokens, exactly), near the float model's (int8 weights)."""
    pytest.importorskip("fivefold.quant.io")
    from fivefold.evaluate.loading import checkpoint_meta
    from fivefold.evaluate.perplexity import checkpoint_validation, perplexity
    from fivefold.quant.io import load_quantized

    checkpoint, val_loss = trained
    quantised = tmp_path / "q"
    assert main(["quantize", "--checkpoint", str(checkpoint), "--method", "int8", "--out",
                 str(quantised)]) == 0
    capsys.readouterr()
    code, out, err = run(capsys, "--checkpoint", str(quantised), "--json", "--max-tokens",
                         str(VAL_TOKENS + 1))
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    tokens, _, seq_len = checkpoint_validation(checkpoint_meta(checkpoint))
    model = load_quantized(quantised)[0]
    direct = perplexity(model, tokens, seq_len, max_tokens=VAL_TOKENS + 1)
    assert result["tokens"] == direct.tokens == VAL_TOKENS
    assert result["loss"] == direct.loss
    assert result["loss"] != val_loss and result["loss"] == pytest.approx(val_loss, rel=1e-2)


def test_task_predictions_are_transformers_greedy(hf_dir, tmp_path, capsys):
    directory, tok, hf = hf_dir
    prompts = ["ROMEO:", "What light through"]
    tasks = write_jsonl(tmp_path / "tasks.jsonl",
                        [{"prompt": p, "reference": "through yonder window", "id": i}
                         for i, p in enumerate(prompts)])
    out_path = tmp_path / "out" / "preds.jsonl"
    code, out, err = run(capsys, "--hf", str(directory), "--data", str(tasks), "--out",
                         str(out_path), "--max-new-tokens", "6", "--json")
    assert code == 0, err
    written = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [w["id"] for w in written] == [0, 1] and all("_line" not in w for w in written)
    for prompt, record in zip(prompts, written):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            new = hf.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        if len(new) and int(new[-1]) == tok.eos_token_id:
            new = new[:-1]
        assert record["prediction"] == tok.decode(new)
    result = json.loads(out.strip().splitlines()[-1])
    preds = [w["prediction"] for w in written]
    refs = [w["reference"] for w in written]
    assert result["bleu"] == pytest.approx(sacrebleu.corpus_bleu(preds, [refs]).score, abs=1e-6)
    assert result["run"]["decoding"] == "greedy"


def test_a_line_without_reference_is_one_line_and_writes_nothing(hf_dir, tmp_path, capsys):
    directory, _, _ = hf_dir
    tasks = write_jsonl(tmp_path / "tasks.jsonl",
                        [{"prompt": "a", "reference": "b"}, {"prompt": "c"}])
    out_path = tmp_path / "preds.jsonl"
    code, out, err = run(capsys, "--hf", str(directory), "--data", str(tasks), "--out",
                         str(out_path))
    assert code == 2
    assert err.strip() == (f'error: {tasks} line 2 has no "reference"; every line needs '
                           f"'prompt', 'reference'")
    assert not out_path.exists() and out == ""


@pytest.mark.parametrize("rows, argv_extra, message", [
    ([{"reference": "x"}], [], 'line 1 has no "prediction"'),
    ([{"prediction": 3, "reference": "x"}], [], '"prediction" is int, not a string'),
    ([], [], "holds no lines"),
])
def test_bad_prediction_files(tmp_path, capsys, rows, argv_extra, message):
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    code, _, err = run(capsys, "--predictions", str(path), *argv_extra)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_existing_out_is_not_overwritten(hf_dir, tmp_path, capsys):
    directory, _, _ = hf_dir
    tasks = write_jsonl(tmp_path / "tasks.jsonl", [{"prompt": "a", "reference": "b"}])
    out_path = tmp_path / "preds.jsonl"
    out_path.write_text("keep me\n")
    code, _, err = run(capsys, "--hf", str(directory), "--data", str(tasks), "--out",
                       str(out_path))
    assert code == 2 and "--overwrite" in err
    assert out_path.read_text() == "keep me\n"


def test_a_missing_extra_is_named(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "sacrebleu", None)  # import sacrebleu now fails
    path = write_jsonl(tmp_path / "p.jsonl", PREDICTIONS)
    code, _, err = run(capsys, "--predictions", str(path))
    assert code == 2
    assert err.strip() == ("error: BLEU needs the sacrebleu package, which is not installed: "
                           "pip install 'fivefold[eval]'")
