"""`fivefold serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn, the `serve` extra).

    fivefold serve --hf ./Llama-3.2-1B [--port 8000] [--host 127.0.0.1] [--kv-cache-gib 4]
    fivefold serve --checkpoint runs/default/checkpoints

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (`stream: true` as
server-sent events), GET /health, GET /metrics (Prometheus text: requests running and
waiting, KV blocks used and free, generated tokens per second). Every error body is
OpenAI's: 400 for a bad request naming its field (the server keeps serving), 404 for an
unknown model (`model_not_found`) or route, 405, 413 for a body over --max-request-bytes,
500 for a request the engine failed (the others go on), 503 while shutting down or once
the engine loop has died; then /health answers 503 too and the process exits 1, so a
supervisor restarts it. SIGTERM (or Ctrl-C) closes the listener (new connections are
refused), lets running requests finish for --shutdown-grace seconds, ends the rest with
what they generated and finish_reason "abort", and exits 0. The server binds to 127.0.0.1
unless --host says otherwise. Tokenising runs off the event loop; a client that leaves is
aborted without a log line.

(No `from __future__ import annotations` here: FastAPI reads the route functions'
annotations, which name classes imported inside `build_app`.)
"""


import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path

from fivefold.errors import ArgumentParser, ConfigError
from fivefold.extras import require

# Parsing and checking a body runs on the event loop (the GIL is held throughout either way):
# measured about 12-18 ms a MiB for the worst shapes (a list of token ids, a logit_bias of
# many entries), so 2 MiB keeps every request's turn on the loop well under 100 ms.
MAX_REQUEST_BYTES = 2 * 2**20
PLAIN_CHAT = "a plain template: one 'role: content' line per message, then 'assistant:'"


def plain_chat_prompt(messages: list[dict]) -> str:
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def chat_template(hf_dir: Path | None):
    """The tokenizer's own Jinja chat template (tokenizer_config.json) where there is one
    and jinja2 is installed; otherwise the plain template."""
    if hf_dir is None or not (hf_dir / "tokenizer_config.json").is_file():
        return plain_chat_prompt
    cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    source = cfg.get("chat_template")
    if not isinstance(source, str):
        return plain_chat_prompt
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        return plain_chat_prompt
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True
                                             ).from_string(source)

    def token(name):
        value = cfg.get(name)
        return value.get("content", "") if isinstance(value, dict) else (value or "")

    def render(messages: list[dict]) -> str:
        return template.render(messages=messages, add_generation_prompt=True,
                               bos_token=token("bos_token"), eos_token=token("eos_token"))

    return render


def metrics_text(stats: dict) -> str:
    lines = []
    for key, help_text in (("requests_running", "requests in the running batch"),
                           ("requests_waiting", "requests waiting for blocks or a seat"),
                           ("kv_blocks_used", "KV cache blocks held by requests"),
                           ("kv_blocks_free", "KV cache blocks free (cached prefixes included)"),
                           ("kv_blocks_total", "KV cache blocks in the pool"),
                           ("preemptions", "requests preempted so far"),
                           ("generated_tokens", "tokens generated so far"),
                           ("steps_ahead", "steps launched before the one before was read "
                                           "(--async-scheduling)"),
                           ("tokens_per_s", "generated tokens per second, recent steps")):
        lines += [f"# HELP fivefold_{key} {help_text}",
                  f"fivefold_{key} {stats[key]:.6g}" if isinstance(stats[key], float)
                  else f"fivefold_{key} {stats[key]}"]
    return "\n".join(lines) + "\n"


REQUEST_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop",
                  "logit_bias", "prompt")


def field_path(loc) -> list[str]:
    """A pydantic error location as the request's field names: without "body" and without
    the names of a union's branches ("str", "list[int]", "function-after[...]")."""
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and (
        "[" in p or p in ("str", "int", "float", "bool", "dict", "list", "none")))]


