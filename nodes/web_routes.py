"""The live panel's side of ComfyUI's own server: HTTP routes to read a stream's status and turn a knob (no
re-queue), and a publisher that pushes every stream's status to the browsers as a `flowjam.status` event.

The handler logic is plain functions, `status_for` and `set_knob` -> (HTTP status, JSON-ready dict), and the
publisher takes the send function it pushes through, so all of it is tested without ComfyUI or aiohttp;
`register()` only wires them to ComfyUI's PromptServer, once per process whichever node API asks."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..engine.params import KNOB_SPECS, KnobSpec
from ..live import performances
from ..live.knobs import KnobError
from .prompt_types import refuse_text_booleans

log = logging.getLogger("flowjam.web")

KNOB_BODY = '{"name": <knob>, "value": <number, or a choice name for a choice knob>}'
SESSIONS_PATH = "/flowjam/sessions"
STATUS_PATH = "/flowjam/session/{name}"
KNOB_PATH = "/flowjam/session/{name}/knob"
STATUS_EVENT = "flowjam.status"  # web/flowjam.js listens for it
PUBLISH_INTERVAL_S = 0.25


def spec_json(spec: KnobSpec) -> dict[str, Any]:
    return {
        "min": spec.minimum,
        "max": spec.maximum,
        "default": spec.default,
        "kind": spec.kind.value,
        "integer": spec.integer,
        "unit": spec.unit,
        "choices": list(spec.choices),
        "description": spec.description,
    }


SPECS_JSON = {spec.name: spec_json(spec) for spec in KNOB_SPECS}


def curve_driven(app) -> list[str]:
    """Shared knobs a per-frame curve drives now (more than one frame along the curve's time axis): the knob's own
    value is not what plays."""
    curves = app.runner.stream.shared_curves()
    return sorted(name for name, curve in curves.items() if curve.dim() > 1 and curve.shape[1] > 1)


def not_running(name: str) -> str:
    return f"no running stream named {name!r}; queue a graph with a flowjam Stream node whose session_id is {name!r}"


def loop_field(status: dict[str, Any], endless: bool, asked_window_s: float) -> str:
    """What the stream plays, for the panel: "loop 19.2 s · 8 bars @ 100 · window 4 s", or "endless · window 4 s";
    a window of 0, or one at least the loop, generates the whole loop each time, and says so."""
    window_s = status.get("window_s") or 0.0
    if endless:
        return f"endless · window {window_s:g} s"
    parts = [f"loop {status['loop_s']:.1f} s"]
    if status.get("bars"):
        parts.append(f"{status['bars']} bars @ {status['bpm']:g}")
    if window_s:
        parts.append(f"window {window_s:g} s")
    else:
        parts.append("window = whole loop" + (f" ({asked_window_s:g} s asked)" if asked_window_s else ""))
    return " · ".join(parts)


def live_status(name: str, app) -> dict[str, Any]:
    """A registered stream's meters, knob values and curve-driven knobs as plain JSON (no specs)."""
    status = app.status()
    status.update(name=name, running=app.runner.alive, curves=curve_driven(app))
    status["loop_s"] = app.buffer.frames / app.buffer.sample_rate
    status["endless"] = app.config.runner.endless
    status["loop"] = loop_field(status, app.config.runner.endless, app.config.runner.window_s)
    return json.loads(json.dumps(status, default=str))


def status_for(name: str) -> tuple[int, dict[str, Any]]:
    """GET /flowjam/session/{name}: always 200 (a panel asks before its stream exists and after it stops);
    `running` says whether the stream plays, `specs` carries every knob's range either way, a running stream's
    `lora/<name>` knobs included."""
    app = performances.get(name)
    if app is None:
        return 200, {"name": name, "running": False, "specs": SPECS_JSON, "sessions": performances.names()}
    specs = {spec.name: spec_json(spec) for spec in app.registry.specs.values()}
    return 200, {**live_status(name, app), "specs": specs}


def set_knob(name: str, body: Any) -> tuple[int, dict[str, Any]]:
    """POST /flowjam/session/{name}/knob with `body` the parsed JSON (None when it was not JSON): 404 for an unknown
    stream, 400 for a bad body or knob, else 200 with the value the knob now holds."""
    app = performances.get(name)
    if app is None:
        return 404, {"error": not_running(name)}
    if not isinstance(body, dict):
        return 400, {"error": f"send a JSON object {KNOB_BODY}"}
    missing = [key for key in ("name", "value") if key not in body]
    if missing:
        return 400, {"error": f"the body lacks {' and '.join(map(repr, missing))}; send {KNOB_BODY}"}
    try:
        change = app.registry.set(str(body["name"]), body["value"], origin="comfyui-panel")
    except KnobError as error:
        return 400, {"error": str(error)}
    return 200, {"name": change.name, "value": change.value, "clamped": change.clamped}


class StatusPublisher:
    """Pushes `{"sessions": {name: live_status}}` through `send(STATUS_EVENT, payload)` every `interval_s` while at
    least one stream is registered, and once more when the last one goes (so a panel sees it stop); silent while
    nothing runs. `send` is ComfyUI's `PromptServer.instance.send_sync`, safe to call from this thread."""

    def __init__(self, send: Callable[[str, dict[str, Any]], Any], interval_s: float = PUBLISH_INTERVAL_S):
        self.send, self.interval_s = send, interval_s
        self._had_sessions = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False

    def publish_once(self) -> dict[str, Any] | None:
        """Send the status now if there is something to say; -> the payload sent, or None."""
        sessions = {}
        for name in performances.names():
            app = performances.get(name)
            if app is not None:
                sessions[name] = live_status(name, app)
        if not sessions and not self._had_sessions:
            return None
        self._had_sessions = bool(sessions)
        payload = {"sessions": sessions}
        self.send(STATUS_EVENT, payload)
        return payload

    def start(self) -> StatusPublisher:
        self._thread = threading.Thread(target=self._run, name="flowjam-status-publisher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish_once()
                self._failing = False
            except Exception:  # a stream stopping mid-read, or a server shutting down: try again next time
                if not self._failing:
                    log.exception("flowjam: could not publish the streams' status; retrying")
                self._failing = True


def add_routes(routes, json_response: Callable[..., Any]) -> None:
    """Add GET /flowjam/sessions, GET /flowjam/session/{name} and POST /flowjam/session/{name}/knob to an aiohttp
    RouteTableDef, answering through `json_response(body, status=...)`."""

    def reply(result: tuple[int, dict[str, Any]]):
        status, body = result
        return json_response(body, status=status)

    @routes.get(SESSIONS_PATH)
    async def list_sessions(request):
        return json_response({"sessions": performances.names()})

    @routes.get(STATUS_PATH)
    async def session_status(request):
        return reply(status_for(request.match_info["name"]))

    @routes.post(KNOB_PATH)
    async def post_knob(request):
        try:
            body = await request.json()
        except ValueError:
            body = None
        return reply(set_knob(request.match_info["name"], body))


_register_lock = threading.Lock()


def register() -> bool:
    """The routes and the status publisher on ComfyUI's server, once per process: the V3 entry point and the V1
    classes both ask, and a second ask (or a second copy of this module) finds the routes there; -> whether they
    were added now."""
    from aiohttp import web
    from server import PromptServer

    server = PromptServer.instance
    with _register_lock:
        if any(getattr(route, "path", None) == SESSIONS_PATH for route in server.routes):
            return False
        add_routes(server.routes, web.json_response)
        server.add_on_prompt_handler(refuse_text_booleans)
        StatusPublisher(server.send_sync).start()
        return True
