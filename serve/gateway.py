"""The HTTP/WebSocket face of the server: `make_app(router, policy)` serves sessions through any `SessionRouter`
behind the access rules of `access.py` (a token per session, the server key, Host/Origin checks, size limits: see
`guard.py`), and `LocalRouter` is the router over one RingHost in this process (`flowjam serve --local`).

Every error is a JSON body `{"error": message}`: no credential -> 401, a wrong one or a foreign Host/Origin -> 403,
SessionRefused -> 503, UnknownSession -> 404, SessionLost -> 410, any other ValueError (a bad knob, a bad spec) -> 400. On the audio WebSocket a bad control message is answered with
an `{"event": "error"}` and the audio keeps flowing: sending audio and reading control messages are two tasks."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import socket
from collections import deque
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from fastapi import FastAPI, Request, WebSocket, WebSocketDisconnect
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from ..engine.params import check_prompt_length
from .access import AccessDenied, AccessPolicy, SessionTokens, bearer
from .errors import SessionLost, SessionRefused, UnknownSession
from .guard import Guard, load_json
from .protocol import ACK_WINDOW_FRAMES, CLOSE_MESSAGE, chunk_span, with_more_dropped

if TYPE_CHECKING:
    from .host import RingHost

log = logging.getLogger("flowjam.serve")

SESSION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
CREATE_FIELDS = {"prompt": (str,), "prompt_b": (str, type(None)), "negative": (str, type(None))}
CREATE_FIELDS |= {"seconds": (int, float), "knobs": (dict,), "name": (str,)}
CREATE_FIELDS |= {"window_seconds": (int, float), "endless": (bool,)}
CREATE_FIELDS |= {"bpm": (int, float), "time_signature": (int, str), "bars": (int,)}
POLL_S = 0.25  # the longest wait for a chunk: a stream that closes frees its poller thread within this
POLLERS = 64
CLOSE_NORMAL, CLOSE_POLICY, CLOSE_INTERNAL, CLOSE_UNKNOWN_SESSION = 1000, 1008, 1011, 4404
SEND_BUFFER_BYTES = 128 * 1024  # Linux doubles it: ~1.3 s of audio (192 kB/s) waits there for a client that stalls


class SessionRouter(Protocol):
    """Where sessions live. `audio` yields encoded chunks (protocol.py) until the session ends, which it says by
    returning or by raising UnknownSession(reason); SessionLost if the session's replica died."""

    async def create(self, spec: dict[str, Any]) -> dict[str, Any]: ...  # spec: the checked POST body with "name"
    async def end(self, session: str) -> None: ...
    async def set_knobs(self, session: str, knobs: dict[str, Any]) -> dict[str, Any]: ...
    async def set_prompt(self, session: str, slot: str, text: str) -> None: ...
    async def status(self, session: str) -> dict[str, Any]: ...
    async def sessions(self) -> list[dict[str, str]]: ...
    async def not_ready(self) -> str | None: ...  # None once sessions can be created; else why not, and what to do
    def audio(self, session: str) -> AsyncIterator[bytes]: ...


def error_status(error: BaseException) -> int | None:
    """The HTTP status of an error a router raises on purpose; None for anything else (a bug: 500)."""
    for kind, status in ((SessionRefused, 503), (UnknownSession, 404), (SessionLost, 410), (ValueError, 400)):
        if isinstance(error, kind):
            return status
    return None


