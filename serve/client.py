"""A small synchronous client of `flowjam serve`: HTTP calls through urllib, the audio stream through the
`websockets` sync client. Imports no torch, so a laptop that only listens or bridges a controller can use it."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.protocol import State
from websockets.sync.client import ClientConnection, connect

from .protocol import ACK_EVERY, CLOSE_MESSAGE, AudioChunk, decode_chunk

CLOSE_UNKNOWN_SESSION = 4404
CLOSE_WAIT_S = 2.0  # how long closing a stream waits for the server's close


class ServerError(RuntimeError):
    """The server refused a call: `status` is its HTTP status (404 also for a stream of an unknown session) and
    `message` the server's own explanation."""

    def __init__(self, status: int, message: str):
        super().__init__(status, message)
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.message} (HTTP {self.status})"


class Client:
    def __init__(self, server: str, timeout_s: float = 60.0, token: str | None = None, key: str | None = None):
        """`server`: the base URL, e.g. http://127.0.0.1:8000. `timeout_s` bounds every call (creating a session
        on a GPU may take a while). `token`: the token of a session created elsewhere (sessions this client creates
        keep their own); `key`: the server key, to create and list sessions where the server has one."""
        parts = urllib.parse.urlsplit(server)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"server must be an http(s) URL such as http://127.0.0.1:8000, got {server!r}")
        self.server = server.rstrip("/")
        self.timeout_s = timeout_s
        self.token = token
        self.key = key
        self.tokens: dict[str, str] = {}  # session -> its token, for the sessions this client created

    def health(self) -> bool:
        """True once the server can create sessions; False while it cannot yet (its replicas still start)."""
        return self.not_ready() is None

    def not_ready(self) -> str | None:
        """None once the server can create sessions; else the server's reason (a 503 from /health)."""
        try:
            self._call("GET", "/health")
        except ServerError as error:
            if error.status == 503:
                return error.message
            raise
        return None

    def create(
        self,
        prompt: str,
        prompt_b: str | None = None,
        negative: str | None = None,
        seconds: float | None = None,
        knobs: dict[str, float | str] | None = None,
        name: str | None = None,
        window_seconds: float | None = None,
        endless: bool | None = None,
        bpm: float | None = None,
        time_signature: int | str | None = None,
        bars: int | None = None,
    ) -> dict[str, Any]:
        """Start a session -> {"session": name, "replica": id, "status": {...}, "token": its token}; the client
        keeps the token for its later calls on the session. `window_seconds`, `endless`, the grid (`bpm`,
        `time_signature`, `bars`): see SessionSpec."""
        given = {"prompt_b": prompt_b, "negative": negative, "seconds": seconds, "knobs": knobs, "name": name}
        given |= {"window_seconds": window_seconds, "endless": endless}
        given |= {"bpm": bpm, "time_signature": time_signature, "bars": bars}
        body = {"prompt": prompt, **{key: value for key, value in given.items() if value is not None}}
        created = self._call("POST", "/sessions", body, self.key)
        self.tokens[created["session"]] = created["token"]
        return created

    def end(self, session: str) -> None:
        self._call("DELETE", _path(session), credential=self._token(session))
        self.tokens.pop(session, None)

    def status(self, session: str) -> dict[str, Any]:
        return self._call("GET", _path(session), credential=self._token(session))

    def sessions(self) -> list[dict[str, str]]:
        """Every session on the server, for the server key's holder; an empty list without the key."""
        return self._call("GET", "/sessions", credential=self.key)["sessions"]

    def set_knobs(self, session: str, knobs: dict[str, float | str]) -> dict[str, float | str]:
        """Set several knobs at once (a bad one sets none) -> the values they now hold."""
        return self._call("POST", _path(session, "knobs"), knobs, self._token(session))["applied"]

    def set_prompt(self, session: str, slot: str, text: str) -> None:
        self._call("POST", _path(session, "prompt"), {"slot": slot, "text": text}, self._token(session))

    def stream(self, session: str) -> Stream:
        """The session's audio and events, with a channel for knob and prompt messages back."""
        url = "ws" + self.server.removeprefix("http") + _path(session, "stream")
        try:
            connection = connect(
                url,
                open_timeout=self.timeout_s,
                compression=None,
                max_size=None,
                additional_headers=_authorization(self._token(session)),
            ).__enter__()
            return Stream(connection)
        except InvalidStatus as error:
            raise ServerError(error.response.status_code, f"the server refused the stream {url}") from None
        except OSError as error:
            raise self._unreachable(error) from None

    def _token(self, session: str) -> str | None:
        return self.tokens.get(session, self.token)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None, credential: str | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **_authorization(credential)}
        request = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            text = error.read().decode(errors="replace")
            try:
                message = json.loads(text)["error"]
            except (ValueError, KeyError, TypeError):
                message = text.strip() or error.reason
            raise ServerError(error.code, message) from None
        except urllib.error.URLError as error:
            raise self._unreachable(error.reason) from None
        except TimeoutError:
            raise TimeoutError(
                f"{method} {self.server}{path} got no answer within {self.timeout_s:g} s; is the server overloaded?"
            ) from None

    def _unreachable(self, reason: object) -> ConnectionError:
        return ConnectionError(
            f"cannot reach the flowjam server at {self.server} ({reason}); is `flowjam serve` running there?"
        )


