"""HTTP routes on ComfyUI's own server for the live panel: read a stream's status, turn a knob (no re-queue)."""

from __future__ import annotations

import json


def register() -> None:
    """Add GET /flowjam/sessions, GET /flowjam/session/{name} and POST /flowjam/session/{name}/knob to ComfyUI."""
    from aiohttp import web
    from server import PromptServer

    from ..engine.live import sessions
    from ..engine.live.knobs import KnobError

    routes = PromptServer.instance.routes

    @routes.get("/flowjam/sessions")
    async def list_sessions(request):
        return web.json_response({"sessions": sessions.names()})

    @routes.get("/flowjam/session/{name}")
    async def session_status(request):
        app = sessions.get(request.match_info["name"])
        if app is None:
            return web.json_response({"error": "no such stream"}, status=404)
        status = app.status()
        status["specs"] = {
            n: {"min": s.minimum, "max": s.maximum, "kind": s.kind.value} for n, s in app.registry.specs.items()
        }
        status["loop_s"] = app.buffer.frames / app.buffer.sample_rate
        return web.json_response(json.loads(json.dumps(status, default=str)))

    @routes.post("/flowjam/session/{name}/knob")
    async def set_knob(request):
        app = sessions.get(request.match_info["name"])
        if app is None:
            return web.json_response({"error": "no such stream"}, status=404)
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return web.json_response({"error": 'send a JSON object {"name": <knob>, "value": <number>}'}, status=400)
        try:
            change = app.registry.set(str(body.get("name")), body.get("value"), origin="comfyui-panel")
        except KnobError as error:
            return web.json_response({"error": str(error)}, status=400)
        return web.json_response({"name": change.name, "value": change.value, "clamped": change.clamped})
