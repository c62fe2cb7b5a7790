"""The gateway's outer wall: `Guard`, ASGI middleware that checks Host and Origin on every request and WebSocket,
takes state changes only as JSON and reads a body no further than its cap; `GuardedH11`, uvicorn's HTTP protocol
with a deadline for a request's headers. The same Guard wraps the app on `--local` and behind Ray Serve's proxy."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Awaitable, Callable
from itertools import accumulate
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .access import AccessDenied, AccessPolicy

log = logging.getLogger("flowjam.serve")

SHUTDOWN_S = 0.5  # Ctrl-C: connections that have not closed by then (stalled WebSocket readers) are dropped
MAX_FRAME_BYTES = 64 * 1024  # a larger WebSocket frame closes its connection (1009) before it is buffered whole
HEADER_TIMEOUT_S = 10.0  # a request whose headers (or the next part of its body) take longer is closed
BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
JSON_TYPES = frozenset({"application/json"})
MAX_JSON_DEPTH = 16  # a knob body is nested 1 deep, a create 2: anything far deeper is refused before parsing
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
JSON_NESTING = re.compile(r"[\[\]{}]")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def server_config(app: Callable, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for the gateway on `--local`: the guarded protocol and its limits."""
    return uvicorn.Config(
        app,
        http=GuardedH11,
        ws_max_size=MAX_FRAME_BYTES,
        timeout_graceful_shutdown=SHUTDOWN_S,
        log_level=log_level,
    )


class Guard:
    """ASGI middleware applying an AccessPolicy before the app sees a request."""

    def __init__(self, app: Callable, policy: AccessPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in scope["headers"]}
        try:
            self.policy.check_host(headers.get("host"))
            self.policy.check_origin(headers.get("origin"))
        except AccessDenied as denied:
            await _refuse(scope, send, denied.status, str(denied))
            return
        if scope["type"] == "http" and scope["method"] in BODY_METHODS:
            kind = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if kind not in JSON_TYPES and (kind or scope["method"] != "DELETE"):
                await _refuse(scope, send, 415, f"send the body as Content-Type: application/json, not {kind!r}")
                return
            body = await self._read_body(scope, headers, receive, send)
            if body is None:
                return
            receive = _replaying(body, receive)
        await self.app(scope, receive, send)

    async def _read_body(self, scope: Scope, headers: dict[str, str], receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None once a refusal (413, read no further) was sent or the client went away."""
        limit = self.policy.max_body_bytes
        too_large = f"the body is over the limit of {limit} bytes (knobs and prompts take a few hundred)"
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            await _refuse(scope, send, 413, too_large)
            return None
        body = bytearray()
        while True:
            try:
                message = await asyncio.wait_for(receive(), HEADER_TIMEOUT_S)
            except asyncio.TimeoutError:
                await _refuse(scope, send, 408, f"the request body stalled for {HEADER_TIMEOUT_S:.0f} s")
                return None
            if message["type"] == "http.disconnect":
                client = scope.get("client") or ("?", 0)
                log.info("client %s:%s went away before its request body ended", *client)
                return None
            body += message.get("body", b"")
            if len(body) > limit:
                await _refuse(scope, send, 413, too_large)
                return None
            if not message.get("more_body", False):
                return bytes(body)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete within HEADER_TIMEOUT_S
    (uvicorn times out idle connections only after a first response, so half-open requests would stay forever)."""

    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is None and self._waiting_for_headers():
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _waiting_for_headers(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(HEADER_TIMEOUT_S, self._deadline_passed)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        upgraded = self.transport.get_protocol() is not self  # a WebSocket now: not ours to time out
        if not upgraded and self._waiting_for_headers() and not self.transport.is_closing():
            self.transport.close()


def load_json(text: str | bytes) -> Any:
    """Parse a body or control message whose nesting was first counted: ValueError naming the limit (not the
    parser's RecursionError, a 500) past MAX_JSON_DEPTH, or for text that is not UTF-8 JSON."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(f"JSON must be UTF-8 ({error})") from None
    brackets = JSON_NESTING.findall(JSON_STRING.sub("", text))
    deepest = max(accumulate(1 if bracket in "[{" else -1 for bracket in brackets), default=0)
    if deepest > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested {deepest} deep; at most {MAX_JSON_DEPTH} (a knob body is 1 deep)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"not JSON ({error})") from None


async def _refuse(scope: Scope, send: Send, status: int, message: str) -> None:
    if scope["type"] == "websocket":  # closed before it is accepted: the client's handshake gets 403
        await send({"type": "websocket.close", "code": 1008, "reason": message[:120]})
        return
    body = json.dumps({"error": message}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then passes on whatever comes next (a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> dict[str, Any]:
        return pending.pop() if pending else await receive()

    return replay
