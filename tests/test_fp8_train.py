"""train.precision = fp8 through the engine: bad inputs, what is kept out of FP8, the saved
activations of FP8 linears, and checkpoints that stay high-precision and resume under bf16."""

import pathlib

import pytest
import torch
from common import small_config
from torch import nn

from fivefold.cli import main
from fivefold.config import ConfigError
from fivefold.lowp.convert import convert_to_fp8
from fivefold.lowp.linear import FP8LinearMixin, FP8Recipe
from fivefold.models.init import build_model
from fivefold.models.presets import preset
from fivefold.parallel.memory import SavedActivations
from fivefold.parallel.peak import PeakTracker
from fivefold.plan.activations import activation_bytes_per_microbatch
from fivefold.train.trainer import Trainer

SMALL = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
         "--model.hidden_size", "32", "--model.intermediate_size", "64", "--model.num_layers",
         "2", "--train.seq_len", "32", "--train.gbs", "4", "--train.steps", "2",
         "--train.eval_every", "0", "--log.progress", "false", "--log.tensorboard", "false"]


def test_bad_fp8_inputs_give_one_line_exit_2_and_write_nothing(tmp_path, capsys):
    out = ["--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log")]
    cases = {
        "unknown recipe": (["--train.precision", "fp8", "--train.fp8_recipe", "perblock"],
                           "train.fp8_recipe = 'perblock' is not one of"),
        "fp8 with fp16": (["--train.precision", "fp16", "--train.fp8_recipe", "rowwise"],
                          "needs train.precision = 'fp8', not 'fp16'"),
        "gradient format": (["--train.precision", "fp8", "--train.fp8_grad_format", "e3m4"],
                            "train.fp8_grad_format"),
        "keep-out matching nothing": (["--train.precision", "fp8", "--train.fp8_keep_out",
                                       "layers.7"], "'layers.7' matches no linear"),
        "compiled blockwise on a CPU": (["--train.precision", "fp8", "--train.fp8_recipe",
                                         "blockwise", "--train.compile", "true",
                                         "--train.device", "cpu"],
                                        "inductor cannot compile the blockwise FP8 linear"),
    }
    for name, (args, expected) in cases.items():
        code = main(["train", *SMALL, *out, *args])
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2, (name, lines)
        assert len(lines) == 1 and expected in lines[0], (name, lines)
    assert not (tmp_path / "ck").exists() and not (tmp_path / "log").exists()


def test_keep_out_and_what_always_stays_high_precision():
    cfg = preset("tiny-moe").replace(num_layers=2, shared_expert_intermediate_size=32,
                                     shared_expert_gate=True)
    model = build_model(cfg, seed=0)
    converted = convert_to_fp8(model, FP8Recipe.from_name("rowwise"), ["layers.0", "down_proj"])
    fp8 = {n for n, m in model.named_modules() if isinstance(m, FP8LinearMixin)}
    assert fp8 and fp8 <= set(converted)
    assert not any(n.startswith("layers.0.") or n.endswith("down_proj") for n in fp8)
    assert "layers.1.self_attn.q_proj" in fp8
    assert "layers.1.mlp.experts" in converted  # the routed experts' GEMMs
    # the output head and the shared expert's gate stay bf16 whatever the list says
    assert type(model.layers[1].mlp.shared_expert_gate) is nn.Linear
    assert model.lm_head is None or type(model.lm_head) is nn.Linear
    with pytest.raises(ConfigError, match="'nothing_here' matches no linear"):
        convert_to_fp8(model, FP8Recipe(), ["nothing_here"])


