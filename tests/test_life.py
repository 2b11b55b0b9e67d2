"""A model's whole life, through the commands a user types, without a manual step:

    train (the default model's shape, shrunk) -> LoRA from its checkpoint (model.init_from,
    no convert) -> merged export with its tokenizer -> transformers generates the same
    greedy text, lm-eval's HFLM scores it as fivefold's lm-eval model does -> quantize
    --method awq -> eval (perplexity; BLEU/ROUGE of a task file, as sacrebleu scores the
    predictions written) -> serve (127.0.0.1, an ephemeral port) -> the openai client gets
    the greedy text `fivefold generate` prints.

Every model is tiny (width 32, 2 layers, the default corpus-bpe vocabulary of 2048, three
steps), so the text is not good; it is the same text at every hand-off, which is what is
tested. Oracles: transformers, lm-eval's HFLM, sacrebleu, the openai client.
"""

import json

import pytest
import torch

from fivefold.cli import main

transformers = pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("lm_eval")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
sacrebleu = pytest.importorskip("sacrebleu")

from test_serve_server import free_port, start_server  # noqa: E402

# init_std 0.2: three steps from wide initial weights leave a model whose greedy text varies
# token to token, with top-2 logit margins of 0.07 and more (rounding differences are
# ~1e-5), so equal texts say the hand-offs agree, not that every model repeats one token.
SHAPE = ["--model.hidden_size", "32", "--model.intermediate_size", "64",
         "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
         "--model.init_std", "0.2"]
PROMPT, NEW = "ROMEO:", 12
TASKS = [{"prompt": "ROMEO: But soft, what light", "reference": "through yonder window breaks"},
         {"prompt": "HAMLET: To be, or not", "reference": "to be, that is the question"}]


def train_argv(root, name: str, *extra: str) -> list[str]:
    """`fivefold train` of the default model (tiny-bpe, the corpus BPE) shrunk, three fp32
    steps on the CPU, writing under root/name."""
    return ["train", *SHAPE, "--train.seq_len", "32", "--train.gbs", "4", "--parallel.mbs",
            "4", "--train.steps", "3", "--train.precision", "fp32", "--train.device", "cpu",
            "--train.eval_every", "0", "--checkpoint.dir", str(root / name / "checkpoints"),
            "--log.dir", str(root / name), "--log.progress", "false", "--log.tensorboard",
            "false", *extra]


def run(capsys, *argv) -> str:
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code == 0, (argv, err)
    return out


def fivefold_greedy(capsys, *source: str) -> str:
    return run(capsys, "generate", *source, "--prompt", PROMPT, "--greedy",
               "--max-new-tokens", str(NEW), "--device", "cpu").removesuffix("\n")


@pytest.fixture(scope="module")
def life(tmp_path_factory):
    root = tmp_path_factory.mktemp("life")
    assert main(train_argv(root, "base")) == 0
    assert main(train_argv(root, "lora", "--model.init_from", str(root / "base" / "checkpoints"),
                           "--lora.rank", "4", "--lora.alpha", "8")) == 0
    return root


