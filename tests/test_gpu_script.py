"""bench/gpu.py --dry-run: the GPU script's every item on CPU with tiny shapes, through the
same code paths where a CPU has them, so that a GPU run cannot fail for a reason a CPU would
have shown. Every item gives numbers or a one-line reason; those with a CPU path, numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_gpu", ROOT / "bench" / "gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_gives_every_item_numbers_or_a_reason(tmp_path, capsys):
    gpu = _load_script()
    out = tmp_path / "gpu.json"
    assert gpu.main(["--dry-run", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    items = record["items"]
    assert list(items) == [name for name, _, _ in gpu.ITEMS]
    for name, item in items.items():
        if item["status"] == "ok":
            body = {k: v for k, v in item.items() if k not in ("seconds", "cpu_seconds")}
            assert gpu.numbers_in(body), (name, item)
        else:
            reason = item["reason"]
            assert reason and "\n" not in reason, (name, item)
        if item["cpu_path"]:
            assert item["status"] == "ok", (name, item.get("reason"))
    assert record["dry_run"] and record["machine"]["torch"] == torch.__version__
    # the GPU-only items say why they did not run here
    assert "GPUs only" in items["mfu_vs_plan"]["reason"]
    assert "CUDA-only" in items["fp8_kernel_float64"]["reason"]
    # the numbers are the ones each item is about
    gemms = items["fp8_gemms"]
    assert len([k for k in gemms if "->" in k]) == 3
    for shape in (k for k in gemms if "->" in k):
        assert set(gemms[shape]["ratio_vs_bf16"]) == {"tensorwise", "rowwise", "blockwise",
                                                      "tensorwise_delayed", "rowwise_gw_hp"}
        assert "emulated" in gemms[shape]["kernels"]["blockwise"]  # the CPU path, said so
    assert items["cp_ring_vs_sdpa"]["within_bf16"]
    serve = items["serve_vs_transformers"]
    assert serve["identical_outputs"] == serve["requests"]  # fp32, same weights, greedy
    layouts = items["peak_memory_vs_plan"]["layouts"]
    assert set(layouts) == {"full_recompute", "selective", "fp8"}
    for run in (*layouts.values(), items["qlora_step"]):
        assert run["tracked_peak_bytes"] > 0 and run["planned_peak_bytes"] > 0
        assert set(run["planned_items"]) >= {"params", "grads", "optimizer"}
    assert items["train_default"]["backend"] == "gloo"  # NCCL on CUDA
    assert layouts["fp8"]["fp8_kernel"].startswith("fp8: blockwise GEMMs emulated")
    assert layouts["selective"]["fp8_kernel"] is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_full_run_is_refused_in_one_line(capsys):
    assert _load_script().main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dry-run" in err[0]


def test_profile_dry_run_profiles_each_part(capsys):
    """bench/gpu_profile.py --dry-run: each part (the training step, FP8 and bf16 linears, the
    Engine) runs under the profiler on CPU and prints its table; none fails."""
    spec = importlib.util.spec_from_file_location("bench_gpu_profile",
                                                  ROOT / "bench" / "gpu_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--dry-run", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "failed:" not in out, out[-2000:]
    headers = [line for line in out.splitlines() if line.startswith("=== ")]
    assert [h.split(":")[0] for h in headers] == [
        "=== training step (8B-shaped blocks)", "=== 3 x FP8 tensorwise linear 128x128->128 (fp8",
        "=== 3 x FP8 blockwise linear 128x128->128 (fp8", "=== 3 x bf16 linear 128x128->128",
        "=== Engine, 2 requests x 8 tokens (tiny)"], headers
