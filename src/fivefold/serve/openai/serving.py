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
import dataclasses
import json
import queue
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from fivefold.errors import ConfigError
from fivefold.serve.engine import Engine, RequestOutput
from fivefold.serve.openai.protocol import (
    BadField,
    ChatCompletionRequest,
    CompletionRequest,
    error_body,
    now,
    usage,
)
from fivefold.serve.sampling_params import SamplingParams

TOKEN_ID_END = 2**63  # past any vocabulary, and past what a tokenizer's int64 takes


class ClientLeft(Exception):
    """The client of a whole (non-streamed) response disconnected; nothing is sent."""


class Unavailable(Exception):
    """The server is shutting down, or its engine has stopped (HTTP 503)."""


class ModelNotFound(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


class EngineError(Exception):
    """The engine failed this request (HTTP 500)."""


def _ended(request_id: str, reason: str, error: str | None = None) -> RequestOutput:
    """The output that ends every choice still open (index -1)."""
    return RequestOutput(request_id, [], [], [], True, reason, index=-1, error=error)


class EngineLoop:
    """`on_fatal` is called (from the engine's thread) if the loop itself dies: the server
    then stops with a non-zero exit code so that a supervisor restarts it."""

    def __init__(self, engine: Engine, on_fatal: Callable[[], None] | None = None):
        self.engine = engine
        self.on_fatal = on_fatal
        self.error: str | None = None  # why the loop died; None while it runs
        self._commands: queue.Queue = queue.Queue()
        # request id -> [event loop, queue, choices not finished yet]
        self._streams: dict[str, list] = {}
        self._admitting = True
        self._stop = threading.Event()
        self._abort_all_at: float | None = None
        self._rates: deque[tuple[float, int]] = deque(maxlen=64)
        self.thread = threading.Thread(target=self._run, name="fivefold-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None

    # -- called from the event loop ------------------------------------------------------
    async def submit(self, prompt: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        if not self.alive:
            raise Unavailable(f"the engine has stopped ({self.error})")
        if not self._admitting:
            raise Unavailable("the server is shutting down")
        rid = f"cmpl-{uuid.uuid4().hex}"
        out: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = [asyncio.get_running_loop(), out, params.n]
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
        """To the handler of the request (a further choice goes to its parent's handler)."""
        key = output.parent_id or output.request_id
        stream = self._streams.get(key)
        if stream is None:
            return
        if output.finished:
            stream[2] = 0 if output.index < 0 else stream[2] - 1
            if stream[2] <= 0:
                self._streams.pop(key, None)
        loop, out, _ = stream
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
        """Abort every choice of `rid`: each open one ends with what it generated so far
        and finish_reason "abort"."""
        for output in self.engine.abort_request(rid):
            self._deliver(output)
        self._deliver(_ended(rid, "abort"))  # anything still open (nothing, normally)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # the engine failed outside one request: all of them end
            outputs = self.engine.fail_unfinished(e)
        for output in outputs:
            self._deliver(output)
        self._rates.append((time.perf_counter(), self.engine.num_generated_tokens))

    def _run(self) -> None:
        engine = self.engine
        try:
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
                    for rid in list(self._streams):
                        self._abort(rid)
                if engine.has_unfinished():
                    self._step()
        except BaseException as e:  # the loop itself broke: refuse work, let the server exit
            self.error = f"{type(e).__name__}: {e}"
            print(f"fivefold serve: the engine loop stopped: {self.error}", file=sys.stderr,
                  flush=True)
            for rid in list(self._streams):
                self._deliver(_ended(rid, "error", self.error))
            if self.on_fatal is not None:
                self.on_fatal()


@dataclass
class Prepared:
    prompt: list[int]
    params: SamplingParams  # with n choices
    echo: str = ""  # text put before each choice's output (`echo`: the prompt)
    include_usage: bool = False  # streaming: a last chunk with the token counts


class OpenAIServing:
    """`model_names`: the ids a request's `model` may name (the first is the base model's);
    a request naming another gets 404 model_not_found."""

    def __init__(self, loop: EngineLoop, model_name: str, encode: Callable[[str], list[int]],
                 chat_prompt: Callable[[list[dict]], str], max_model_len: int,
                 adapters: tuple[str, ...] = (),
                 decode: Callable[[list[int]], str] | None = None):
        self.loop, self.model_name = loop, model_name
        self.adapters = tuple(adapters)  # LoRA adapters a request's `model` may name
        self.model_names = [model_name, *self.adapters]
        self.encode, self.decode = encode, decode
        self.chat_prompt, self.max_model_len = chat_prompt, max_model_len

    def models(self) -> dict:
        base = {"id": self.model_name, "object": "model", "created": now(),
                "owned_by": "fivefold", "max_model_len": self.max_model_len, "root":
                self.model_name, "parent": None}
        # adapters as vLLM lists them: their own id, the base as `parent`
        return {"object": "list", "data": [base] + [
            {**base, "id": name, "root": name, "parent": self.model_name}
            for name in self.adapters]}

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves "
                                f"{', '.join(self.model_names)}")

    def _prepare(self, body, prompt: list[int]) -> Prepared:
        self.check_model(body.model)
        if not prompt:
            raise ConfigError("the prompt is empty; give at least one token of text")
        if len(prompt) >= self.max_model_len:
            raise ConfigError(f"the prompt has {len(prompt)} tokens, the model's context is "
                              f"{self.max_model_len}; shorten the prompt")
        params = body.sampling_params(self.max_model_len - len(prompt))
        if body.model in self.adapters:  # the model names a LoRA adapter: it serves this one
            params = dataclasses.replace(params, adapter=body.model)
        return Prepared(prompt, params, include_usage=body.include_usage)

    def prepare_completion(self, body: CompletionRequest) -> Prepared:
        """Tokenises: the server calls it off the event loop (a long prompt takes a while)."""
        if isinstance(body.prompt, list):
            bad = next((t for t in body.prompt if not 0 <= t < TOKEN_ID_END), None)
            if bad is not None:
                raise BadField("prompt", f"prompt token id {bad} is not a token id (ids lie "
                                         f"in [0, vocabulary size)); send ids the model knows")
        prompt = body.prompt if isinstance(body.prompt, list) else (
            self.encode(body.prompt) if body.prompt else [])
        prepared = self._prepare(body, prompt)
        if body.echo:
            prepared.echo = body.prompt if isinstance(body.prompt, str) else (
                self._decode_prompt(prompt))
        return prepared

    def _decode_prompt(self, prompt: list[int]) -> str:
        if self.decode is None:
            return ""
        try:
            return self.decode(prompt)
        except Exception:  # an id past the tokenizer's vocabulary: the field is at fault
            raise BadField("prompt", "prompt holds token ids the tokenizer cannot decode; "
                                     "send ids inside the vocabulary") from None

    def prepare_chat(self, body: ChatCompletionRequest) -> Prepared:
        """Renders and tokenises: the server calls it off the event loop."""
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return self._prepare(body, self.encode(self.chat_prompt(messages)))

    async def run(self, prepared: Prepared, chat: bool,
                  client_left: Callable[[], Awaitable[object]]) -> dict:
        """The whole response. `client_left()` returns when the client disconnects: the
        request is then aborted at once (the engine drops it before its next step) and
        ClientLeft raised. Raises EngineError if the engine failed the request."""
        rid, out = await self.loop.submit(prepared.prompt, prepared.params)
        n = prepared.params.n
        finals: list[RequestOutput | None] = [None] * n
        watcher = asyncio.ensure_future(client_left())
        try:
            while any(f is None for f in finals):
                getter = asyncio.ensure_future(out.get())
                await asyncio.wait({getter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not getter.done():
                    getter.cancel()
                    raise ClientLeft(rid)
                o = getter.result()
                if o.index < 0:  # every open choice ends here
                    finals = [f or o for f in finals]
                elif o.finished:
                    finals[o.index] = o
        finally:
            watcher.cancel()
            if any(f is None for f in finals):
                self.loop.abort(rid)
        failed = next((o for o in finals if o.finish_reason == "error"), None)
        if failed is not None:
            raise EngineError(f"the engine failed this request: {failed.error}")
        completion = sum(len(o.token_ids) for o in finals)
        choices = []
        for i, o in enumerate(finals):
            text = prepared.echo + (o.text or "")
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": o.finish_reason, "logprobs": None})
            else:
                choices.append({"index": i, "text": text, "finish_reason": o.finish_reason,
                                "logprobs": None})
        return {"id": rid, "object": "chat.completion" if chat else "text_completion",
                "created": now(), "model": prepared.params.adapter or self.model_name,
                "choices": choices,
                "usage": usage(len(prepared.prompt), completion)}

    async def stream(self, prepared: Prepared, chat: bool) -> AsyncIterator[str]:
        """Server-sent events; the request is admitted (or refused) before the first event."""
        rid, out = await self.loop.submit(prepared.prompt, prepared.params)
        return self._events(rid, out, prepared, chat)

    async def _events(self, rid: str, out: asyncio.Queue, prepared: Prepared,
                      chat: bool) -> AsyncIterator[str]:
        params = prepared.params
        kind = "chat.completion.chunk" if chat else "text_completion"
        holdback = max((len(s) for s in params.stop), default=1) - 1
        sent = [0] * params.n
        tokens = [0] * params.n
        open_choices = set(range(params.n))

        def chunk(choices: list[dict], **extra) -> str:
            body = {"id": rid, "object": kind, "created": now(),
                    "model": params.adapter or self.model_name, "choices": choices, **extra}
            if prepared.include_usage:
                body.setdefault("usage", None)
            return f"data: {json.dumps(body)}\n\n"

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
            return chunk([choice])

        try:
            for i in range(params.n):
                if chat:
                    yield event(i, "", None)
                if prepared.echo:
                    yield event(i, prepared.echo, None)
            while open_choices:
                o = await out.get()
                if o.finish_reason == "error":
                    # the response has begun (200): the error goes in the stream, as vLLM's
                    yield f"data: {json.dumps(engine_error_body(o.error))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                if o.index < 0:  # every open choice ends here
                    for i in sorted(open_choices):
                        yield event(i, None, o.finish_reason)
                    open_choices.clear()
                    break
                i, text = o.index, o.text or ""
                tokens[i] = len(o.token_ids)
                # Hold back what may be the start of a stop string or half a character.
                upto = len(text) if o.finished else max(len(text) - holdback, sent[i])
                while upto > sent[i] and text[upto - 1] == "\ufffd" and not o.finished:
                    upto -= 1
                if upto > sent[i]:
                    yield event(i, text[sent[i]:upto], None)
                    sent[i] = upto
                if o.finished:
                    open_choices.discard(i)
                    yield event(i, None, o.finish_reason)
            if prepared.include_usage:
                yield chunk([], usage=usage(len(prepared.prompt), sum(tokens)))
            yield "data: [DONE]\n\n"
        finally:
            if open_choices:
                self.loop.abort(rid)


def engine_error_body(error: str | None) -> dict:
    return error_body(f"the engine failed this request: {error}", kind="server_error",
                      code=500)