def build_app(serving, loop, max_request_bytes: int = MAX_REQUEST_BYTES):
    """The FastAPI application over an `OpenAIServing` and its `EngineLoop`."""
    fastapi = require("fastapi", "serve", "fivefold serve")
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from fivefold.serve.openai.limits import BodyLimit
    from fivefold.serve.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        error_body,
    )
    from fivefold.serve.openai.serving import ClientLeft, EngineError, ModelNotFound, Unavailable

    app = fastapi.FastAPI(title="fivefold", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request, exc: RequestValidationError):
        errors = exc.errors() or [{"loc": (), "msg": "invalid request"}]
        first = errors[0]
        if first.get("type") == "json_invalid":  # its loc is a byte offset, not a field
            error = first.get("ctx", {}).get("error", "")
            return JSONResponse(error_body(f"the body is not valid JSON ({error})"),
                                status_code=400)
        # a union's branches each give an error: the one that got furthest says most
        first = max(errors, key=lambda e: len(field_path(e.get("loc", ()))))
        where = ".".join(field_path(first.get("loc", ())))
        msg = str(first.get("msg")).removeprefix("Value error, ")
        message = f"{where}: {msg}" if where else msg
        return JSONResponse(error_body(message, where or None), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
            exc.status_code, "invalid_request_error" if exc.status_code < 500
            else "server_error")
        return JSONResponse(error_body(str(exc.detail), kind=kind, code=exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ConfigError)
    async def bad_value(_request, exc: ConfigError):
        # the engine's checks begin with the field they refuse ("max_tokens = 0 must ...")
        param = getattr(exc, "param", None) or next(
            (f for f in REQUEST_FIELDS if str(exc).startswith((f + " ", f + ":"))), None)
        return JSONResponse(error_body(str(exc), param), status_code=400)

    @app.exception_handler(ModelNotFound)
    async def no_model(_request, exc: ModelNotFound):
        return JSONResponse(error_body(str(exc), "model", code="model_not_found"),
                            status_code=404)

    @app.exception_handler(EngineError)
    async def engine_failed(_request, exc: EngineError):
        return JSONResponse(error_body(str(exc), kind="server_error", code=500),
                            status_code=500)

    @app.exception_handler(Unavailable)
    async def unavailable(_request, exc: Unavailable):
        return JSONResponse(error_body(str(exc), kind="service_unavailable", code=503),
                            status_code=503)

    @app.get("/health")
    async def health():
        if not loop.alive:
            return JSONResponse({"status": "error", "error": loop.error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        stats = loop.stats()
        text = metrics_text(stats)
        if "replicas" in stats:  # --dp: each replica's load too
            from fivefold.serve.dp_router import replica_metrics

            text += replica_metrics(stats)
        return PlainTextResponse(text)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    async def respond(raw, prepare, body, chat: bool):
        # tokenising a long prompt takes a while: off the event loop, which keeps answering
        prepared = await asyncio.to_thread(prepare, body)
        if body.stream:
            events = await serving.stream(prepared, chat)
            return StreamingResponse(events, media_type="text/event-stream")

        async def client_left():  # the body is read: the next message is the disconnect
            while (await raw.receive())["type"] != "http.disconnect":
                pass

        try:
            return JSONResponse(await serving.run(prepared, chat, client_left))
        except ClientLeft:  # aborted; there is no one to answer (and nothing to log)
            return Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: fastapi.Request):
        return await respond(raw, serving.prepare_completion, body, False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: fastapi.Request):
        return await respond(raw, serving.prepare_chat, body, True)

    return app


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="fivefold serve",
                       description="Serve a model over an OpenAI-compatible HTTP API.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a fivefold checkpoint directory")
    source.add_argument("--hf", help="a Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--tokenizer", help="with --hf: the tokenizer the model was trained with, "
                   "when the directory has no tokenizer.json: byte, corpus-bpe or a file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000,
                   help="TCP port to listen on (default 8000)")
    p.add_argument("--served-model-name", help="the model id clients name (default: the "
                   "directory's name)")
    p.add_argument("--kv-cache-gib", type=float, help="memory for the KV cache (default: 90%% "
                   "of free GPU memory; on CPU 1 GiB or what --max-num-seqs sequences need)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences per batch")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's)")
    p.add_argument("--chunked-prefill", action="store_true",
                   help="split long prompts into chunks of --max-num-batched-tokens")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="compute every prompt in full: no reuse of KV blocks that an earlier "
                        "request's identical prefix filled")
    p.add_argument("--no-prepack", action="store_true",
                   help="fp32 on a CPU: keep torch's sgemm linears; by default a probe at "
                        "start-up picks oneDNN with weights reordered once (holding a second "
                        "copy of them) where it is faster for this model on this CPU")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bf16", "fp8"),
                   help="what the KV cache stores: auto (the model's dtype), bf16, or fp8 "
                        "(e4m3 with a scale per layer and KV head: half of bf16's bytes, twice "
                        "the blocks)")
    p.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                   help="the largest request body taken (default 2 MiB: a 256k-token prompt "
                        "as text or ids); a larger one gets 413. The event loop parses a body "
                        "whole: about 20 ms a MiB at worst (many small JSON values)")
    p.add_argument("--shutdown-grace", type=float, default=3.0,
                   help="seconds running requests get to finish after SIGTERM")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: each holds 1/tp "
                   "of every linear and its kv heads' share of the cache (serve starts them, or "
                   "`fivefold launch --nproc-per-node N serve ...` does)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode "
                   "(by default captured on CUDA for batch sizes 1, 2, 4, 8, 16, ...)")
    p.add_argument("--async-scheduling", default="auto", choices=("on", "off", "auto"),
                   help="schedule and launch each decode step while the one before runs on "
                        "the device, reading its tokens after (serve/async_step.py); auto: on "
                        "CUDA; one engine without --lora, --tp or --pp")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages, each holding its "
                   "layers and their KV blocks: one rank each, or --tp ranks each "
                   "(serve/pp_worker.py)")
    p.add_argument("--dp", type=int, default=1, help="engine replicas behind this endpoint, "
                   "each request to the least loaded (on CUDA one per GPU)")
    p.add_argument("--lora", action="append", default=[], metavar="NAME=DIR",
                   help="serve a LoRA adapter (a PEFT directory or a fivefold LoRA checkpoint) "
                        "as model NAME; repeatable; requests for any of them share batches")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: the GPU when torch sees one, else the CPU")
    p.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                   help="the weights' dtype; auto: bf16 on a GPU, fp32 on a CPU")
    return p


