"""`train.compile`: graphs and graph breaks per step, this tree against a baseline revision.

    python3 bench/train/compile_graphs.py                     # every case (about 2 CPU-minutes)
    python3 bench/train/compile_graphs.py selective fp8_selective

Each tree (`git archive`d `--baseline`, and this one) runs each case in its own process
(PYTHONPATH at its src/): 3 steps, compiled, of the tests' tiny model (2 blocks, hidden 32,
4 x 32 tokens per step, fp32, the byte corpus; FP8 cases hidden 128). Per step it prints the
graphs compiled so far and the graph breaks so far (torch._dynamo.utils.counters), the loss
and gradient norm, then why the graph broke (the first line of each reason, with its count)
and what one more micro-batch's forward saves for backward (tensors and bytes, once per
storage, the parameters left out). Each case's losses are compared with the same tree's
compiled run without recomputation (`none` / `fp8_none`): `same as none` means bit-equal.
It writes bench/results/compile_graphs.json (machine, versions, git revisions).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from revisions import baseline_src

ROOT = Path(__file__).resolve().parents[2]
BASELINE = "f9d3bbc"  # selective recomputation broke the compiled block on the replay tape
BASE = ["--model.preset", "tiny", "--data.tokenizer", "byte", "--parallel.mbs", "1",
        "--model.hidden_size", "32", "--model.intermediate_size", "64",
        "--model.num_layers", "2", "--model.num_heads", "4", "--model.num_kv_heads", "2",
        "--train.seq_len", "32", "--train.gbs", "4", "--train.steps", "5",
        "--train.warmup_steps", "0", "--train.eval_every", "0", "--train.precision", "fp32",
        "--train.device", "cpu", "--checkpoint.every", "0", "--log.progress", "false",
        "--log.tensorboard", "false", "--train.compile", "true"]
FP8 = ["--train.precision", "fp8", "--train.fp8_recipe", "tensorwise",
       "--model.hidden_size", "128", "--model.intermediate_size", "256"]
MOE = ["--model.preset", "tiny-moe", "--model.num_experts", "4", "--model.experts_top_k", "2",
       "--model.moe_intermediate_size", "32"]
CASES = {"none": [], "selective": ["--train.recompute", "selective"],
         "full": ["--train.recompute", "full"], "fp8_none": FP8,
         "fp8_selective": [*FP8, "--train.recompute", "selective"],
         "fp8_full": [*FP8, "--train.recompute", "full"],
         # keep gate,up,down in both blocks: left eager (parallel/recompute.py)
         "fp8_auto_keep": [*FP8, "--train.recompute", "auto", "--train.memory_budget_gib",
                           "0.00525"], "moe": MOE,
         "moe_bf16": [*MOE, "--train.precision", "bf16"],
         "moe_bf16_full": [*MOE, "--train.precision", "bf16", "--train.recompute", "full"],
         # the planner's per-layer policies under this budget: keep v,up,down and keep v,up
         "auto_keep": ["--train.recompute", "auto", "--train.memory_budget_gib", "0.00055"]}
REFERENCE = {"selective": "none", "full": "none", "fp8_selective": "fp8_none",
             "fp8_full": "fp8_none",
             "auto_keep": "none", "moe_bf16_full": "moe_bf16"}


# ---- the worker: runs in a subprocess with PYTHONPATH at one tree's src/ -------------------

def worker(case: str, steps: int) -> None:
    import torch
    from torch._dynamo.utils import counters

    from fivefold import config
    from fivefold.train.trainer import Trainer

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config.load(None, [*BASE, "--checkpoint.dir", f"{tmp}/ckpt", "--log.dir",
                                 f"{tmp}/log", *CASES[case]])
        trainer = Trainer(cfg, quiet=True)
        policies = [c.label() for c in trainer.recompute_policies or []]
        rows = []
        for _ in range(steps):
            m = trainer.train_step()
            rows.append({"loss": m["loss"], "grad_norm": m["grad_norm"],
                         "graphs": counters["stats"]["unique_graphs"],
                         "breaks": sum(counters["graph_break"].values())})
        params = {p.untyped_storage()._cdata for _, p in trainer.model.named_parameters()}
        saved = {}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key not in params:
                saved[key] = t.untyped_storage().nbytes()
            return t

        tokens = torch.arange(32).remainder(7)[None]  # one micro-batch, as trained
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = trainer.model.chunks[0](tokens, tokens)
        loss.backward()
        trainer.close()
    reasons = {}
    for reason, count in counters["graph_break"].items():
        line = " ".join(reason.split("\n", 2)[:2]).strip()[:160]
        reasons[line] = reasons.get(line, 0) + count
    print(json.dumps({"steps": rows, "break_reasons": reasons, "policies": policies,
                      "saved_storages": len(saved), "saved_bytes": sum(saved.values())}))


# ---- the driver -----------------------------------------------------------------------------

def run_case(src: Path, case: str, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, __file__, "--worker", case, "--steps", str(steps)],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return {"error": ([ln for ln in lines if "Error" in ln] or lines)[-1:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="*", help=f"of {', '.join(CASES)} (default: all)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    bad = [c for c in args.cases if c not in CASES]
    if bad or args.steps < 1:
        print(f"compile_graphs: unknown case {bad[0]!r} (of {', '.join(CASES)})" if bad
              else "compile_graphs: --steps must be at least 1", file=sys.stderr)
        return 2
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    cases = args.cases or list(CASES)
    cases += [REFERENCE[c] for c in cases if c in REFERENCE and REFERENCE[c] not in cases]
    import torch

    from fivefold.train.bench import git_revision, machine, repo_relative

    trees = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in (("baseline", baseline_src(args.baseline, Path(tmp))),
                          ("this", ROOT / "src")):
            trees[name] = {case: run_case(src, case, args.steps) for case in cases}
    for case in cases:
        print(f"{case}:")
        for name, runs in trees.items():
            run = runs[case]
            if "error" in run:
                print(f"  {name:8s} failed: {run['error']}")
                continue
            ref = runs.get(REFERENCE.get(case), {}).get("steps")
            same = [(s["loss"], s["grad_norm"]) for s in run["steps"]] == \
                [(s["loss"], s["grad_norm"]) for s in ref] if ref else None
            run["same_as_reference"] = same
            counts = ", ".join(f"{s['graphs']}/{s['breaks']}" for s in run["steps"])
            print(f"  {name:8s} graphs/breaks after each step {counts}; saved "
                  f"{run['saved_bytes']:,} bytes in {run['saved_storages']} storages"
                  + ("" if same is None else f"; same as {REFERENCE[case]}: {same}"))
            if run["policies"]:
                print(f"           policies: {', '.join(run['policies'])}")
            for reason, count in run["break_reasons"].items():
                print(f"           {count} x {reason}")
    record = {"bench": "compile_graphs", "baseline": args.baseline, "steps": args.steps,
              "git_revision": git_revision(), "machine": machine(torch.device("cpu")),
              "torch": torch.__version__, "trees": trees}
    path = ROOT / "bench" / "results" / "compile_graphs.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {repo_relative(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
