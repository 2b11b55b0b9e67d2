"""The single-device fast path: gradient-norm precision, fused AdamW, the SDPA kernel check
and per-block compilation (parity with eager)."""

import collections
import os

import pytest
import torch
from common import small_config
from tolerances import loss_rtol, trained_rtol, within

from fivefold.parallel.update import squared_grad_norm
from fivefold.train.metrics import sdpa_backend
from fivefold.train.trainer import Trainer


def test_grad_norm_squares_accumulate_in_float64_on_cpu():
    """Over 6M fp32 gradient values the squared norm is the float64 sum of their squares,
    shares included, and stays float64 (the owners reduce it over ranks so, and round it
    once): the two float64 sums differ only in the order of their additions, each term
    exact, so by at most ~n·2^-53 relative for n = 6M, bounded here by 1e-9 (fp32
    `_foreach_norm` is off by far more at this size, checked below)."""
    torch.manual_seed(0)
    grads = [torch.randn(2_000_000) * scale for scale in (1e-3, 1.0, 30.0)]
    shares = [1.0, 0.5, 0.25]
    got = squared_grad_norm(grads, shares, torch.device("cpu"))
    exact = sum(float((g.double() ** 2).sum()) * s for g, s in zip(grads, shares))
    assert got.dtype == torch.float64
    assert abs(float(got) - exact) / exact <= 1e-9
    # What the ZeRO optimizer did before: fp32 `_foreach_norm`, here 6e-5 off.
    norms = torch.stack(torch._foreach_norm(grads))
    before = float((norms.pow(2) * torch.tensor(shares)).sum())
    assert abs(before - exact) / exact > 100 * abs(float(got) - exact) / exact


def test_cpu_step_uses_fused_adamw_and_logs_the_attention_kernel(tmp_path):
    trainer = Trainer(small_config(tmp_path), quiet=True)
    assert trainer.optimizer.optimizer.defaults["fused"] is True
    # The CPU has SDPA's flash kernel for fp32 and bf16, with grouped-query heads too.
    cpu = torch.device("cpu")
    assert sdpa_backend(cpu, torch.float32, 4, 2, 8) == "flash"
    assert sdpa_backend(cpu, torch.bfloat16, 8, 8, 64) == "flash"


@pytest.mark.slow
@pytest.mark.parity
def test_compiled_blocks_match_eager(tmp_path):
    """train.compile = true (inductor, the system C++ compiler on CPU) against eager, fp32,
    3 steps from the same seed: losses within loss_rtol, gradient norms and final weights
    within trained_rtol (tests/tolerances.py: inductor fuses and reorders the same float32
    sums; 4 sequences of 32 tokens per step, 2 blocks of 3 GEMMs). The first step compiles
    (tens of seconds on 2 cores). The third step of each is profiled: the compiled block's
    kernels per layer stay within the fusion budget below, with the same GEMMs as eager."""
    import torch._inductor.config as inductor_config

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded 2-core machine: no OpenMP threads spinning
    runs, launched = {}, {}
    try:
        # Each generated C++ kernel records itself in the profiler (part of the generated
        # code, so a kernel cache warmed by another run cannot hide it).
        with inductor_config.patch("cpp.enable_kernel_profile", True):
            for flag in ("false", "true"):
                trainer = Trainer(small_config(tmp_path, "--train.compile", flag), quiet=True)
                records = [trainer.train_step() for _ in range(2)]
                cpu = [torch.profiler.ProfilerActivity.CPU]
                with torch.profiler.profile(activities=cpu) as prof:
                    records.append(trainer.train_step())
                launched[flag] = collections.Counter(e.name for e in prof.events())
                weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
                runs[flag] = (records, weights)
    finally:
        torch.set_num_threads(threads)
    (eager, w_eager), (compiled, w_compiled) = runs["false"], runs["true"]
    # The compiled block's budget (kernels per layer and micro-batch, forward + backward, beside
    # its 21 GEMMs and 2 attention kernels, which stay library calls): what fusion can reach.
    # Forward 5: norm, RoPE on q and k, residual add + second norm, SiLU·up, residual add.
    # Backward 7: SiLU·up's, second norm's two reductions (input, weight) with the residual's
    # gradient, RoPE's, the attention backward's input layout, first norm's two reductions.
    # Eager, the same layer is 41 kernels on the GPU's paths (tests/test_trace.py).
    blocks_run = 2 * 4  # small_config: 2 blocks, 4 micro-batches of 1 sequence
    fused = sum(n for name, n in launched["true"].items() if "cpp_fused_" in name)
    assert 0 < fused <= 12 * blocks_run, (fused, launched["true"])
    assert not any("cpp_fused_" in name for name in launched["false"])
    # no GEMM added or lost by compiling
    assert launched["true"]["aten::mm"] == launched["false"]["aten::mm"] > 21 * blocks_run
    loss_tol, trained_tol = loss_rtol(4 * 32, 3 * 2), trained_rtol(4 * 32, 3 * 2)
    for a, b in zip(eager, compiled):
        assert within(abs(a["loss"] - b["loss"]) / a["loss"], loss_tol, "compile loss")
        assert within(abs(a["grad_norm"] - b["grad_norm"]) / a["grad_norm"], trained_tol,
                      "compile grad norm")
    for name, w in w_eager.items():
        err = float((w_compiled[name] - w).norm() / w.norm())
        assert within(err, trained_tol, f"compile {name}"), (name, err)


def test_compiled_cpu_kernels_are_cached_per_cpu_capability(monkeypatch, tmp_path):
    """Inductor's kernel cache is not keyed on ATEN_CPU_CAPABILITY, and kernels built under
    one capability misbehave under another (parallel/apply.py): a CPU compile uses a cache
    of its own per capability, and a cache directory the user named stays theirs."""
    from fivefold.parallel.apply import separate_cpu_kernel_cache

    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        from torch._inductor.runtime.runtime_utils import default_cache_dir
    capability = torch.backends.cpu.get_cpu_capability().lower()
    for before in (None, default_cache_dir()):  # unset, or inductor's own default written
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        separate_cpu_kernel_cache()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(
            os.path.abspath(default_cache_dir()), f"cpu-{capability}")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    separate_cpu_kernel_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)
