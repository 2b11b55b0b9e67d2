"""The planner's recommended layouts for the README: Llama 3.2 1B, 3.1 8B, 70B and 405B on 8 to
16,384 H100s at 4k and 8k sequence length, and one memory-bar picture.

    python bench/plan/plan_readme.py   # writes docs/planner-table.md, docs/memory-bars.png and
                                  # the table in README.md if it has the plan_readme markers
                                  # (today docs/planner.md links the table instead)

The table holds predictions only, so it is the same on every run; search times (which depend
on the machine) are printed, not written.
"""

import time
from pathlib import Path

from fivefold.models.presets import preset
from fivefold.plan.evaluate import plan_layout
from fivefold.plan.hardware import GIB, get_hardware
from fivefold.plan.layout import Layout, Workload
from fivefold.plan.plots import plot_memory
from fivefold.plan.search import SearchSpace, search

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BEGIN, END = "<!-- plan_readme: begin -->", "<!-- plan_readme: end -->"
# (model, GPUs, global batch in tokens): batches as Llama 3 used them (4M-16M tokens) at scale,
# smaller where fewer GPUs make a 4M-token step minutes long.
ROWS = [
    ("llama-3.2-1b", 8, 1 << 20), ("llama-3.2-1b", 64, 2 << 20),
    ("llama-3.1-8b", 8, 1 << 20), ("llama-3.1-8b", 64, 2 << 20), ("llama-3.1-8b", 512, 4 << 20),
    ("llama-3.1-70b", 64, 2 << 20), ("llama-3.1-70b", 512, 4 << 20),
    ("llama-3.1-70b", 2048, 8 << 20),
    ("llama-3.1-405b", 1024, 4 << 20), ("llama-3.1-405b", 16384, 16 << 20),
]
SEQ_LENS = (4096, 8192)


def table() -> str:
    hw, assume = get_hardware("h100-sxm")
    space = SearchSpace(strict_layers=False)  # uneven pipeline stages, as Llama 3 405B used
    lines = [
        ("| model | H100s | seq | batch (tokens) | recommended layout | micro-batches | "
        "memory (GiB of 80) | tokens/s/GPU | MFU |"),
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, gpus, tokens in ROWS:
        for seq in SEQ_LENS:
            work = Workload(preset(name), seq_len=seq, gbs=tokens // seq)
            start = time.perf_counter()
            result = search(work, gpus, hw, assume, space, top=3)
            print(f"search {name} on {gpus} GPUs, seq {seq}: "
                  f"{time.perf_counter() - start:.2f} s")
            if not result.top:
                lines.append(f"| {name} | {gpus:,} | {seq} | {tokens / 1e6:.1f}M | no layout fits"
                             f" | | | | |")
                continue
            best = result.top[0]
            lines.append(
                f"| {name} | {gpus:,} | {seq} | {tokens / 1e6:.1f}M | `{best.layout.short()}` | "
                f"{best.num_microbatches} | {best.memory_total / GIB:.1f} | "
                f"{best.tokens_per_s_per_gpu:,.0f} | {best.mfu:.1%} |")
    notes = (
        "\nPredicted by `fivefold plan` (bf16 with fp32 master weights and AdamW, 16 bytes "
        "per parameter; flash attention; H100 SXM 80 GiB, 989 TFLOPS dense bf16, NVLink "
        "450 GB/s and 50 GB/s per GPU between nodes). MFU counts 6·N + 12·L·s·d FLOPs per "
        "token (non-causal attention) against the dense peak. Layout names: dp/tp/pp/cp; "
        "`+sp` sequence parallelism; schedule in brackets; `z` ZeRO stage; `mbs` micro-batch; "
        "`rc` activation recomputation. Pipeline stages may hold unequal layer counts "
        "(126 layers on 16 stages, as Llama 3 405B did). These are model predictions, not "
        "measurements.\n")
    return "\n".join(lines) + "\n" + notes


def memory_picture(path: Path) -> None:
    """Llama 3.1 8B on 8 H100s at 8k: how ZeRO, recomputation, CP and TP change the memory."""
    hw, assume = get_hardware("h100-sxm")
    work = Workload(preset("llama-3.1-8b"), seq_len=8192, gbs=128)
    layouts = [
        Layout(dp=8, zero=0), Layout(dp=8, zero=1), Layout(dp=8, zero=3),
        Layout(dp=8, zero=3, recompute="selective"), Layout(dp=8, zero=1, recompute="full"),
        Layout(dp=4, tp=2, sp=True, zero=1), Layout(dp=4, cp=2, zero=1),
    ]
    plans = [plan_layout(work, lay, hw, assume) for lay in layouts]
    plot_memory(plans, path, "Llama 3.1 8B, 8 × H100 80 GiB, seq 8192, mbs 1 (✗: does not fit)")


def update_readme(text: str) -> bool:
    """Replace the table between the markers in README.md; False when the markers are gone."""
    readme = ROOT / "README.md"
    old = readme.read_text()
    if BEGIN not in old or END not in old:
        return False
    head, rest = old.split(BEGIN, 1)
    readme.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}")
    return True


def main() -> None:
    DOCS.mkdir(exist_ok=True)
    text = table()
    (DOCS / "planner-table.md").write_text(text)
    memory_picture(DOCS / "memory-bars.png")
    print(text)
    readme = " and README.md" if update_readme(text) else " (README.md has no markers)"
    print(f"wrote {DOCS / 'planner-table.md'}, {DOCS / 'memory-bars.png'}{readme}")


if __name__ == "__main__":
    main()
