"""The process-wide registry of live sessions, keyed by name, so a ComfyUI graph re-queued with new values
updates the running session instead of starting another (node instances come and go; sessions stay)."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable

from .app import LiveApp

_sessions: dict[str, LiveApp] = {}
_lock = threading.Lock()


def get(name: str) -> LiveApp | None:
    with _lock:
        return _sessions.get(name)


def names() -> list[str]:
    with _lock:
        return sorted(_sessions)


def start_or_get(name: str, create: Callable[[], LiveApp]) -> tuple[LiveApp, bool]:
    """The running session called `name`, or a new one made by `create()` and started; -> (app, created)."""
    with _lock:
        app = _sessions.get(name)
        if app is not None and app.runner.alive:
            return app, False
        app = create()
        app.start()
        _sessions[name] = app
        return app, True


def stop(name: str) -> bool:
    """Stop and forget a session; False if there was none."""
    with _lock:
        app = _sessions.pop(name, None)
    if app is None:
        return False
    app.stop()
    return True


def stop_all() -> None:
    for name in names():
        stop(name)


atexit.register(stop_all)
