"""How long a huge request holds up the server: /health latency while 8 MiB prompts arrive.

    python3 bench/serve/serve_stall.py [--mib 8] [--requests 2] [--baseline REV]

Starts `fivefold serve` on a tiny model (the bundled corpus-bpe tokenizer, 127.0.0.1), then,
from a second process, posts `--requests` prompts of `--mib` MiB of English-like text each
(each is refused with a 400 for its length after being parsed and tokenised, as the 8 MB
prompt of issue 43 was; this tree's server takes bodies up to 4x --mib for it) while this
process asks /health back to back. Prints /health's
latency idle and during the big requests (worst, p99, median), for this tree and, with
`--baseline REV`, for that revision's server in the same run (the peer), and writes
bench/results/serve_stall.json with the machine, versions and git revision. The goal: no
/health waits more than 100 ms. Numbers on a shared 2-core machine are noisy; the worst
case there includes the client's own scheduling.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench" / "train"))

import httpx  # noqa: E402
import torch  # noqa: E402

from fivefold.models.hf import save_hf  # noqa: E402
from fivefold.models.init import build_model  # noqa: E402
from fivefold.models.presets import ModelConfig  # noqa: E402
from fivefold.train.bench import cpu_model, git_revision, machine  # noqa: E402

CFG = ModelConfig(name="stall", vocab_size=2048, hidden_size=32, intermediate_size=64,
                  num_layers=1, num_heads=2, num_kv_heads=1, max_seq_len=256, init_std=0.1,
                  tie_embeddings=True)
SENDER = """
import sys, httpx
url, mib, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
words = "the quick brown fox jumps over the lazy dog and runs far away "
text = (words * (mib * 2**20 // len(words) + 1))[:mib * 2**20]
body = ('{"prompt": "' + text + '", "max_tokens": 1}').encode()
print("ready", flush=True)
sys.stdin.readline()
for _ in range(n):
    r = httpx.post(url, content=body, timeout=120, headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text[:200])
"""


def health_latencies(client: httpx.Client, base: str, until) -> list[float]:
    out = []
    while not until():
        t = time.perf_counter()
        assert client.get(f"{base}/health").status_code == 200
        out.append(time.perf_counter() - t)
    return out


def summary(ms: list[float]) -> dict:
    ms = sorted(ms)
    return {"n": len(ms), "worst_ms": round(ms[-1], 2),
            "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 2),
            "median_ms": round(statistics.median(ms), 2)}


def measure(src: Path, model_dir: str, args, extra: tuple[str, ...] = ()) -> dict:
    """/health idle and during the big prompts, against the server of `src`."""
    from test_serve_server import free_port, start_server

    os.environ["PYTHONPATH"] = str(src)  # the server process runs this source tree
    port = free_port()
    proc, base = start_server(["--hf", model_dir, "--tokenizer", "corpus-bpe", "--port",
                               str(port), "--kv-cache-gib", "0.01", *extra])
    try:
        client = httpx.Client(timeout=60)
        t_end = time.monotonic() + 2
        idle = health_latencies(client, base, lambda: time.monotonic() > t_end)
        sender = subprocess.Popen([sys.executable, "-c", SENDER, f"{base}/v1/completions",
                                   str(args.mib), str(args.requests)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        sender.stdout.readline()
        sender.stdin.write("\n")
        sender.stdin.flush()
        t0 = time.perf_counter()
        busy = health_latencies(client, base, lambda: sender.poll() is not None)
        elapsed = time.perf_counter() - t0
        assert sender.returncode == 0, "the sender failed"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return {"idle": summary([x * 1e3 for x in idle]),
            "busy": summary([x * 1e3 for x in busy]), "requests_s": round(elapsed, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=8)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--baseline", help="a git revision whose server to measure beside")
    p.add_argument("--out", default=str(ROOT / "bench/results/serve_stall.json"))
    args = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        save_hf(build_model(CFG, seed=1).eval(), CFG, Path(tmp) / "model")
        # this tree refuses bodies over 2 MiB by default; the point is to take them
        results["this tree"] = measure(ROOT / "src", str(Path(tmp) / "model"), args,
                                       ("--max-request-bytes", str(4 * args.mib * 2**20)))
        if args.baseline:
            from revisions import baseline_src

            src = baseline_src(args.baseline, Path(tmp) / "baseline")
            results[args.baseline] = measure(src, str(Path(tmp) / "model"), args)
    for name, r in results.items():
        print(f"{name:>10}: /health idle worst {r['idle']['worst_ms']} ms; during "
              f"{args.requests} x {args.mib} MiB prompts ({r['requests_s']} s) worst "
              f"{r['busy']['worst_ms']} ms, p99 {r['busy']['p99_ms']} ms, median "
              f"{r['busy']['median_ms']} ms ({r['busy']['n']} calls)")
    if args.baseline:
        ratio = results[args.baseline]["busy"]["worst_ms"] / results["this tree"]["busy"][
            "worst_ms"]
        print(f"worst /health wait, {args.baseline} / this tree: {ratio:.1f}x")
    worst = results["this tree"]["busy"]["worst_ms"]
    print(f"goal (worst /health wait <= 100 ms): {'met' if worst <= 100 else 'NOT met'}")
    info = machine(torch.device("cpu"))
    info["cpu_model"] = cpu_model()
    report = {"machine": info, "git_revision": git_revision(),
              "args": {k: v for k, v in vars(args).items() if k != "out"},
              "results": results}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {Path(args.out).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
