"""`flowjam live --plugin`: one engine for every plugin instance on the machine. One model and one ring
(live/shared_ticker.py): each instance plays a session of its own, a LiveApp in plugin mode on a lane of that ring,
with its own prompts, knobs, loop bars and control block. Instances ask for their sessions in the lobby
(live/plugin_lobby.py); a session is made when first asked for (the instance then gives it the prompts and knobs its
project saved, as to a single engine) and ended once no instance has held it and no host has played it for
GRACE_S. The `--session` session is made at start, keeps OSC and MIDI, and plays until the engine stops."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..engine.session import Session
from .app import LiveApp, LiveConfig
from .knobs import KnobRegistry
from .plugin_link import HOST_BLOCKS, control_name
from .plugin_lobby import Ask, Lobby
from .shared_ticker import SharedTicker

log = logging.getLogger("flowjam.plugin")
GRACE_S = 10.0  # a session no instance holds and no host plays ends after this
PROJECT_WAIT_S = 3.0  # a new session waits this long at most for its instance's prompts and knobs
RETRY_S = 10.0  # a session that could not be made (the ring full) is tried again after this
POLL_S = 0.1


def pick_session(asked: str, primary: str, held: set[str], existing: set[str]) -> str:
    """The session an ask gets: the name asked (a project's), or for "" (a new instance) the first that no live
    instance holds: `primary`, then track-2, track-3, ... (`primary`-2, ... where `primary` is not "default"),
    skipping sessions still in their grace period."""
    if asked:
        return asked
    if primary not in held:
        return primary
    stem = "track" if primary == "default" else primary
    number = 2
    while f"{stem}-{number}" in held | existing:
        number += 1
    return f"{stem}-{number}"


class PluginSessions:
    def __init__(
        self,
        session: Session,
        config: LiveConfig,
        knobs: Callable[[], KnobRegistry],
        grace_s: float = GRACE_S,
    ):
        """`config`: the `--session` session's (every other takes it without OSC and MIDI); `knobs()`: a new
        session's knob registry (the command line's values)."""
        self.session, self.config, self._knobs, self.grace_s = session, config, knobs, grace_s
        self.primary = config.session_name
        self.ticker = SharedTicker(session, backend=config.runner.backend)
        self._apps = {self.primary: LiveApp(session, config, knobs(), ticker=self.ticker)}
        self._lock = threading.Lock()
        self._held_at: dict[str, float] = {}  # a session's newest moment held by an instance or played by a host
        self._answered: dict[int, tuple[int, int]] = {}  # lobby row -> (owner's token, ask) answered
        self._given: dict[int, tuple[int, str]] = {}  # lobby row -> (owner's token, the session it was given)
        self.lobby: Lobby | None = None
        self._starting: set[str] = set()  # sessions being made
        self._failed_at: dict[str, float] = {}  # when a session could last not be made
        self.refused = 0  # sessions that could not be made (a bad name, a full ring)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def apps(self) -> dict[str, LiveApp]:
        with self._lock:
            return dict(self._apps)

    @property
    def primary_app(self) -> LiveApp:
        return self._apps[self.primary]

    def start(self) -> None:
        try:
            self.primary_app.start()
        except BaseException:  # it stopped what it started: nothing is left to stop
            self._apps.clear()
            raise
        self.lobby = Lobby()
        self.lobby.beat(time.monotonic_ns())
        self._thread = threading.Thread(target=self._serve, name="flowjam-plugin-lobby", daemon=True)
        self._thread.start()
        log.info("plugin lobby %s: every flowjam instance on this machine gets a session", self.lobby.name)

    def _serve(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as error:  # the sessions playing keep playing
                log.warning("plugin lobby: %s", error, exc_info=True)

    def poll(self) -> None:
        """One round: the lobby's heartbeat, every new ask answered, the sessions instances hold and the engine lacks
        made (on threads of their own: the lobby keeps beating meanwhile), and those nothing held for `grace_s`
        ended."""
        now_ns, now = time.monotonic_ns(), time.monotonic()
        self.lobby.beat(now_ns)
        asks = self.lobby.asks(now_ns)
        held = {self.lobby.granted(ask.row) for ask in asks if self._answered.get(ask.row) == (ask.token, ask.seq)}
        held.discard("")
        for ask in asks:
            if self._answered.get(ask.row) != (ask.token, ask.seq):
                held.add(self._answer(ask, held))
        held.discard("")
        apps = self.apps
        for name in held - set(apps) - self._starting:
            if now - self._failed_at.get(name, -RETRY_S) >= RETRY_S:
                self._starting.add(name)
                threading.Thread(target=self._make, args=(name,), name=f"flowjam-plugin-{name}", daemon=True).start()
        for name, app in apps.items():
            if name in held or app.playback.running:
                self._held_at[name] = now
            elif name != self.primary and now - self._held_at.get(name, now) > self.grace_s:
                threading.Thread(target=self.end, args=(name,), name=f"flowjam-end-{name}", daemon=True).start()

    def _answer(self, ask: Ask, held: set[str]) -> str:
        """Grant `ask` its session's name ("" for a name no session may have); the session is made next. An instance
        that asks for a new session again (a host resetting its state) gets back the one it had."""
        token, had = self._given.get(ask.row, (0, ""))
        if not ask.name and token == ask.token and had and had not in held:
            name = had
        else:
            name = pick_session(ask.name, self.primary, held, set(self.apps) | self._starting)
        try:
            control_name(name)
        except ValueError as error:
            self.refused += 1
            log.warning("plugin session refused: %s", error)
            name = ""
        self.lobby.grant(ask, name)
        self._answered[ask.row] = (ask.token, ask.seq)
        self._given[ask.row] = (ask.token, name)
        return name

    def _make(self, name: str) -> None:
        """Session `name` on a lane of the ring; a failure (the ring full) is logged and tried again later."""
        panel_port = None if self.config.panel_port is None else 0  # a port of its own: --panel-port is the first's
        config = replace(
            self.config,
            session_name=name,
            osc_port=None,
            midi_port=None,
            midi_map=None,
            midi_learn=(),
            panel_port=panel_port,
        )
        try:
            app = LiveApp(self.session, config, self._knobs(), ticker=self.ticker)
            app.start(lambda: self._await_project(app))  # a failed start stops what it started
        except Exception as error:  # this instance stays silent (connected 0), the others play on
            self.refused += 1
            self._failed_at[name] = time.monotonic()
            self._starting.discard(name)
            log.warning("plugin session %r could not start (tried again in %g s): %s", name, RETRY_S, error)
            return
        self._held_at[name] = time.monotonic()
        with self._lock:
            stopped = self._stop.is_set()  # the engine stopped meanwhile
            if not stopped:
                self._apps[name] = app
        self._starting.discard(name)
        if stopped:
            app.stop()
            return
        log.info("plugin session %s started (%d on the ring)", name, len(self._apps))

    def _await_project(self, app: LiveApp) -> None:
        """Give the instance that asked for the session up to PROJECT_WAIT_S to attach and play a block (its project's
        prompts and knobs), so that the first generation is already its own."""
        deadline = time.monotonic() + PROJECT_WAIT_S
        while app.playback.control.counters[HOST_BLOCKS] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(2 * POLL_S)  # the output's next round takes them in
        while app.runner.encoding and time.monotonic() < deadline:
            time.sleep(0.01)

    def end(self, name: str) -> None:
        """Stop session `name` and free its lane (its instance, if any comes back, asks again)."""
        with self._lock:
            app = self._apps.pop(name, None)
        if app is None:  # ended already
            return
        self._held_at.pop(name, None)
        app.stop()
        log.info("plugin session %s ended (%d on the ring)", name, len(self._apps))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
        for name in self.apps:
            self.end(name)
        if self.lobby is not None:
            self.lobby.unlink()
            self.lobby = None
        self.ticker.stop()

    def status_line(self) -> str:
        """The `--session` session's status line, then every session on the ring."""
        apps = self.apps
        each = ", ".join(f"{name} latents {app.runner.stats.latents}" for name, app in apps.items())
        return f"{self.primary_app.status_line()}  sessions {len(apps)} on one ring: {each}"
