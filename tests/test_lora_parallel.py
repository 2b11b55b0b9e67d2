"""LoRA under data parallelism with ZeRO-2, tensor (and sequence) parallelism and pipeline
parallelism: the same per-step losses, gradient norms and final adapters as the
single-process LoRA run (fp32, same seed and global batch; the float32 error model's
tolerances of tests/tolerances.py, as for full training: common.assert_same_lora_run)."""

import tempfile
from pathlib import Path

import pytest
from common import assert_same_lora_run, save_tiny_hf_llama, small_config
from harness import run_ranks

from fivefold.parallel.mesh import ParallelDims

# train.eps = 1e-4, not 1e-8: Adam moves an entry by lr·g/(|g| + eps), which for a gradient
# entry near zero turns a rounding difference δ of the sum order into lr·δ/eps of parameter;
# at eps = 1e-8 and lr = 1e-2 that is 1e6·δ (δ ~ 5e-9 under tp2 gave 1.5e-3 after 4 steps,
# with losses and gradient norms equal to 1e-6). The comparison is of the layouts' gradients,
# so the optimizer is kept well-conditioned.
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--train.lr", "1e-2", "--train.steps", "4",
        "--lora.targets", "all-linear", "--train.eps", "1e-4"]


def _run(rank, world, tmp, layout):
    from fivefold.train.trainer import Trainer

    cfg = small_config(Path(tmp) / f"r{rank}", *LORA, *layout)
    dims = ParallelDims.from_config(cfg.parallel)
    with Trainer(cfg, dims, quiet=True) as trainer:
        records = [trainer.train_step() for _ in range(cfg.train.steps)]
        tensors = {k: v for k, v in trainer.logical_tensors().items()
                   if k.startswith("model/")}
        frozen = sum(p.grad is not None for _, p in trainer.model.named_parameters(frozen=True)
                     if not p.requires_grad)
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], tensors, frozen


@pytest.fixture(scope="module")
def single():
    with tempfile.TemporaryDirectory() as tmp:
        return run_ranks(_run, 1, tmp, [])[0]  # a child: one thread, as the ranks run


@pytest.mark.parity
@pytest.mark.parametrize("layout", [
    ["--parallel.dp", "2"],
    ["--parallel.dp", "2", "--parallel.zero", "1"],
    ["--parallel.dp", "2", "--parallel.zero", "2"],
    ["--parallel.dp", "2", "--parallel.zero", "3"],
    ["--parallel.tp", "2"],
    ["--parallel.tp", "2", "--parallel.sp", "true"],
    ["--parallel.pp", "2"],
], ids=["dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2", "tp2-sp", "pp2"])
def test_lora_layout_matches_single_process(single, layout):
    losses, norms, tensors, _ = single
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_run, world, tmp, layout)
    assert all(frozen == 0 for *_, frozen in results)  # no rank made a base gradient
    assert all(".lora_" in k for k in tensors)
    assert_same_lora_run(losses, norms, tensors, [r[:3] for r in results])


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qlora") / "hf"
    save_tiny_hf_llama(path)
    return path


@pytest.mark.parity
@pytest.mark.parametrize("layout", [["--parallel.dp", "2", "--parallel.zero", "2"],
                                    ["--parallel.pp", "2"]], ids=["dp2-zero2", "pp2"])
def test_qlora_layout_matches_single_process(hf_base, layout):
    """QLoRA (an NF4 base from a Hugging Face directory): every rank quantises the same base
    the same way, so the layouts agree with one process as LoRA does."""
    qlora = ["--model.hf_path", str(hf_base), "--lora.base", "nf4"]
    with tempfile.TemporaryDirectory() as tmp:
        losses, norms, tensors, _ = run_ranks(_run, 1, tmp, qlora)[0]
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_run, 2, tmp, qlora + layout)
    assert_same_lora_run(losses, norms, tensors, [r[:3] for r in results])

