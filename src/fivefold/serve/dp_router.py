"""Data-parallel serving: N engine replicas behind one endpoint, each request to the least
loaded one.

Each replica is a whole `Engine` (its own scheduler and paged KV cache) stepped by its own
`EngineLoop` thread; the HTTP server talks to a `DPRouter`, which has the loop's interface
(submit, abort, drain, stop, stats), so the OpenAI layer does not know there are several.
On a CPU the replicas share the one copy of the weights (read only) and the torch kernels
release the GIL, so their steps overlap; on CUDA replica i runs on device i.

Routing follows vLLM's data-parallel load balancer (`DPLBAsyncMPClient.
get_core_engine_for_request`, vllm/v1/engine/core_client.py): the score of a replica is
4 · waiting + running, where waiting counts the requests the router has handed it that its
engine has not admitted yet (vLLM's local bump, so a burst does not pile onto one replica
before the counts move); ties go to the replica with fewer KV blocks in use, then to the
lowest index. /metrics sums the replicas' counters and lists each replica's load.
"""

from __future__ import annotations

import threading

from fivefold.serve.sampling_params import SamplingParams

# Summed over replicas in /metrics; the rest of a replica's stats are per replica.
SUMMED = ("requests_running", "requests_waiting", "kv_blocks_used", "kv_blocks_free",
          "kv_blocks_total", "preemptions", "prefix_hit_tokens", "generated_tokens", "steps",
          "steps_ahead", "tokens_per_s")


class DPRouter:
    def __init__(self, loops: list):
        self.loops = loops
        self._handed = [0] * len(loops)  # submitted here, not yet admitted by the engine
        self._lock = threading.Lock()
        self.routed = [0] * len(loops)  # requests each replica was given, in all

    @property
    def thread(self):  # the server joins this one at shutdown; stop() stops them all
        return self.loops[0].thread

    def start(self) -> None:
        for loop in self.loops:
            loop.start()

    # One replica's loop dying stops the server as one engine's would (serving.EngineLoop):
    # /health says 503 and the process exits non-zero, for a supervisor to restart it.
    @property
    def alive(self) -> bool:
        return all(loop.alive for loop in self.loops)

    @property
    def error(self) -> str | None:
        return next((loop.error for loop in self.loops if loop.error), None)

    @property
    def on_fatal(self):
        return self.loops[0].on_fatal

    @on_fatal.setter
    def on_fatal(self, callback) -> None:
        for loop in self.loops:
            loop.on_fatal = callback

    def load(self, index: int) -> tuple[int, int, int]:
        scheduler = self.loops[index].engine.scheduler
        waiting = len(scheduler.waiting) + self._handed[index]
        return (4 * waiting + len(scheduler.running),
                self.loops[index].engine.kv.pool.num_used, index)

    def pick(self) -> int:
        with self._lock:
            index = min(range(len(self.loops)), key=self.load)
            self._handed[index] += 1
            self.routed[index] += 1
        return index

    async def submit(self, prompt: list[int], params: SamplingParams):
        index = self.pick()
        try:
            return await self.loops[index].submit(prompt, params)
        finally:
            with self._lock:
                self._handed[index] -= 1

    def abort(self, rid: str) -> None:
        # The id is unique over replicas; the ones that do not hold it ignore the abort.
        for loop in self.loops:
            loop.abort(rid)

    def drain(self, grace_s: float) -> None:
        for loop in self.loops:
            loop.drain(grace_s)

    def stop(self) -> None:
        for loop in self.loops:
            loop.stop()
        for loop in self.loops[1:]:
            loop.thread.join(timeout=5)

    def stats(self) -> dict:
        each = [loop.stats() for loop in self.loops]
        total = {key: sum(s[key] for s in each) for key in SUMMED if key in each[0]}
        total["replicas"] = [{"replica": i, "requests_running": s["requests_running"],
                              "requests_waiting": s["requests_waiting"],
                              "kv_blocks_used": s["kv_blocks_used"],
                              "generated_tokens": s["generated_tokens"],
                              "requests_routed": self.routed[i]}
                             for i, s in enumerate(each)]
        return total


def replica_metrics(stats: dict) -> str:
    """Prometheus lines with a `replica` label, for the per-replica part of `stats()`."""
    lines = []
    for key in ("requests_running", "requests_waiting", "kv_blocks_used", "generated_tokens",
                "requests_routed"):
        lines.append(f"# HELP fivefold_replica_{key} {key.replace('_', ' ')}, per replica")
        lines += [f'fivefold_replica_{key}{{replica="{r["replica"]}"}} {r[key]}'
                  for r in stats["replicas"]]
    return "\n".join(lines) + "\n"
