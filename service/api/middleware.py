"""ASGI middleware: request-body size limit and request metrics.

Both are plain ASGI (no ``BaseHTTPMiddleware``): they add no task per request and never buffer a
response.
"""

from __future__ import annotations

import json
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.metrics import LedgerMetrics


async def _send_json(send: Send, status: int, body: dict[str, object]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class BodySizeLimit:
    """Refuse request bodies above ``max_bytes`` with 413 before the application parses them.

    A declared ``Content-Length`` above the limit is refused without reading the body. A body sent
    without a length (chunked) is read up to the limit and refused as soon as it passes it; below
    the limit it is replayed to the application unchanged.

    Uploads (``PUT`` on a path ``uploads`` matches: a model artifact) have their own limit,
    ``upload_max_bytes``: a declared length above it is refused here; a chunked upload is passed
    through unbuffered, and the route counts it as it streams (``model_registry.ArtifactUpload``).
    """

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        *,
        upload_max_bytes: int | None = None,
        uploads: re.Pattern[str] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.upload_max_bytes = upload_max_bytes
        self.uploads = uploads

    def _too_large(self, limit: int, field: str = "body") -> dict[str, object]:
        return {
            "error": "payload_too_large",
            "message": f"request {field} must be at most {limit} bytes.",
            "field": field,
            "limit": limit,
        }

    def _upload(self, scope: Scope) -> bool:
        return (
            self.uploads is not None
            and self.upload_max_bytes is not None
            and scope.get("method") == "PUT"
            and self.uploads.fullmatch(scope.get("path", "")) is not None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = self._upload(scope)
        limit = self.upload_max_bytes if upload and self.upload_max_bytes is not None else self.max_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    await _send_json(send, 413, self._too_large(limit, "artifact" if upload else "body"))
                    return
                if declared >= 0:
                    # the server delivers no more than the declared length
                    await self.app(scope, receive, send)
                    return
        if upload:  # streamed to disk by the route, which counts it
            await self.app(scope, receive, send)
            return
        # No usable Content-Length: buffer up to the limit, then replay.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                # client went away; let the application see the disconnect
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await _send_json(send, 413, self._too_large(self.max_bytes))
                return
            chunks.append(body)
            more = message.get("more_body", False)
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]
        await self.app(scope, _replay(replay, receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed


class RequestMetrics:
    """Count requests and time them, labelled by route template (``/v1/datasets/{dataset_id}``)."""

    def __init__(self, app: ASGIApp, metrics: LedgerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            method = scope.get("method", "")
            self.metrics.requests.inc(method=method, route=template, status=str(status))
            self.metrics.request_latency.observe(time.perf_counter() - start, method=method, route=template)
