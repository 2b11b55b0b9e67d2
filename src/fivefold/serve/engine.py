"""The serving engine: requests in, tokens out, one scheduler step at a time.

    engine = Engine(model, kv_cache_bytes=2**30, eos_token_ids=[2])
    outputs = engine.generate([[1, 15, 7], [1, 9]], SamplingParams(max_tokens=32, temperature=0))

or, for a server, `add_request` / `step` / `abort_request` from one thread. Each `step` asks
the scheduler for a batch (scheduler.py), runs it on the paged cache (runner.py), samples
one token for every request that reached its last position (the greedy ones with one argmax
over all their rows, the others with models/sampling.py, the sampler `fivefold generate`
uses, each request with its own seeded generator), applies stop
strings, and returns a `RequestOutput` for every request that got a token or finished.
With async scheduling (on CUDA by default; serve/async_step.py) a step of greedy decodes
is launched before the step before it is read, and `step` returns that earlier step's
outputs: the same outputs, with the host's work hidden behind the device's.

The pool's size comes from a byte budget: `kv_cache_bytes` (the CLI's --kv-cache-gib), or on
CUDA a share of the memory free after loading the weights; the block count is whole blocks
of `block_size · 2 · layers · kv_heads · head_dim · bytes`, the same arithmetic as
`fivefold plan --serve` (plan/serve.py), and a test checks the two agree.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from fivefold.errors import ConfigError
from fivefold.models.sampling import sample_token
from fivefold.serve import paged_attention
from fivefold.serve.async_step import Overlap
from fivefold.serve.cuda_graphs import StaticDecode
from fivefold.serve.kv_cache import PagedKVCache, kv_bytes_per_token
from fivefold.serve.kv_cache_manager import KVCacheManager, cdiv
from fivefold.serve.prepack import can_prepack, prepack_linears, probe_linears
from fivefold.serve.request import Request, RequestStatus
from fivefold.serve.runner import ModelRunner, StepLogits
from fivefold.serve.sampling_params import SamplingParams
from fivefold.serve.scheduler import Scheduler, SchedulerOutput

CPU_DEFAULT_KV_BYTES = 2**30
# what the KV cache stores; auto: the model's dtype
KV_CACHE_DTYPES = {"auto": None, "bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
# async_scheduling: True, False, or the device type it is on for (auto: CUDA only)
ASYNC_SCHEDULING = {"on": True, True: True, "off": False, False: False, "auto": "cuda"}


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # every output token so far (EOS included when it ended the request)
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    text: str | None = None  # with a detokenizer: the output text, cut at a stop string
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    parent_id: str | None = None  # a further choice of `parent_id`'s prompt (n > 1)
    index: int = 0  # which choice of its prompt
    error: str | None = None  # finish_reason "error": what went wrong


class Engine:
    def __init__(self, model: nn.Module, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 chunked_prefill: bool = False, enable_prefix_caching: bool = True,
                 eos_token_ids: Iterable[int] = (), max_model_len: int | None = None,
                 detokenize: Callable[[list[int]], str] | None = None, seed: int = 0,
                 prepack: bool | str = False, kv_cache_dtype: str = "auto",
                 kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                 num_kv_heads: int | None = None, fuse: bool = True,
                 num_layers: int | None = None, cuda_graphs: bool | str = True,
                 async_scheduling: bool | str = "auto"):
        cfg = model.cfg  # the ModelConfig every fivefold model carries
        param = next(model.parameters())
        self.model, self.cfg, self.device = model.eval(), cfg, param.device
        dtype = param.dtype if param.is_floating_point() else torch.get_default_dtype()
        if block_size < 1:
            raise ConfigError(f"block_size = {block_size} must be >= 1 (16 is usual)")
        self.max_model_len = min(max_model_len or cfg.max_seq_len, cfg.max_seq_len)
        # num_kv_heads: the kv heads this rank holds (its share under tensor parallelism,
        # serve/tp_worker.py); num_layers: the layers whose K/V it holds (its stage's under
        # pipeline parallelism, the largest stage's when sizing, serve/pp_worker.py); by
        # default all of the model's
        shape = (num_layers or cfg.num_layers, num_kv_heads or cfg.num_kv_heads,
                 cfg.dim_per_head)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype = {kv_cache_dtype!r}: choose one of "
                              f"{', '.join(KV_CACHE_DTYPES)}")
        store = KV_CACHE_DTYPES[kv_cache_dtype] or dtype  # fp8: e4m3, scaled (kv_cache.py)
        if num_blocks is None:
            if kv_cache_bytes is None:
                kv_cache_bytes = self._default_budget(gpu_memory_utilization, max_num_seqs,
                                                      block_size, shape, store)
            num_blocks = PagedKVCache.blocks_for_budget(kv_cache_bytes, *shape, block_size,
                                                        store)
        if num_blocks < cdiv(self.max_model_len, block_size):
            raise ConfigError(
                f"the KV cache holds {num_blocks} blocks of {block_size} tokens, fewer than one "
                f"sequence of {self.max_model_len} tokens needs; give it more memory "
                f"(--kv-cache-gib) or lower --max-model-len")
        self.cache = PagedKVCache(*shape, num_blocks, block_size, dtype, self.device, store,
                                  kv_scales)
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, self.max_model_len, max_num_seqs,
                                   max_num_batched_tokens, chunked_prefill, eos_token_ids)
        # prepack: run a copy whose linears use oneDNN with weights laid out once (fp32 on a
        # CPU only; serve/prepack.py); the caller's model stays as it was. "auto": only if a
        # probe of both paths on this model's shapes finds oneDNN faster on this machine.
        self.num_prepacked = 0
        self.linear_probe = None
        if prepack and can_prepack(model):
            if prepack == "auto":
                self.linear_probe = probe_linears(model)
                prepack = self.linear_probe.prepack
            if prepack:
                model, self.num_prepacked = prepack_linears(model)
        self.runner = ModelRunner(model, self.cache, self.kv, fuse)
        # decode at fixed batch sizes from static buffers: captured as CUDA graphs on CUDA
        # (where the fused forward and the paged kernel run); "static": the same path run
        # without capture (how the tests check it on CPU); False: --enforce-eager
        static = cuda_graphs == "static" or (cuda_graphs and self.device.type == "cuda"
                                             and paged_attention.available(self.device))
        if static and self.runner.fused is not None and not self.cache.fp8:
            self.cache.decode_group_bytes = None  # one group: the full-width tables
            self.runner.static = StaticDecode(self.runner.fused, self.cache,
                                              self.max_model_len, max_num_seqs,
                                              capture=cuda_graphs != "static")
        # build step N+1 while step N runs (serve/async_step.py); auto: on CUDA, where the
        # device runs apart from the host; on a CPU the device is the host
        if async_scheduling not in ASYNC_SCHEDULING:
            raise ConfigError(f"async_scheduling = {async_scheduling!r}: choose on, off or auto")
        self.overlap = Overlap(self) if ASYNC_SCHEDULING[async_scheduling] in (
            True, self.device.type) else None
        self.detokenize = detokenize
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._choices: dict[str, list[str]] = {}  # parent id -> every choice's id (n > 1)
        self._parents: dict[str, str] = {}
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.adapters = None  # the LoRA adapters requests may name (serve/lora_batch.py)

    def _default_budget(self, utilization, max_num_seqs, block_size, shape, dtype) -> int:
        """CUDA: a share of the free memory; CPU: 1 GiB, or less when that is more than
        max_num_seqs full-length sequences need."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * utilization)
        element = dtype.itemsize
        per_block = block_size * kv_bytes_per_token(*shape, element)
        need = max_num_seqs * cdiv(self.max_model_len, block_size)
        return min(CPU_DEFAULT_KV_BYTES, need * per_block)

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ConfigError("the prompt is empty; give at least one token")
        bad = [t for t in prompt if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is outside the model's vocabulary "
                              f"of {self.cfg.vocab_size}")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ConfigError(f"the prompt ({len(prompt)} tokens) + max_tokens "
                              f"({params.max_tokens}) exceeds the model's context of "
                              f"{self.max_model_len} tokens; shorten one of them")
        if params.adapter is not None and (self.adapters is None
                                           or params.adapter not in self.adapters.index):
            raise ConfigError(f"adapter '{params.adapter}' is not served here; name one of "
                              f"the --lora adapters or none for the base model")
        bad = [t for t, _ in params.logit_bias if t >= self.cfg.vocab_size]
        if bad:
            raise ConfigError(f"logit_bias token id {bad[0]} is outside the model's vocabulary "
                              f"of {self.cfg.vocab_size}")
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        generator = self._generator(params, 0)  # before queueing: a request is whole or absent
        self.scheduler.add_request(Request(rid, prompt, params))
        self._generators[rid] = generator
        if params.n > 1:
            self._choices[rid] = [rid] + [f"{rid}#{i}" for i in range(1, params.n)]
        return rid

    def _generator(self, params: SamplingParams, index: int) -> torch.Generator:
        seed = params.seed + index if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seeds))
        return torch.Generator().manual_seed(seed)

    def choice_ids(self, request_id: str) -> list[str]:
        """The ids of every choice of a request (itself first)."""
        return self._choices.get(request_id, [request_id])

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort a request and all its choices; the output of each choice that was still
        unfinished (what it generated, finish_reason "abort"); empty if none was."""
        outputs = []
        for rid in self.choice_ids(request_id):
            request = self.scheduler.requests.get(rid)
            if request is not None and self.scheduler.abort(rid):
                outputs.append(self._output(request, self._text(request)))
        for rid in self._choices.pop(request_id, [request_id]):
            self._generators.pop(rid, None)
            self._parents.pop(rid, None)
        return outputs

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        p = request.params
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias, strict=True)
            logits = logits.index_add(0, torch.tensor(ids, device=logits.device),
                                      torch.tensor(bias, dtype=logits.dtype,
                                                   device=logits.device))
        return sample_token(logits, p.temperature, p.top_k, p.top_p, p.greedy,
                            self._generators[request.request_id])

    def _fail(self, request: Request, error: BaseException) -> Request:
        """End one request with FINISHED_ERROR (its blocks return to the pool)."""
        request.error = f"{type(error).__name__}: {error}"
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        return request

    def _sample_step(self, requests: dict[str, Request], logits: StepLogits
                     ) -> tuple[dict[str, int], list[Request]]:
        """A token for every request with a row of `logits`: the greedy rows (no logit
        bias) from one argmax and one device-to-host copy for all of them, each other row
        by `_sample` on a host copy of the logits made once. One request's sampling failing
        ends that request alone."""
        plain = [i for i, rid in enumerate(logits.ids)
                 if requests[rid].params.greedy and not requests[rid].params.logit_bias]
        sampled, failed = {}, []
        if plain:
            try:
                best = logits.rows.argmax(-1).tolist()  # ties: the first, as sample_token
                sampled = {logits.ids[i]: best[i] for i in plain}
            except Exception:  # noqa: BLE001  each row alone below finds whose it was
                sampled = {}
        host = None
        for i, rid in enumerate(logits.ids):
            if rid in sampled:
                continue
            try:
                if host is None:
                    host = logits.rows.cpu()
                sampled[rid] = self._sample(requests[rid], host[i])
            except Exception as e:
                failed.append(self._fail(requests[rid], e))
        return sampled, failed

    def step(self) -> list[RequestOutput]:
        if self.overlap is not None and self.overlap.applies():
            return self.overlap.step()
        return self.run_step(self.scheduler.schedule())

    def run_step(self, out: SchedulerOutput) -> list[RequestOutput]:
        """One scheduled step, run synchronously: forward, sampling, outputs."""
        if not out.scheduled:
            return []
        try:
            logits = self.runner.execute(out)
        except Exception as e:  # nobody can tell whose tokens broke the forward: all fail
            return self._finish_step([self._fail(r, e) for r, _ in out.scheduled])
        sampled, failed = self._sample_step({r.request_id: r for r, _ in out.scheduled},
                                            logits)
        # A prompt with n > 1 is computed: the other choices share its blocks (before the
        # parent's update, which may finish it and release them).
        children = []
        for request, num_new in out.scheduled:
            rid = request.request_id
            if rid in sampled and rid in self._choices and not request.output_token_ids:
                children += self._fork(request, num_new, logits[rid])
        changed = self.scheduler.update_from_output(out, sampled) + children
        self.num_steps += 1
        self.num_generated_tokens += len(sampled) + len(children)
        return self._finish_step(changed + failed)

    def fail_unfinished(self, error: BaseException) -> list[RequestOutput]:
        """End every unfinished request with finish_reason "error" (a step raised outside
        any one request); the engine can go on with new ones."""
        if self.overlap is not None:
            self.overlap.pending = None
        requests = list(self.scheduler.requests.values())
        return self._finish_step([self._fail(r, error) for r in requests])

    def _finish_step(self, changed: list[Request]) -> list[RequestOutput]:
        outputs = []
        for request in changed:
            text = self._apply_stop_strings(request)
            outputs.append(self._output(request, text))
        for request in changed:
            if request.status.finished:
                self._forget(request.request_id)
        return outputs

    def _forget(self, request_id: str) -> None:
        """Drop a finished request's generator, and its family once every choice is done."""
        self._generators.pop(request_id, None)
        family = self._parents.get(request_id, request_id)
        choices = self._choices.get(family)
        if choices and all(c not in self.scheduler.requests for c in choices):
            del self._choices[family]
            for c in choices:
                self._parents.pop(c, None)

    def _fork(self, parent: Request, num_new: int, logits: torch.Tensor) -> list[Request]:
        """Choices 1..n-1 of `parent`: its blocks (the last, partial one too: copied on the
        first write, kv_cache_manager.py) and a first token drawn from the same logits."""
        children = []
        now = time.perf_counter()
        for index, rid in enumerate(self._choices[parent.request_id][1:], start=1):
            child = Request(rid, parent.prompt_token_ids, parent.params, parent.arrival_time)
            child.num_computed_tokens = parent.num_computed_tokens + num_new
            self.kv.fork(parent, child)
            self._generators[rid] = self._generator(parent.params, index)
            self._parents[rid] = parent.request_id
            self.scheduler.adopt(child, after=parent)
            child.append_token(self._sample(child, logits), now)
            status = self.scheduler.stop_status(child, child.output_token_ids[-1])
            if status is not None:
                self.scheduler.finish(child, status)
            children.append(child)
        return children

    def _text(self, request: Request) -> str | None:
        if self.detokenize is None:
            return None
        ids = request.output_token_ids
        if request.status == RequestStatus.FINISHED_STOPPED and ids and \
                ids[-1] in self.scheduler.eos_token_ids | set(request.params.stop_token_ids):
            ids = ids[:-1]  # the end marker is not text
        return self.detokenize(ids)

    def _apply_stop_strings(self, request: Request) -> str | None:
        text = self._text(request)
        if text is None:
            return None
        for stop in request.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
        return text

    def _output(self, request: Request, text: str | None) -> RequestOutput:
        parent = self._parents.get(request.request_id)
        index = 0 if parent is None else self._choices[parent].index(request.request_id)
        return RequestOutput(
            request.request_id, request.prompt_token_ids, list(request.output_token_ids),
            request.output_token_ids[-1:], request.status.finished,
            request.status.finish_reason, text, request.arrival_time,
            request.first_token_time, list(request.token_times), request.num_preemptions,
            parent, index, request.error)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, all in flight together; outputs in prompt order
        (with n > 1, the prompt's n choices one after another)."""
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        ids = [c for rid in ids for c in self.choice_ids(rid)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[i] for i in ids]

    def stats(self) -> dict:
        s = self.scheduler
        return {"requests_running": len(s.running), "requests_waiting": len(s.waiting),
                "kv_blocks_total": self.kv.num_blocks, "kv_blocks_used": self.kv.pool.num_used,
                "kv_blocks_free": self.kv.pool.num_free, "preemptions": s.num_preemptions,
                "prefix_hit_tokens": self.kv.prefix_hit_tokens,
                "generated_tokens": self.num_generated_tokens, "steps": self.num_steps,
                "steps_ahead": 0 if self.overlap is None else self.overlap.num_ahead}
