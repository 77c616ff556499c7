"""HTTP/1.1 connections: uvicorn's h11 protocol with deadlines on idle sockets and headers.

uvicorn closes a connection that stays idle ``timeout_keep_alive`` seconds *between* requests,
but it starts no clock when a connection opens and stops the clock at a request's first byte:
a client that connects and waits, or sends half a request line or half its headers and then
trickles a byte now and then, holds a connection (and a file descriptor) for ever. Here:

- a connection on which nothing arrives is closed after ``timeout_keep_alive`` seconds, like an
  idle keep-alive connection;
- a request's headers must be complete within ``header_timeout`` seconds of its first byte (a
  total, not an idle time: trickling does not extend it); past that the server answers 408 in
  OpenAI's error schema and closes the connection;
- a malformed request, which uvicorn answers with a plain-text 400, gets OpenAI's error schema.

Bodies have their own deadline in the ASGI app (``draftsmith.decode.serving.app``), where the answer can
be counted against its endpoint. The protocol is always h11, even where httptools is installed,
so these guarantees do not depend on which optional packages happen to be present.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import h11
from draftsmith.decode.serving.protocol import error_body, error_json
from uvicorn.protocols.http.h11_impl import H11Protocol


class GuardedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` plus the deadlines above; configure it with ``guarded_h11``."""

    header_timeout: float = 10.0
    on_reject: Callable[[int], None] | None = None  # told the status of each answer given here

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Idle from the start: closed like an idle keep-alive connection if nothing arrives.
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        # Part of a request's head is buffered: its headers' clock runs until they are complete.
        waiting = self.conn.their_state is h11.IDLE and bool(self.conn.trailing_data[0])
        if not waiting:
            self._stop_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: OpenAI's error schema instead of uvicorn's plain text."""
        self._reject(400, f"malformed HTTP request ({msg.rstrip('.')}); send valid HTTP/1.1")

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._reject(
                408, f"the request headers did not arrive within {self.header_timeout:g} s"
            )

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _reject(self, status: int, message: str) -> None:
        """Answer ``status`` with ``Connection: close`` and close, bypassing the app."""
        self._stop_header_timer()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # The app is still running this request: it sees a disconnect, its answer is dropped.
            cycle.disconnected = True
            cycle.message_event.set()
            if cycle.response_started:  # an answer is half sent: nothing can follow it
                self.transport.close()
                return
        kind = "invalid_request_error"
        data = error_json(error_body(message, kind, code=HTTPStatus(status).name.lower()))
        head = (
            f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
            "content-type: application/json\r\n"
            f"content-length: {len(data)}\r\n"
            "connection: close\r\n\r\n"
        )
        self.transport.write(head.encode() + data)
        self.transport.close()
        if self.on_reject is not None and (cycle is None or cycle.response_complete):
            self.on_reject(status)  # (a request the app was running is counted by the app)


def guarded_h11(
    header_timeout: float, on_reject: Callable[[int], None] | None = None
) -> type[GuardedH11Protocol]:
    """The protocol class to pass as uvicorn's ``http``, with these settings bound."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be > 0 seconds, got {header_timeout}")
    settings: dict[str, Any] = {"header_timeout": header_timeout}
    if on_reject is not None:
        settings["on_reject"] = staticmethod(on_reject)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), settings)
