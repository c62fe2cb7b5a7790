"""The plugin's panel: a small web page, served by the engine on loopback, where a player types the prompts and turns
the knobs without leaving the DAW (the plugin's `panel` parameter has the engine open it in the browser). Every
address carries the session's random token (`http://127.0.0.1:PORT/TOKEN/`); a request without it is refused (403),
as is one whose Host header is not this server's (a page elsewhere that rebinds a name to 127.0.0.1). A change goes
the way an OSC message goes: the knob registry (origin "panel") and the app's prompt setter.

Routes under /TOKEN/: GET "" the page (live/plugin_panel.html: no network fetches), GET "state" the prompts and the
knobs with their ranges, POST "knob" {"name", "value"} and POST "prompt" {"slot": "a" | "b" | "negative", "text"}.
A bad body gets a 400 naming the fix; the stream plays on."""

from __future__ import annotations

import hmac
import json
import logging
import math
import secrets
import threading
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from numbers import Real
from pathlib import Path
from typing import Any

from ..engine.params import MAX_PROMPT_CHARS, KnobSpec
from .knobs import KnobError, KnobRegistry
from .plugin_link import PROMPTS

log = logging.getLogger("flowjam.panel")

PANEL_HOST = "127.0.0.1"
PANEL_ORIGIN = "panel"  # a knob change from the panel
MAX_BODY_BYTES = 64 * 1024  # a prompt of MAX_PROMPT_CHARS characters, JSON-escaped, fits
PAGE = Path(__file__).with_name("plugin_panel.html")
KNOB_BODY = '{"name": <knob>, "value": <number, or a choice name>}'
PROMPT_BODY = '{"slot": "a" | "b" | "negative", "text": <prompt>}'


class PanelError(ValueError):
    """A refused request: its HTTP status and the message the page shows."""

    def __init__(self, status: HTTPStatus, message: str):
        super().__init__(message)
        self.status = status


def spec_json(spec: KnobSpec, value: float) -> dict[str, Any]:
    return {
        "value": value,
        "min": spec.minimum,
        "max": spec.maximum,
        "default": spec.default,
        "integer": spec.integer,
        "unit": spec.unit,
        "choices": list(spec.choices),
        "description": spec.description,
    }


def knob_change(registry: KnobRegistry, body: Any) -> tuple[str, float | str]:
    """A knob body checked against the registry: (name, value), or PanelError naming the fix. Unlike OSC's
    controllers, which send 0..1 and are clamped, a typed value outside the knob's range is refused."""
    if not isinstance(body, dict) or set(body) != {"name", "value"}:
        raise PanelError(HTTPStatus.BAD_REQUEST, f"send a JSON object {KNOB_BODY}")
    name, value = body["name"], body["value"]
    spec = registry.specs.get(name) if isinstance(name, str) else None
    if spec is None:
        raise PanelError(HTTPStatus.BAD_REQUEST, f"unknown knob {name!r}: the knobs are {', '.join(registry.specs)}")
    if isinstance(value, str) and spec.choices:
        if value not in spec.choices:
            raise PanelError(HTTPStatus.BAD_REQUEST, f"knob {name} takes one of {', '.join(spec.choices)}")
        return name, value
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise PanelError(HTTPStatus.BAD_REQUEST, f"knob {name} takes a number, got {json.dumps(value)}")
    if not spec.minimum <= value <= spec.maximum:
        raise PanelError(
            HTTPStatus.BAD_REQUEST, f"knob {name} takes {spec.minimum:g}..{spec.maximum:g}, got {float(value):g}"
        )
    return name, float(value)


def prompt_change(body: Any) -> tuple[str, str]:
    """A prompt body checked: (slot, text), or PanelError naming the fix. Prompts A and B need words; an empty
    negative goes back to the null condition."""
    if not isinstance(body, dict) or set(body) != {"slot", "text"}:
        raise PanelError(HTTPStatus.BAD_REQUEST, f"send a JSON object {PROMPT_BODY}")
    slot, text = body["slot"], body["text"]
    if slot not in PROMPTS:
        raise PanelError(HTTPStatus.BAD_REQUEST, f"prompt slot must be one of {', '.join(PROMPTS)}, got {slot!r}")
    if not isinstance(text, str):
        raise PanelError(HTTPStatus.BAD_REQUEST, f"the prompt text is a string, got {json.dumps(text)}")
    if len(text) > MAX_PROMPT_CHARS:
        raise PanelError(
            HTTPStatus.BAD_REQUEST, f"a prompt takes at most {MAX_PROMPT_CHARS} characters, got {len(text)}"
        )
    if slot != "negative" and not text.strip():
        raise PanelError(HTTPStatus.BAD_REQUEST, f"prompt {slot.upper()} is empty: describe the music")
    return slot, text


