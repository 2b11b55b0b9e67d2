"""The engine behind the HTTP server: one thread steps it, the event loop talks to it.

The engine is not thread-safe and its steps block, so a single `EngineLoop` thread owns it:
requests and aborts reach it through a queue, and each step's outputs go back to the
awaiting handler through an asyncio queue per request (`call_soon_threadsafe`). A handler
whose client disconnects aborts its requests, which frees their blocks on the next turn of
the loop. `drain(grace_s)` (SIGTERM) stops admitting, lets running requests finish for
`grace_s` seconds, then aborts the rest.

`OpenAIServing` turns API bodies (protocol.py) into engine requests and engine outputs into
API responses, whole or as server-sent events (`data: {json}` lines, then `data: [DONE]`).
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from fivefold.errors import ConfigError
from fivefold.serve.engine import Engine, RequestOutput
from fivefold.serve.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    now,
    usage,
)
from fivefold.serve.sampling_params import SamplingParams


class Unavailable(Exception):
    """The server is shutting down and admits no new request (HTTP 503)."""


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._admitting = True
        self._stop = threading.Event()
        self._abort_all_at: float | None = None
        self._rates: deque[tuple[float, int]] = deque(maxlen=64)
        self.thread = threading.Thread(target=self._run, name="fivefold-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # -- called from the event loop ------------------------------------------------------
    async def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        if not self._admitting:
            raise Unavailable("the server is shutting down")
        rid = f"cmpl-{uuid.uuid4().hex}"
        out: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = (asyncio.get_running_loop(), out)
        done: Future = Future()
        self._commands.put(("add", rid, prompt, params, done))
        try:
            await asyncio.wrap_future(done)  # ConfigError from the engine's checks
        except BaseException:
            self._streams.pop(rid, None)
            raise
        return rid, out

    def abort(self, rid: str) -> None:
        self._commands.put(("abort", rid))

    def drain(self, grace_s: float) -> None:
        """Stop admitting; abort what is still running after `grace_s` seconds."""
        self._admitting = False
        self._abort_all_at = time.monotonic() + grace_s

    def stop(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))

    def stats(self) -> dict:
        stats = self.engine.stats()
        rates = list(self._rates)
        if len(rates) >= 2 and rates[-1][0] > rates[0][0]:
            stats["tokens_per_s"] = (rates[-1][1] - rates[0][1]) / (rates[-1][0] - rates[0][0])
        else:
            stats["tokens_per_s"] = 0.0
        return stats

    # -- the engine's thread --------------------------------------------------------------
    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is None:
            return
        if output.finished:
            self._streams.pop(output.request_id, None)
        loop, out = stream
        try:
            loop.call_soon_threadsafe(out.put_nowait, output)
        except RuntimeError:  # the event loop has closed
            pass

    def _command(self, command: tuple) -> None:
        if command[0] == "add":
            _, rid, prompt, params, done = command
            try:
                self.engine.add_request(prompt, params, rid)
                done.set_result(rid)
            except Exception as e:  # ConfigError: the handler answers 400
                done.set_exception(e)
        elif command[0] == "abort":
            self._abort(command[1])

    def _abort(self, rid: str) -> None:
        if self.engine.abort_request(rid):
            self._deliver(RequestOutput(rid, [], [], [], True, "abort"))
        self._streams.pop(rid, None)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            try:
                block = not engine.has_unfinished()
                self._command(self._commands.get(timeout=0.05) if block
                              else self._commands.get_nowait())
                while True:
                    self._command(self._commands.get_nowait())
            except queue.Empty:
                pass
            if self._abort_all_at is not None and time.monotonic() >= self._abort_all_at:
                for rid in list(engine.scheduler.requests):
                    self._abort(rid)
            if engine.has_unfinished():
                for output in engine.step():
                    self._deliver(output)
                self._rates.append((time.perf_counter(), engine.num_generated_tokens))


@dataclass
class Prepared:
    prompt: list[int]
    params: list[SamplingParams]  # one per choice (n)


class OpenAIServing:
    def __init__(self, loop: EngineLoop, model_name: str, encode: Callable[[str], list[int]],
                 chat_prompt: Callable[[list[dict]], str], max_model_len: int):
        self.loop, self.model_name = loop, model_name
        self.encode, self.chat_prompt, self.max_model_len = encode, chat_prompt, max_model_len

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": now(), "owned_by": "fivefold",
            "max_model_len": self.max_model_len}]}

    def _prepare(self, body, prompt: list[int]) -> Prepared:
        if not prompt:
            raise ConfigError("the prompt is empty; give at least one token of text")
        if len(prompt) >= self.max_model_len:
            raise ConfigError(f"the prompt has {len(prompt)} tokens, the model's context is "
                              f"{self.max_model_len}; shorten the prompt")
        base = body.sampling_params(self.max_model_len - len(prompt))
        params = [base if body.n == 1 or base.seed is None else
                  SamplingParams(**{**base.__dict__, "seed": base.seed + i})
                  for i in range(body.n)]
        return Prepared(prompt, params)

    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        prompt = body.prompt if isinstance(body.prompt, list) else (
            self.encode(body.prompt) if body.prompt else [])
        return self._prepare(body, prompt)

    def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return self._prepare(body, self.encode(self.chat_prompt(messages)))

    async def _start(self, prepared: Prepared) -> list[tuple[str, asyncio.Queue]]:
        started = []
        try:
            for params in prepared.params:
                started.append(await self.loop.submit(prepared.prompt, params))
        except BaseException:
            for rid, _ in started:
                self.loop.abort(rid)
            raise
        return started

    async def run(self, prepared: Prepared, chat: bool,
                  disconnected: Callable[[], object]) -> dict:
        """The whole response; aborts (and raises CancelledError) if the client leaves."""
        started = await self._start(prepared)
        finals: list[RequestOutput | None] = [None] * len(started)
        try:
            for i, (_, out) in enumerate(started):
                while finals[i] is None:
                    try:
                        o = await asyncio.wait_for(out.get(), timeout=0.5)
                    except asyncio.TimeoutError:
                        if await disconnected():
                            raise asyncio.CancelledError from None
                        continue
                    if o.finished:
                        finals[i] = o
        finally:
            for (rid, _), final in zip(started, finals):
                if final is None:
                    self.loop.abort(rid)
        rid = started[0][0]
        completion = sum(len(o.token_ids) for o in finals)
        choices = []
        for i, o in enumerate(finals):
            text = o.text or ""
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": o.finish_reason, "logprobs": None})
            else:
                choices.append({"index": i, "text": text, "finish_reason": o.finish_reason,
                                "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": now(), "model": self.model_name, "choices": choices,
                "usage": usage(len(prepared.prompt), completion)}

    async def stream(self, prepared: Prepared, chat: bool) -> AsyncIterator[str]:
        """Server-sent events; `finally` aborts whatever is unfinished when the client goes."""
        started = await self._start(prepared)
        return self._events(started, prepared, chat)

    async def _events(self, started, prepared: Prepared, chat: bool) -> AsyncIterator[str]:
        rid = started[0][0]
        kind = "chat.completion.chunk" if chat else "text_completion"
        holdback = max((len(s) for p in prepared.params for s in p.stop), default=1) - 1
        finished = [False] * len(started)

        def event(index: int, text: str | None, reason: str | None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if text == "" and reason is None:
                    delta = {"role": "assistant", "content": ""}
                choice = {"index": index, "delta": delta, "finish_reason": reason,
                          "logprobs": None}
            else:
                choice = {"index": index, "text": text or "", "finish_reason": reason,
                          "logprobs": None}
            body = {"id": rid, "object": kind, "created": now(), "model": self.model_name,
                    "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                for i in range(len(started)):
                    yield event(i, "", None)
            for i, (_, out) in enumerate(started):
                sent = 0
                while True:
                    o = await out.get()
                    text = o.text or ""
                    # Hold back what may be the start of a stop string or half a character.
                    upto = len(text) if o.finished else max(len(text) - holdback, sent)
                    while upto > sent and text[upto - 1] == "\ufffd" and not o.finished:
                        upto -= 1
                    if upto > sent:
                        yield event(i, text[sent:upto], None)
                        sent = upto
                    if o.finished:
                        finished[i] = True
                        yield event(i, None, o.finish_reason)
                        break
            yield "data: [DONE]\n\n"
        finally:
            for (r, _), done in zip(started, finished):
                if not done:
                    self.loop.abort(r)
