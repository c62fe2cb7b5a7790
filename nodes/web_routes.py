"""HTTP routes on ComfyUI's own server for the live panel: read a stream's status, turn a knob (no re-queue).

The handler logic is two plain functions, `status_for` and `set_knob` -> (HTTP status, JSON-ready dict), so it is
tested without ComfyUI or aiohttp; `register()` only wraps them in aiohttp handlers."""

from __future__ import annotations

import json
from typing import Any

from ..engine.params import KNOB_SPECS, KnobSpec
from ..live import performances
from ..live.knobs import KnobError

KNOB_BODY = '{"name": <knob>, "value": <number, or a choice name for cfg_mode>}'


def spec_json(spec: KnobSpec) -> dict[str, Any]:
    return {
        "min": spec.minimum,
        "max": spec.maximum,
        "default": spec.default,
        "kind": spec.kind.value,
        "integer": spec.integer,
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


def status_for(name: str) -> tuple[int, dict[str, Any]]:
    """GET /flowjam/session/{name}: always 200 (a panel polls before its stream exists and after it stops);
    `running` says whether the stream plays, `specs` carries every knob's range either way."""
    app = performances.get(name)
    if app is None:
        return 200, {"name": name, "running": False, "specs": SPECS_JSON, "sessions": performances.names()}
    status = app.status()
    status.update(
        name=name,
        running=app.runner.alive,
        specs={spec.name: spec_json(spec) for spec in app.registry.specs.values()},
        curves=curve_driven(app),
        loop_s=app.buffer.frames / app.buffer.sample_rate,
    )
    return 200, json.loads(json.dumps(status, default=str))


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


def register() -> None:
    """Add GET /flowjam/sessions, GET /flowjam/session/{name} and POST /flowjam/session/{name}/knob to ComfyUI."""
    from aiohttp import web
    from server import PromptServer

    routes = PromptServer.instance.routes

    def reply(result: tuple[int, dict[str, Any]]):
        status, body = result
        return web.json_response(body, status=status)

    @routes.get("/flowjam/sessions")
    async def list_sessions(request):
        return web.json_response({"sessions": performances.names()})

    @routes.get("/flowjam/session/{name}")
    async def session_status(request):
        return reply(status_for(request.match_info["name"]))

    @routes.post("/flowjam/session/{name}/knob")
    async def post_knob(request):
        try:
            body = await request.json()
        except ValueError:
            body = None
        return reply(set_knob(request.match_info["name"], body))
