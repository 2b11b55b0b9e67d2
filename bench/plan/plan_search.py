"""Time a full planner search: Llama 3.1 405B on 16,384 H100s, 8k sequences, 16M-token batch.

    python bench/plan/plan_search.py [--gpus 16384] [--seq-len 8192] [--gbs 2048]
"""

import argparse
import platform
import time

from fivefold.host import cpu_model
from fivefold.models.presets import preset
from fivefold.plan.hardware import get_hardware
from fivefold.plan.layout import Workload
from fivefold.plan.report import format_search
from fivefold.plan.search import SearchSpace, search


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-405b")
    ap.add_argument("--gpus", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--gbs", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    hw, assume = get_hardware("h100-sxm")
    work = Workload(preset(args.model), seq_len=args.seq_len, gbs=args.gbs)
    # uneven_pp: 126 layers do not divide into 16 stages; Llama 3 split them unevenly too
    space = SearchSpace(strict_layers=False)
    times = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        result = search(work, args.gpus, hw, assume, space, top=10)
        times.append(time.perf_counter() - start)
    print(format_search(result, work, hw, top=5))
    print(f"\nsearch time: best {min(times):.2f} s, worst {max(times):.2f} s over {args.repeat}"
          f" runs ({result.considered:,} layouts; {cpu_model()},"
          f" Python {platform.python_version()})")


if __name__ == "__main__":
    main()