class Stream:
    """One session's stream. Iterating yields decoded AudioChunks and event dicts ({"event": "applied" | "error" |
    "ended" | "lost", ...}) until the server closes it; a stream of an unknown session raises ServerError(404).
    Sending (set_knobs, set_prompt) may happen on another thread than the one reading."""

    def __init__(self, connection: ClientConnection):
        self.connection = connection
        self.close_code: int | None = None  # once the server closed the stream
        self._last_error = ""
        self._unacked = 0  # chunks taken since the last acknowledgement (flow control: see protocol.py)

    def receive(self, timeout_s: float | None = None) -> AudioChunk | dict[str, Any] | None:
        """The next chunk or event; None once the stream is closed; TimeoutError if nothing came in `timeout_s`."""
        if self.close_code is not None:
            return None
        try:
            message = self.connection.recv(timeout_s)
        except ConnectionClosed as error:
            self.close_code = error.rcvd.code if error.rcvd is not None else 1006
            if self.close_code == CLOSE_UNKNOWN_SESSION:
                raise ServerError(404, self._last_error or "unknown session") from None
            return None
        if isinstance(message, bytes):
            chunk = decode_chunk(message)
            self._unacked += 1
            if self._unacked >= ACK_EVERY:
                self._unacked = 0
                with contextlib.suppress(ConnectionClosed):  # the close is read on the next receive
                    self.connection.send(json.dumps({"ack": chunk.sample + chunk.frames}))
            return chunk
        event = json.loads(message)
        if event.get("event") == "error":
            self._last_error = event.get("error", "")
        return event

    def __iter__(self) -> Iterator[AudioChunk | dict[str, Any]]:
        while (item := self.receive()) is not None:
            yield item

    def set_knobs(self, knobs: dict[str, float | str]) -> None:
        """Answered on the stream by {"event": "applied", "knobs": {...}} or {"event": "error", "error": ...}."""
        self.connection.send(json.dumps({"knobs": knobs}))

    def set_prompt(self, slot: str, text: str) -> None:
        self.connection.send(json.dumps({"prompt": {"slot": slot, "text": text}}))

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Ask the server to end the stream and wait up to `timeout_s` for its close (audio still on its way is
        dropped), then close the connection. A server-side close ends the request cleanly on every hop: a client
        that just hangs up mid-send makes Ray Serve's proxy log its request as failed (docs/serve.md)."""
        deadline = time.monotonic() + timeout_s
        try:
            if self.close_code is None:
                self.connection.send(CLOSE_MESSAGE)
            while self.close_code is None and (left := deadline - time.monotonic()) > 0:
                try:
                    self.connection.recv(min(left, 0.1))
                except TimeoutError:
                    continue
                except RuntimeError:  # another thread is reading it: that thread sees the close
                    if self.connection.state is State.CLOSED:
                        break
                    time.sleep(0.02)
        except ConnectionClosed as error:
            self.close_code = error.rcvd.code if error.rcvd is not None else 1006
        self.connection.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _authorization(credential: str | None) -> dict[str, str]:
    return {} if credential is None else {"Authorization": f"Bearer {credential}"}


def _path(session: str, *rest: str) -> str:
    return "/".join(("/sessions", urllib.parse.quote(session, safe=""), *rest))