def _check_args(args) -> None:
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} must lie in 1..65535")
    for name in ("kv_cache_gib", "max_model_len", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be > 0")
    if args.block_size < 1 or args.max_num_seqs < 1:
        raise ConfigError("--block-size and --max-num-seqs must be >= 1")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes {args.max_request_bytes} must be >= 1")
    if args.shutdown_grace < 0:
        raise ConfigError(f"--shutdown-grace {args.shutdown_grace} must be >= 0")


def _check_port(host: str, port: int) -> None:
    """Fail before loading the model when the address is taken or cannot be bound. Under
    `fivefold launch` only rank 0 binds it, so only rank 0 checks: two ranks binding the
    port at once to check it would each find it taken now and then."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick another "
                          f"--port or --host") from None


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse printed its one-line error, or the help
        return int(e.code or 0)
    _check_args(args)
    _check_port(args.host, args.port)
    require("fastapi", "serve", "fivefold serve")
    uvicorn = require("uvicorn", "serve", "fivefold serve")
    from fivefold.serve.openai.backends import start
    from fivefold.serve.openai.serving import OpenAIServing

    backend = start(args)  # one engine, a tensor-parallel world or replicas
    if backend is None:
        return 0  # a tensor-parallel worker rank: rank 0 has stopped serving
    loop, codec = backend.loop, backend.codec
    source = Path(args.hf or args.checkpoint)
    name = args.served_model_name or source.resolve().name
    if name in backend.adapters:
        raise ConfigError(f"--lora {name} has the base model's name; rename the adapter")
    loop.on_fatal = lambda: setattr(server, "should_exit", True)
    serving = OpenAIServing(loop, name, codec.encode,
                            chat_template(source if args.hf else None), backend.max_model_len,
                            backend.adapters, codec.decode)
    app = build_app(serving, loop, args.max_request_bytes)

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            loop.drain(args.shutdown_grace)
            super().handle_exit(sig, frame)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            timeout_graceful_shutdown=int(args.shutdown_grace) + 2)
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler for
    # SIGTERM makes that a clean exit 0 instead of death by the signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    server = Server(config)
    loop.start()
    for line in backend.notes:
        print(f"fivefold serve: {line}", file=sys.stderr, flush=True)
    layout = "".join(f", {k} {v}" for k, v in (("tp", args.tp), ("pp", args.pp),
                                                        ("dp", args.dp)) if v > 1)
    print(f"fivefold serve: {name} on http://{args.host}:{args.port}/v1 "
          f"({backend.num_blocks} KV blocks of {args.block_size} tokens "
          f"({backend.kv_dtype}), context {backend.max_model_len}{layout}"
          f"{', adapters ' + ' '.join(backend.adapters) if backend.adapters else ''})",
          file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        loop.stop()
        loop.thread.join(timeout=5)
        backend.close()
        signal.signal(signal.SIGTERM, previous)
    if not loop.alive:  # non-zero, so that a supervisor restarts the server
        print(f"fivefold serve: exiting after an engine failure ({loop.error})",
              file=sys.stderr, flush=True)
        return 1
    print("fivefold serve: stopped", file=sys.stderr, flush=True)
    return 0