def check_create(body: dict[str, Any]) -> dict[str, Any]:
    """The POST /sessions body with its types checked and a generated "name" if it had none; ValueError names the
    field and the fix. The values themselves (loop length, knobs) are checked where the session starts."""
    unknown = sorted(set(body) - set(CREATE_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown field(s) {', '.join(map(repr, unknown))}; a session takes {', '.join(CREATE_FIELDS)}"
        )
    if "prompt" not in body:
        raise ValueError('a session needs a prompt, e.g. {"prompt": "lofi hip hop, mellow piano"}')
    for field, types in CREATE_FIELDS.items():
        wrong_bool = isinstance(body.get(field), bool) and bool not in types  # True is an int to isinstance
        if field in body and (not isinstance(body[field], types) or wrong_bool):
            wanted = " or ".join("null" if kind is type(None) else kind.__name__ for kind in types)
            raise ValueError(f"{field!r} must be {wanted}, got {type(body[field]).__name__} {body[field]!r}")
    for field in ("prompt", "prompt_b", "negative"):
        _check_prompt_length(field, body.get(field))
    name = body.get("name") or f"s-{secrets.token_hex(4)}"
    if not SESSION_NAME.fullmatch(name):
        raise ValueError(
            f"session name {name!r} must be 1-64 letters, digits, '_', '.' or '-' starting with a letter or digit"
        )
    return {**body, "name": name}


def make_app(router: SessionRouter, policy: AccessPolicy | None = None) -> FastAPI:
    """The API over `router` under `policy` (default: loopback only, no server key, no browser origin)."""
    policy = policy or AccessPolicy()
    tokens = SessionTokens()
    app = FastAPI(title="flowjam", description="live ACE-Step 1.5 sessions: control over HTTP, audio over WebSocket")
    if policy.origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=sorted(policy.origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(Guard, policy=policy)

    async def refused(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=error_status(error))

    async def denied(request: Request, error: Exception) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=error.status)

    for kind in (SessionRefused, UnknownSession, SessionLost, ValueError):
        app.add_exception_handler(kind, refused)
    app.add_exception_handler(AccessDenied, denied)

    def opens(session: str, request: Request | WebSocket) -> None:
        tokens.check(session, bearer(request.headers.get("authorization")))

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 {"ok": true} once sessions can be created; 503 {"ok": false, "error": why} while they cannot."""
        reason = await router.not_ready()
        if reason is None:
            return JSONResponse({"ok": True})
        return JSONResponse({"ok": False, "error": reason}, status_code=503)

    @app.post("/sessions", status_code=201)
    async def create(request: Request) -> dict[str, Any]:
        """A new session; the answer holds its token, which every later call on it must send."""
        policy.check_key(bearer(request.headers.get("authorization")))
        spec = check_create(await _json_object(request, "a session"))
        created = await router.create(spec)
        return {**created, "token": tokens.issue(spec["name"])}

    @app.get("/sessions")
    async def sessions(request: Request) -> dict[str, list[dict[str, str]]]:
        """Every session, to the server key's holder only; nothing to anyone else."""
        presented = bearer(request.headers.get("authorization"))
        if not policy.lists_sessions or presented is None:
            return {"sessions": []}
        policy.check_key(presented)
        return {"sessions": await router.sessions()}

    @app.get("/sessions/{session}")
    async def status(session: str, request: Request) -> dict[str, Any]:
        opens(session, request)
        return await router.status(session)

    @app.delete("/sessions/{session}")
    async def end(session: str, request: Request) -> dict[str, str]:
        opens(session, request)
        try:
            await router.end(session)
        except (UnknownSession, SessionLost):
            tokens.forget(session)
            raise
        tokens.forget(session)
        return {"ended": session}

    @app.post("/sessions/{session}/knobs")
    async def knobs(session: str, request: Request) -> dict[str, Any]:
        opens(session, request)
        return {"applied": await router.set_knobs(session, await _json_object(request, "knobs"))}

    @app.post("/sessions/{session}/prompt")
    async def prompt(session: str, request: Request) -> dict[str, bool]:
        opens(session, request)
        slot, text = _prompt_fields(await _json_object(request, "a prompt"))
        await router.set_prompt(session, slot, text)
        return {"ok": True}

    @app.websocket("/sessions/{session}/stream")
    async def stream(websocket: WebSocket, session: str) -> None:
        try:
            opens(session, websocket)
        except AccessDenied as error:  # closed before it is accepted: the handshake is answered 403
            await websocket.close(CLOSE_POLICY, str(error)[:120])
            return
        await websocket.accept()
        try:
            await router.status(session)
        except (UnknownSession, SessionLost) as error:
            lost = isinstance(error, SessionLost)
            await websocket.send_json({"event": "lost" if lost else "error", "error": str(error)})
            await websocket.close(CLOSE_INTERNAL if lost else CLOSE_UNKNOWN_SESSION)
            return
        link = _Link(websocket)
        audio = asyncio.create_task(_send_audio(router, session, link))
        control = asyncio.create_task(_read_control(router, session, link, policy.max_message_bytes))
        try:
            await asyncio.wait((audio, control), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (audio, control):
                task.cancel()
            outcomes = await asyncio.gather(audio, control, return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, Exception) and not isinstance(outcome, (WebSocketDisconnect, OSError)):
                    log.error("stream of session %s failed", session, exc_info=outcome)
        if outcomes[1] is True:  # the client asked: the server closes, so the stream ends as a finished request
            await link.close(CLOSE_NORMAL)

    return app


def listening_socket(host: str, port: int, send_buffer_bytes: int = SEND_BUFFER_BYTES) -> socket.socket:
    """A TCP socket listening on (host, port) for uvicorn (`Server.run(sockets=[...])`) whose connections keep a
    fixed send buffer. Left to autotuning, a client that stops reading gets up to 4 MB (20 s of audio) queued in
    the kernel before the host's subscription fills and drops its oldest chunks; with this, about a second."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r} does not resolve ({error}); use an address such as 127.0.0.1") from None
    try:
        sock = socket.create_server((host, port), family=family)
    except OSError as error:
        reason = os.strerror(error.errno) if error.errno else str(error)
        raise OSError(error.errno, f"cannot listen on {host}:{port}: {reason}; pick another --port") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)  # accepted connections inherit it
    return sock


class _Link:
    """One WebSocket written by two tasks: every send takes the lock, so frames never interleave."""

    def __init__(self, websocket: WebSocket):
        self.websocket = websocket
        self.lock = asyncio.Lock()
        self.acknowledges = False  # whether the client sends acknowledgements (flow control on)
        self.in_flight: deque[tuple[int, int]] = deque()  # (end sample, frames) of chunks sent, not acknowledged
        self.in_flight_frames = 0
        self.dropped = 0  # chunks not sent because ACK_WINDOW_FRAMES of audio waited for the client's ack

    def keeps_up(self, frames: int) -> bool:
        """Whether a chunk of `frames` may go: the client never acknowledges, or what it has not acknowledged stays
        within the window. Compared with what was sent, not with the live playhead: a client that acknowledges all
        it was sent always gets the next chunk, however late its acknowledgements arrived."""
        return not self.acknowledges or self.in_flight_frames + frames <= ACK_WINDOW_FRAMES

    def sent(self, sample: int, frames: int) -> None:
        self.in_flight.append((sample + frames, frames))
        self.in_flight_frames += frames
        while not self.acknowledges and self.in_flight_frames > ACK_WINDOW_FRAMES:  # only the latest can be acked
            self.in_flight_frames -= self.in_flight.popleft()[1]

    def acknowledge(self, sample: int) -> None:
        """The client took every chunk ending at or before `sample`."""
        self.acknowledges = True
        while self.in_flight and self.in_flight[0][0] <= sample:
            self.in_flight_frames -= self.in_flight.popleft()[1]

    async def send_bytes(self, data: bytes) -> None:
        async with self.lock:
            await self.websocket.send_bytes(data)

    async def send_event(self, event: dict[str, Any]) -> None:
        async with self.lock:
            await self.websocket.send_text(json.dumps(event))

    async def close(self, code: int) -> None:
        async with self.lock:
            with contextlib.suppress(RuntimeError, OSError):  # the client closed first
                await self.websocket.close(code)


async def _send_audio(router: SessionRouter, session: str, link: _Link) -> None:
    reason = f"session {session!r} ended"
    try:
        async for chunk in router.audio(session):
            sample, frames = chunk_span(chunk)
            if not link.keeps_up(frames):
                link.dropped += 1
                continue
            link.sent(sample, frames)
            await link.send_bytes(with_more_dropped(chunk, link.dropped) if link.dropped else chunk)
    except UnknownSession as error:
        reason = str(error)
    except SessionLost as error:
        await link.send_event({"event": "lost", "error": str(error)})
        await link.close(CLOSE_INTERNAL)
        return
    await link.send_event({"event": "ended", "reason": reason})
    await link.close(CLOSE_NORMAL)


async def _read_control(router: SessionRouter, session: str, link: _Link, max_bytes: int) -> bool:
    """Apply the client's control messages until it disconnects (-> False) or asks the server to close the stream
    (`{"close": true}` -> True); a bad one gets an error event, nothing stops."""
    while True:
        message = await link.websocket.receive()
        if message["type"] == "websocket.disconnect":
            return False
        if message.get("text") == CLOSE_MESSAGE:
            return True
        size = len(message.get("text") or "") + len(message.get("bytes") or b"")
        if size > max_bytes:
            await link.send_event(
                {"event": "error", "error": f"a control message of {size} bytes; at most {max_bytes}"}
            )
            continue
        acked = _ack(message.get("text"))
        if acked is not None:
            link.acknowledge(acked)
            continue
        try:
            event = await _apply_control(router, session, message.get("text"))
        except (ValueError, UnknownSession, SessionLost) as error:  # ended or lost: the audio task says so next
            event = {"event": "error", "error": str(error)}
        await link.send_event(event)


def _ack(text: str | None) -> int | None:
    """The sample of an {"ack": sample} message (flow control, answered by nothing), else None."""
    if text is None or not text.startswith('{"ack"'):
        return None
    try:
        sample = load_json(text)["ack"]
    except (ValueError, KeyError, TypeError):  # not an ack after all: answered as a control message
        return None
    return sample if isinstance(sample, int) and sample >= 0 else None


async def _apply_control(router: SessionRouter, session: str, text: str | None) -> dict[str, Any]:
    example = 'send text JSON such as {"knobs": {"denoise": 0.6}} or {"prompt": {"slot": "a", "text": "..."}}'
    if text is None:
        raise ValueError(f"binary messages are audio, which only the server sends; {example}")
    try:
        message = load_json(text)
    except ValueError as error:
        raise ValueError(f"control message: {error}; {example}") from None
    if not isinstance(message, dict) or len(message) != 1 or not {"knobs", "prompt"} & set(message):
        raise ValueError(f"control message {text[:200]!r} is neither knobs nor prompt; {example}")
    if "knobs" in message:
        if not isinstance(message["knobs"], dict):
            raise ValueError(f"knobs must be an object of knob names to values; {example}")
        return {"event": "applied", "knobs": await router.set_knobs(session, message["knobs"])}
    if not isinstance(message["prompt"], dict):
        raise ValueError(f"prompt must be an object with slot and text; {example}")
    slot, text = _prompt_fields(message["prompt"])
    await router.set_prompt(session, slot, text)
    return {"event": "applied", "prompt": {"slot": slot, "text": text}}


async def _json_object(request: Request, what: str) -> dict[str, Any]:
    try:
        body = load_json(await request.body())
    except ValueError as error:
        raise ValueError(f"the body must be a JSON object describing {what}: {error}") from None
    if not isinstance(body, dict):
        raise ValueError(f"the body must be a JSON object describing {what}, got {type(body).__name__}")
    return body


def _prompt_fields(body: dict[str, Any]) -> tuple[str, str]:
    extra = sorted(set(body) - {"slot", "text"})
    slot, text = body.get("slot", "a"), body.get("text")
    if extra or not isinstance(slot, str) or not isinstance(text, str):
        raise ValueError(f'a prompt is {{"slot": "a" | "b" | "negative", "text": "..."}}, got {json.dumps(body)[:200]}')
    _check_prompt_length("text", text)
    return slot, text


def _check_prompt_length(field: str, text: Any) -> None:
    if isinstance(text, str):
        check_prompt_length(text, repr(field))


class LocalRouter:
    """The SessionRouter over one RingHost in this process. The host's calls block (they wait for the ring between
    ticks), so each runs in a thread; audio streams wait for chunks on a pool of their own (POLLERS threads: as many
    streams at once), so waiting streams never hold up a control call."""

    def __init__(self, host: RingHost, replica: str = "local", subscriber_chunks: int | None = None):
        """`subscriber_chunks`: how many chunks wait for a slow client before its oldest are dropped (None: the
        host's default)."""
        self.host = host
        self.replica = replica
        self.subscriber_chunks = subscriber_chunks
        self._pollers = ThreadPoolExecutor(max_workers=POLLERS, thread_name_prefix="flowjam-audio-poll")

    async def create(self, spec: dict[str, Any]) -> dict[str, Any]:
        from .host import SessionSpec

        fields = {key: value for key, value in spec.items() if key != "name"}
        status = await asyncio.to_thread(self.host.create, spec["name"], SessionSpec(**fields))
        return {"session": spec["name"], "replica": self.replica, "status": status}

    async def end(self, session: str) -> None:
        await asyncio.to_thread(self.host.end, session)

    async def set_knobs(self, session: str, knobs: dict[str, Any]) -> dict[str, Any]:
        return await asyncio.to_thread(self.host.set_knobs, session, knobs)

    async def set_prompt(self, session: str, slot: str, text: str) -> None:
        await asyncio.to_thread(self.host.set_prompt, session, slot, text)

    async def status(self, session: str) -> dict[str, Any]:
        return {**await asyncio.to_thread(self.host.status, session), "replica": self.replica}

    async def not_ready(self) -> str | None:
        return None  # the host is built before the app serves

    async def sessions(self) -> list[dict[str, str]]:
        names = await asyncio.to_thread(self.host.names)
        return [{"session": name, "replica": self.replica} for name in names]

    async def audio(self, session: str) -> AsyncIterator[bytes]:
        options = {} if self.subscriber_chunks is None else {"max_chunks": self.subscriber_chunks}
        subscription = await asyncio.to_thread(self.host.subscribe, session, **options)
        loop = asyncio.get_running_loop()
        try:
            while True:  # UnknownSession from get(): the session ended and every chunk was read
                chunk = await loop.run_in_executor(self._pollers, subscription.get, POLL_S)
                if chunk is not None:
                    yield chunk
        finally:
            await asyncio.to_thread(self.host.unsubscribe, session, subscription)

    def close(self) -> None:
        self._pollers.shutdown(wait=False, cancel_futures=True)
