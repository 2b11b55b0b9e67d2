"""A cap on request bodies, as ASGI middleware: a body past `max_bytes` gets 413 with an
OpenAI-shaped error before any of it is parsed.

A declared Content-Length over the cap is refused before the body is read; a chunked body is
counted as it arrives and refused once it passes the cap. A body within the cap is read
whole here and handed to the application as one message; what the client sends after it (a
disconnect) reaches the application as before.
"""

from __future__ import annotations

import json

from fivefold.serve.openai.protocol import error_body


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def _refuse(self, send, size: str) -> None:
        body = json.dumps(error_body(
            f"the request body ({size}) is over this server's limit of {self.max_bytes} "
            f"bytes; send less, or start the server with a larger --max-request-bytes",
            kind="invalid_request_error", code=413)).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, f"{int(declared)} bytes")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, f"over {size} bytes")
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()

        await self.app(scope, replay, send)
