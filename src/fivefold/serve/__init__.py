"""Serving: a paged KV cache, continuous batching and an OpenAI-compatible HTTP server.

    sampling_params.py  request.py  block_pool.py  kv_cache_manager.py  scheduler.py
        what to generate, the request's state, blocks and block tables, who runs next
        (torch-free: the scheduler can be read and tested without a model)
    kv_cache.py  runner.py  engine.py
        paged K/V tensors and attention through block tables, one step on the model,
        the `Engine` (add_request, step, generate)
    openai/  the HTTP server (`fivefold serve`; FastAPI and uvicorn, the `serve` extra)

`from fivefold.serve import Engine, SamplingParams` imports torch only for `Engine`.
"""

from fivefold.serve.sampling_params import SamplingParams

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from fivefold.serve.engine import Engine

        return Engine
    raise AttributeError(f"module 'fivefold.serve' has no attribute {name!r}")
