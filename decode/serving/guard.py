"""The ASGI middleware around every route of the server (``RequestGuard``).

It holds what no route can: a deadline for the request body, an answer of its own when a bug
escapes every handler (500, never a reset connection), ``Connection: close`` after an answer
that did not wait for its body, and one count per request in ``/metrics`` by how the request
ended (the status sent, or 499 for a client that hung up first).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from draftsmith.decode.serving.metrics import ServerMetrics
from draftsmith.decode.serving.protocol import error_body, error_json
from starlette.requests import ClientDisconnect

logger = logging.getLogger(__name__)

ENDPOINTS = (  # counted by name in /metrics; any other path as "other"
    "/v1/models",
    "/v1/completions",
    "/v1/chat/completions",
    "/health",
    "/metrics",
    "/openapi.json",
)
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left before the answer


class RequestGuard:
    """ASGI middleware around every route: a body deadline, no escaping exception, one count.

    - The request body must arrive within ``body_timeout`` seconds of the headers; past it the
      answer is 408 (``Connection: close``) and the route sees a disconnect.
    - An answer that starts before the body was read whole closes the connection afterwards,
      so a client cannot hold it by trickling a body nobody reads (after a 401, say).
    - An exception that no handler turned into an answer is a bug of the server: logged with
      its traceback and answered 500 here (if no answer started), so it never reaches
      Starlette's error middleware, which re-raises and makes uvicorn reset the connection.
    - ``draftsmith_requests_total`` counts each request once, by how it ended: the status sent,
      or 499 when the client hung up before its answer was complete (a cut stream included).
    """

    def __init__(self, app: Any, metrics: ServerMetrics, body_timeout: float) -> None:
        self.app = app
        self.metrics = metrics
        self.body_timeout = body_timeout

    async def __call__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
    ) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = Exchange(scope, receive, send, self.body_timeout)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        except ClientDisconnect:
            exchange.client_left = True
        except Exception:
            logger.exception("unhandled error answering %s %s", scope["method"], scope["path"])
            await exchange.fail()
        finally:
            path = scope.get("path", "")
            self.metrics.record_response(path if path in ENDPOINTS else "other", exchange.outcome())


class Exchange:
    """One request's ASGI channels as ``RequestGuard`` watches them."""

    def __init__(
        self,
        scope: dict[str, Any],
        receive: Callable[[], Awaitable[Any]],
        send: Callable[[Any], Awaitable[None]],
        body_timeout: float,
    ) -> None:
        self._receive = receive
        self._send = send
        self._body_timeout = body_timeout
        self._deadline = asyncio.get_running_loop().time() + body_timeout
        self.body_read = not has_body(scope["headers"])
        self.status: int | None = None  # of the answer started, if any
        self.complete = False  # the whole answer went out
        self.client_left = False  # a disconnect came before the answer was complete
        self.answered_here = False  # the guard answered (408, 500): the route's answer is dropped
        self.failed = False  # an exception cut an answer that had started

    async def receive(self) -> dict[str, Any]:
        if self.answered_here:
            return {"type": "http.disconnect"}
        if self.body_read:
            message = await self._receive()
        else:
            remaining = self._deadline - asyncio.get_running_loop().time()
            try:
                message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
            except asyncio.TimeoutError:
                late = f"the request body did not arrive within {self._body_timeout:g} s"
                await self.answer(408, late, "invalid_request_error", "request_timeout")
                return {"type": "http.disconnect"}
            if message["type"] == "http.request" and not message.get("more_body", False):
                self.body_read = True
        if message["type"] == "http.disconnect" and not self.complete:
            self.client_left = True
        return message

    async def send(self, message: dict[str, Any]) -> None:
        if self.answered_here:
            return
        if message["type"] == "http.response.start":
            self.status = message["status"]
            if not self.body_read:
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True  # before sending: the disconnect that follows is not a hang-up
        await self._send(message)

    async def answer(self, status: int, message: str, kind: str, code: str | None) -> None:
        """Answer here, replacing whatever the route would have sent."""
        if self.status is not None:
            return
        body = error_json(error_body(message, kind, code=code))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body})
        self.answered_here = True

    async def fail(self) -> None:
        if self.status is None:
            await self.answer(500, "internal server error", "server_error", None)
        else:
            self.failed = True  # uvicorn closes the connection of an unfinished answer

    def outcome(self) -> int:
        """The status this request is counted under."""
        if self.failed:
            return 500
        if self.answered_here:
            return self.status or 500
        if self.client_left or not self.complete or self.status is None:
            return CLIENT_CLOSED_REQUEST
        return self.status


def has_body(headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """Whether the request announces a body (chunked, or a non-zero Content-Length)."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False