class PluginPanel:
    def __init__(
        self,
        registry: KnobRegistry,
        on_prompt: Callable[[str, str], None],
        captions: Callable[[], dict[str, str]],
        port: int = 0,
        before_change: Callable[[], None] = lambda: None,
    ):
        """`on_prompt(slot, text)`: the app's prompt setter; `captions()`: the prompts playing now; `port` 0: any free
        one; `before_change()`: called before each change the panel makes (the plugin's output takes in the host's
        changes made before it)."""
        self.registry, self._on_prompt, self._captions = registry, on_prompt, captions
        self._before_change = before_change
        self.token = secrets.token_urlsafe(18)
        self._server = ThreadingHTTPServer((PANEL_HOST, port), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{PANEL_HOST}:{self.port}/{self.token}/"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._server.serve_forever, name="flowjam-panel", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=2.0)
        self._server.server_close()

    def state(self) -> dict[str, Any]:
        values = self.registry.values()
        knobs = {name: spec_json(spec, values[name]) for name, spec in self.registry.specs.items()}
        return {"prompts": self._captions(), "knobs": knobs}

    def set_knob(self, body: Any) -> dict[str, Any]:
        name, value = knob_change(self.registry, body)
        self._before_change()
        try:
            change = self.registry.set(name, value, origin=PANEL_ORIGIN)
        except KnobError as error:
            raise PanelError(HTTPStatus.BAD_REQUEST, str(error)) from None
        return {"name": change.name, "value": change.value}

    def set_prompt(self, body: Any) -> dict[str, Any]:
        slot, text = prompt_change(body)
        self._before_change()
        try:
            self._on_prompt(slot, text)
        except ValueError as error:
            raise PanelError(HTTPStatus.BAD_REQUEST, str(error)) from None
        return {"slot": slot, "text": text}

    def allowed_host(self, host: str | None) -> bool:
        return host in (f"{PANEL_HOST}:{self.port}", f"localhost:{self.port}")


def _handler(panel: PluginPanel) -> type[BaseHTTPRequestHandler]:
    class PanelHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = self._route()
            if route == "":
                self._send(HTTPStatus.OK, PAGE.read_bytes(), "text/html; charset=utf-8")
            elif route == "state":
                self._json(HTTPStatus.OK, panel.state())
            elif route is not None:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {route!r}: the panel is at {panel.url}"})

        def do_POST(self) -> None:
            route = self._route()
            actions = {"knob": panel.set_knob, "prompt": panel.set_prompt}
            if route is None:
                return
            if route not in actions:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"POST knob or prompt, not {route!r}"})
                return
            try:
                self._json(HTTPStatus.OK, actions[route](self._body()))
            except PanelError as error:
                self._json(error.status, {"error": str(error)})

        def _route(self) -> str | None:
            """The path after the token, or None once a 403 is sent (no token, a wrong one, a foreign Host)."""
            token, _, rest = self.path.partition("?")[0].lstrip("/").partition("/")
            if not hmac.compare_digest(token.encode(), panel.token.encode()):
                self._json(HTTPStatus.FORBIDDEN, {"error": "this panel needs its token: open the URL the engine gave"})
                return None
            if not panel.allowed_host(self.headers.get("Host")):
                self._json(HTTPStatus.FORBIDDEN, {"error": f"the panel answers at {PANEL_HOST}:{panel.port} only"})
                return None
            return rest

        def _body(self) -> Any:
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                raise PanelError(HTTPStatus.BAD_REQUEST, "send a JSON body with its Content-Length") from None
            if not 0 <= length <= MAX_BODY_BYTES:
                raise PanelError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"a body takes at most {MAX_BODY_BYTES} bytes")
            try:
                return json.loads(self.rfile.read(length))
            except ValueError:
                raise PanelError(HTTPStatus.BAD_REQUEST, "the body is not JSON: send a JSON object") from None

        def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
            self._send(status, json.dumps(body).encode(), "application/json")

        def _send(self, status: HTTPStatus, data: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("Referrer-Policy", "no-referrer")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("panel: " + format, *args)

    return PanelHandler