def test_lora_starts_from_the_checkpoint_with_a_fresh_optimizer(life, capsys):
    meta = json.loads((life / "lora" / "checkpoints" / "step_00000003" / "meta.json")
                      .read_text())
    base_step = life / "base" / "checkpoints" / "step_00000003"
    assert meta["step"] == 3 and meta["config"]["model"]["init_from"] == str(base_step)
    steps = [json.loads(line)["step"] for line in
             (life / "lora" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"]
    assert steps == [1, 2, 3]  # step 0 afresh, not the base run's 3
    # Another shape than the checkpoint's: resume's check, one line, exit 2.
    code = main(train_argv(life, "bad", "--model.init_from", str(base_step),
                           "--model.hidden_size", "64"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "model.hidden_size = 32" in err
    assert not (life / "bad").exists()


@pytest.mark.parametrize("base", ["none", "nf4"])
def test_a_peft_export_of_a_run_from_a_checkpoint_loads_by_itself(life, capsys, base):
    """model.init_from names a fivefold checkpoint, which transformers cannot load (before:
    "Should have a model_type key in its config.json"): convert --peft writes the base the
    adapters sit on beside the adapter (OUT-base; a QLoRA base dequantised from its NF4) and
    names it, so AutoPeftModelForCausalLM loads the adapter alone and gives fivefold's logits.
    Bound: the norm-wise float32 error of logits computed in another order (tolerances.py,
    item 1-2: 7 GEMMs of length <= 64 from the embedding to the logits, two runs)."""
    from tolerances import sum_rtol

    from fivefold.finetune.attach import load_for_inference

    peft = pytest.importorskip("peft")
    name = "lora" if base == "none" else "qlora"
    if base != "none":
        assert main(train_argv(life, name, "--model.init_from",
                               str(life / "base" / "checkpoints"), "--lora.rank", "4",
                               "--lora.alpha", "8", "--lora.base", base)) == 0
    checkpoint, out = life / name / "checkpoints", life / f"peft-{name}"
    printed = run(capsys, "convert", "--checkpoint", str(checkpoint), "--out", str(out),
                  "--peft")
    assert f"wrote {out}-base" in printed, printed
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(life.resolve() / f"peft-{name}-base")
    assert config["r"] == 4 and config["lora_alpha"] == 8
    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = load_for_inference(str(checkpoint))[0]
    x = torch.randint(0, 2048, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = ours(x), theirs(input_ids=x).logits
    err = ((got - want).norm() / want.norm()).item()
    assert err <= 2**0.5 * sum_rtol(64, 64**0.5) * 7**0.5, err
    # the adapters act: the base alone is far from it
    plain = transformers.AutoModelForCausalLM.from_pretrained(f"{out}-base",
                                                              dtype=torch.float32).eval()
    with torch.no_grad():
        assert ((plain(input_ids=x).logits - want).norm() / want.norm()).item() > 1e-3


def test_full_fine_tune_starts_from_the_weights(life):
    from fivefold.config import load
    from fivefold.train.checkpoint import load_model_for_inference
    from fivefold.train.trainer import Trainer

    cfg = load(None, train_argv(life, "full", "--model.init_from",
                                str(life / "base" / "checkpoints"))[1:])
    trainer = Trainer(cfg, quiet=True)
    trainer.close()
    saved = dict(load_model_for_inference(str(life / "base" / "checkpoints"))[0]
                 .named_parameters())
    assert trainer.step == 0 and trainer.optimizer.step_count() == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def test_the_whole_life(life, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lora = str(life / "lora" / "checkpoints")
    merged = life / "merged"
    run(capsys, "convert", "--checkpoint", lora, "--to-hf", str(merged))
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "generation_config.json"):
        assert (merged / name).is_file(), name
    expected = fivefold_greedy(capsys, "--checkpoint", lora)
    assert expected.startswith(PROMPT) and len(expected) > len(PROMPT)

    # transformers on the export: the same greedy text
    tok = transformers.AutoTokenizer.from_pretrained(merged)
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt")
    out = hf.generate(**ids, max_new_tokens=NEW, do_sample=False)
    assert tok.decode(out[0], skip_special_tokens=True) == expected
    assert fivefold_greedy(capsys, "--hf", str(merged)) == expected

    # lm-eval's HFLM runs on the export, scoring as fivefold's lm-eval model on the checkpoint
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from fivefold.evaluate.harness import FivefoldLM

    text = "But soft, what light through yonder window breaks?"
    request = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    theirs = HFLM(pretrained=str(merged), device="cpu", dtype="float32", batch_size=1)
    ours = FivefoldLM(checkpoint=lora)
    # fp32 sums in other orders, ~12 tokens of ~7 nats: 1e-5 relative (tests/test_eval_lm.py)
    assert ours.loglikelihood_rolling(request)[0] == pytest.approx(
        theirs.loglikelihood_rolling(request)[0], rel=1e-5)

    # AWQ on the export, calibrated on the bundled corpus in the export's own tokenizer
    from fivefold.data.tokenizer import BUILTIN

    corpus = BUILTIN["corpus-bpe"].parent
    calib = life / "calib.bin"
    run(capsys, "prepare", str(corpus / "hamlet.txt"), "-o", str(calib), "--tokenizer",
        str(merged / "tokenizer.json"))
    quantized = life / "awq"
    run(capsys, "quantize", "--hf", str(merged), "--method", "awq", "--group-size", "32",
        "--calib", str(calib), "--calib-samples", "4", "--calib-seq-len", "32",
        "--out", str(quantized))
    q_text = fivefold_greedy(capsys, "--checkpoint", str(quantized))
    assert q_text.startswith(PROMPT)

    # eval: perplexity over a token file (the float export's, and the int4 model's within a
    # few percent of it), then BLEU/ROUGE of a task file's continuations
    ppl = [json.loads(run(capsys, "eval", *source, "--data", str(calib), "--max-tokens",
                          "2000", "--json").splitlines()[-1])
           for source in (("--hf", str(merged)), ("--checkpoint", str(quantized)))]
    assert ppl[0]["tokens"] == ppl[1]["tokens"] == 1999
    assert abs(ppl[1]["perplexity"] / ppl[0]["perplexity"] - 1) < 0.05, ppl
    tasks = life / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    preds = life / "preds.jsonl"
    result = json.loads(run(capsys, "eval", "--checkpoint", str(quantized), "--data",
                            str(tasks), "--out", str(preds), "--max-new-tokens", "8",
                            "--json").splitlines()[-1])
    rows = [json.loads(line) for line in preds.read_text().splitlines()]
    assert result["examples"] == 2 and result["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu([r["prediction"] for r in rows],
                              [[r["reference"] for r in rows]]).score, abs=1e-6)
    assert 0 <= result["rougeL"] <= 1

    # serve the quantised model: the openai client's greedy text is generate's
    proc, base = start_server(["--checkpoint", str(quantized), "--port", str(free_port()),
                               "--kv-cache-gib", "0.01"])
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0,
                               timeout=60)
        name = client.models.list().data[0].id
        answer = client.completions.create(model=name, prompt=PROMPT, max_tokens=NEW,
                                           temperature=0)
        assert PROMPT + answer.choices[0].text == q_text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