@pytest.mark.parametrize("recipe", ["rowwise", "blockwise"])
def test_saved_activations_of_fp8_linears_are_half_their_bf16_size(recipe):
    """One forward of the tiny Llama in bf16 and in fp8, counted by distinct storages as the
    peak tracker counts them. The linears' inputs (q, k, v share one, gate and up share one,
    down_proj's) are saved in 1 byte instead of 2, plus their scales. o_proj's input is the
    exception: in bf16 it is a view of the attention output that SDPA saves anyway (no bytes
    of its own); in fp8 it is a new 1-byte copy beside it. The difference is checked to the
    byte, against the formula and against the planner (plan/fp8.py), item by item."""
    cfg = preset("tiny")
    mbs, seq = 2, 64
    tokens = torch.randint(0, cfg.vocab_size, (mbs, seq))
    saved = {}
    for precision in ("bf16", "fp8"):
        model = build_model(cfg, seed=0, dtype=torch.bfloat16)
        if precision == "fp8":
            convert_to_fp8(model, FP8Recipe.from_name(recipe))
        with SavedActivations(model.parameters()) as meter:
            model(tokens, tokens)
        saved[precision] = meter.bytes
    t, h, f, q, layers = mbs * seq, cfg.hidden_size, cfg.intermediate_size, cfg.q_size, \
        cfg.num_layers
    halved = layers * t * (h + h + f)  # bf16 bytes 2·n become 1·n: n saved
    o_proj_copy = layers * t * q
    # fp32 scales of the 4 FP8 inputs: rowwise saves x quantised along the tokens (one
    # scale per channel); blockwise one per token per 128-channel tile
    scales = layers * 4 * (h + h + f + q if recipe == "rowwise" else
                           t * sum(-(-k // 128) for k in (h, h, f, q)))
    assert saved["bf16"] - saved["fp8"] == halved - o_proj_copy - scales
    planned = {p: activation_bytes_per_microbatch(cfg, mbs, seq, dtype_bytes=2, fp8_recipe=r)
               for p, r in (("bf16", ""), ("fp8", recipe))}
    assert planned["bf16"].outside_terms == planned["fp8"].outside_terms
    assert layers * (planned["bf16"].layer - planned["fp8"].layer) == (
        saved["bf16"] - saved["fp8"])
    for item in ("qkv_input", "mlp_input"):  # half, plus the scales
        assert planned["fp8"].layer_terms[item] * 2 < planned["bf16"].layer_terms[item] * 1.1


def test_the_fp8_kernel_line_is_said_once_and_not_under_quiet(tmp_path, capsys):
    args = [*SMALL, "--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log")]
    cfg = small_config(tmp_path, *args, "--train.precision", "fp8", "--train.fp8_recipe",
                       "tensorwise")
    for quiet in (True, False):
        Trainer(cfg, quiet=quiet).close()
        out = capsys.readouterr().out.splitlines()
        said = [line for line in out if line.startswith("fp8: ")]
        assert said == ([] if quiet else ["fp8: tensorwise GEMMs on torch._scaled_mm "
                                          "(torch's cpu kernel)"]), out


def test_fp8_checkpoint_is_high_precision_and_resumes_under_bf16(tmp_path):
    args = [*SMALL, "--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log")]
    cfg = small_config(tmp_path, *args, "--train.precision", "fp8")
    trainer = Trainer(cfg, quiet=True)
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    tensors = trainer.logical_tensors()
    trainer.save_checkpoint()
    trainer.close()
    assert all(v.dtype in (torch.float32, torch.bfloat16, torch.int64) for k, v in
               tensors.items() if isinstance(v, torch.Tensor)), "FP8 is not a storage format"
    bf16 = small_config(tmp_path, *args, "--train.precision", "bf16", "--train.steps", "3",
                        "--checkpoint.resume", "latest")
    resumed = Trainer(bf16, quiet=True)
    assert resumed.step == 2
    again = resumed.logical_tensors()
    for key, value in tensors.items():
        if key.startswith("model/"):
            assert torch.equal(again[key].float(), value.float()), key
    loss = resumed.train_step()["loss"]
    resumed.close()
    assert abs(loss - losses[-1]) < 0.5 and torch.isfinite(torch.tensor(loss))
    assert pathlib.Path(tmp_path / "ck").exists()


@pytest.mark.parametrize("recipe", ["blockwise", "tensorwise"])
def test_an_inf_in_an_fp8_gemm_reaches_the_bad_step_guard(tmp_path, recipe):
    """An inf in a weight would saturate to ±448 in a plain cast and train on silently; here
    its scaling group becomes NaN, so the loss is non-finite and the step is skipped."""
    args = [*SMALL, "--checkpoint.dir", str(tmp_path / "ck"), "--log.dir", str(tmp_path / "log")]
    cfg = small_config(tmp_path, *args, "--train.precision", "fp8", "--train.fp8_recipe", recipe)
    trainer = Trainer(cfg, quiet=True)
    up = trainer.model.chunks[0].layers[0].mlp.up_proj
    assert isinstance(up, FP8LinearMixin)
    with torch.no_grad():
        up.weight[3, 5] = float("inf")
    record = trainer.train_step()
    trainer.close()
    assert record["skipped"] and record["bad"], record


def test_scaled_mm_recipes_are_refused_on_a_gpu_without_fp8(monkeypatch):
    """No GPU here: the device query is replaced by an A100's (8.0) and an H100's (9.0)."""
    from fivefold.lowp.convert import check_fp8_device

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    for recipe in ("rowwise", "tensorwise"):
        with pytest.raises(ConfigError, match="compute capability 8.0"):
            check_fp8_device(FP8Recipe.from_name(recipe), cuda)
    check_fp8_device(FP8Recipe.from_name("blockwise"), cuda)  # K slices in fp32 run anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    check_fp8_device(FP8Recipe.from_name("rowwise"), cuda)


@pytest.mark.parametrize("keep_out", ["", "layers.0", "o_proj,gate_proj", "q_proj,down_proj"])
def test_peak_tracker_sees_what_the_planner_plans_for_fp8(tmp_path, keep_out):
    """The trainer's peak tracker (saved tensors held through its own hooks) measures the
    activation peak of one step in bf16 and in fp8 (blockwise); their difference is the
    planner's difference of the layers' saved bytes, to the byte. Also with linears kept
    out of FP8 (train.fp8_keep_out): a kept-out block saves as bf16 does; a kept-out o_proj
    saves no copy of its input, a kept-out gate its bf16 input beside up's FP8 copy, a
    kept-out q its bf16 input beside k's and v's FP8 one, a kept-out down_proj the bf16
    product (plan/memory.py `layers_activation_bytes`)."""
    from fivefold.plan.inputs import training_plan_inputs
    from fivefold.plan.memory import _activations, layers_activation_bytes

    peaks, planned = {}, {}
    for precision in ("bf16", "fp8"):
        keep = ["--train.fp8_keep_out", keep_out] if keep_out and precision == "fp8" else []
        cfg = small_config(tmp_path / precision, "--train.precision", precision, *keep)
        trainer = Trainer(cfg, quiet=True)
        trainer.train_step()
        with PeakTracker(trainer.peak_sources()) as tracker:
            trainer.train_step()
        peaks[precision] = tracker.item_peaks["activations"]
        trainer.close()
        work, layout = training_plan_inputs(cfg)
        assert layout.mbs == 1 and layout.recompute == "none"
        planned[precision] = layers_activation_bytes(work, layout, _activations(work, layout),
                                                     0, work.model.num_layers)
    # (a kept-out q or gate saves its bf16 input and its neighbours' FP8 copy: more)
    assert peaks["fp8"] < peaks["bf16"] or "q_proj" in keep_out
    assert peaks["bf16"] - peaks["fp8"] == planned["bf16"] - planned["fp8"]
