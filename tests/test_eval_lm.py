"""The lm-evaluation-harness model "fivefold" (evaluate/lm.py, evaluate/harness.py) against
lm_eval's own Hugging Face model (HFLM) on the same locally made weights and tokenizer.

Oracle: HFLM runs transformers' LlamaForCausalLM; FivefoldLM loads the same directory
through fivefold's HF loader. Tolerances: log-likelihoods 1e-5 relative (fp32, different
summation orders), is_greedy and generated text exactly. The task test runs three task
files written here (multiple choice, rolling log-likelihood, generate-until) over a local
JSON-lines dataset: nothing is downloaded.
"""

import json

import pytest

from tests.eval_models import make_hf_dir

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from lm_eval.api.instance import Instance  # noqa: E402

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. "
ROWS = [{"question": "ROMEO: what light", "choices": [" through yonder", " the sea", " my lord"],
         "answer": 0, "text": "But soft, what light through yonder window breaks?"},
        {"question": "HAMLET: to be", "choices": [" or not", " and so", " the king"],
         "answer": 1, "text": TEXT}]


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    from lm_eval.models.huggingface import HFLM

    from fivefold.evaluate.harness import FivefoldLM

    directory, _, _ = make_hf_dir(tmp_path_factory.mktemp("hf"))
    hf = HFLM(pretrained=str(directory), device="cpu", dtype="float32", batch_size=1)
    ours = FivefoldLM(hf=str(directory))
    ours.directory = directory
    return ours, hf


def requests(kind, *args_list):
    return [Instance(kind, {}, args, i) for i, args in enumerate(args_list)]


def test_registered_under_its_name():
    from lm_eval.api.registry import get_model

    from fivefold.evaluate.harness import FivefoldLM

    assert get_model("fivefold") is FivefoldLM


def test_loglikelihood_equals_hflm(both):
    ours, hf = both
    reqs = requests("loglikelihood", ("ROMEO: ", "What say you?"), ("", "Good morrow"),
                    ("KING:", " Come hither"), (TEXT * 2, " so"))  # the last left-truncated
    got, expected = ours.loglikelihood(reqs), hf.loglikelihood(reqs)
    for (lp, greedy), (lp_hf, greedy_hf) in zip(got, expected):
        assert lp == pytest.approx(lp_hf, rel=1e-5)
        assert greedy == greedy_hf


def test_greedy_continuation_is_greedy(both):
    ours, hf = both
    gen = requests("generate_until", ("KING:", {"until": [], "max_gen_toks": 4}))
    continuation = ours.generate_until(gen)[0]
    assert continuation == hf.generate_until(gen)[0]
    reqs = requests("loglikelihood", ("KING:", continuation), ("KING:", continuation + "!"))
    assert [g for _, g in ours.loglikelihood(reqs)] == [g for _, g in hf.loglikelihood(reqs)]
    assert ours.loglikelihood(reqs)[0][1] is True


def test_rolling_over_several_windows_equals_hflm(both):
    ours, hf = both
    long = TEXT * 8  # ~200 tokens: four windows of the 64-token context
    assert len(ours.scorer.encode(long)) > 3 * ours.scorer.max_length
    reqs = requests("loglikelihood_rolling", (long,), ("Good morrow.",))
    for got, expected in zip(ours.loglikelihood_rolling(reqs), hf.loglikelihood_rolling(reqs)):
        assert got == pytest.approx(expected, rel=1e-5)


def test_generate_until_equals_hflm(both):
    ours, hf = both
    reqs = requests("generate_until", ("KING:", {"until": ["\n"], "max_gen_toks": 10}),
                    ("ROMEO: what", {"until": ["e"], "max_gen_toks": 12, "do_sample": False}))
    assert ours.generate_until(reqs) == hf.generate_until(reqs)


def _write_tasks(folder):
    data = folder / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
              f"test_split: test\n")
    (folder / "mc.yaml").write_text(
        "task: ff_mc\n" + common + "output_type: multiple_choice\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n")
    (folder / "roll.yaml").write_text(
        "task: ff_roll\n" + common + "output_type: loglikelihood_rolling\n"
        "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\nmetric_list:\n"
        "  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (folder / "gen.yaml").write_text(
        "task: ff_gen\n" + common + "output_type: generate_until\n"
        "doc_to_text: \"{{question}}\"\ndoc_to_target: \"{{choices[0]}}\"\n"
        "generation_kwargs:\n  until: [\"\\n\"]\n  max_gen_toks: 6\n"
        "metric_list:\n  - metric: exact_match\n")


def test_local_task_files_give_hflm_scores(both, tmp_path, monkeypatch):
    from fivefold.evaluate.harness import run_tasks

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _write_tasks(tmp_path)
    ours, hf = both
    names = ["ff_mc", "ff_roll", "ff_gen"]
    got, expected = run_tasks(ours, names, str(tmp_path)), run_tasks(hf, names, str(tmp_path))
    assert got.keys() == expected.keys() == set(names)
    assert got["ff_mc"]["sample_len"] == 2
    for task in names:
        assert got[task].keys() == expected[task].keys()
        for metric, value in expected[task].items():
            assert got[task][metric] == pytest.approx(value, rel=1e-5), (task, metric)
    assert got["ff_roll"]["bits_per_byte,none"] > 0


def test_the_command_runs_a_local_task(both, tmp_path, monkeypatch, capsys):
    """`fivefold eval --lm-eval`: accuracy as HFLM's log-likelihoods pick the choices."""
    from fivefold.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _write_tasks(tmp_path)
    ours, hf = both
    picks = []
    for row in ROWS:
        scores = hf.loglikelihood(requests("loglikelihood",
                                           *[(row["question"], c) for c in row["choices"]]))
        picks.append(max(range(3), key=lambda i: scores[i][0]) == row["answer"])
    argv = ["eval", "--hf", str(ours.directory), "--lm-eval-include", str(tmp_path), "--json"]
    assert main([*argv, "--lm-eval", "ff_mc"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["lm_eval"]["ff_mc"]["acc,none"] == pytest.approx(sum(picks) / len(picks))
    assert main([*argv, "--lm-eval", "ff_mc,nosuch"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --lm-eval task 'nosuch' is not a task in {tmp_path}; known: "
                   f"ff_gen, ff_mc, ff_roll")
