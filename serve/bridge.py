"""`flowjam bridge`: a controller on this machine plays a session on a server. OSC (and MIDI) write a local mirror of
the session's knobs, exactly as they write a live performance's registry (same addresses, clamping, feedback,
soft takeover); every change of the mirror is forwarded to the server. The mirror starts at the session's current
values, so faders pick up where the session is.

Forwarding runs on a thread of its own and coalesces: the latest value of each knob wins and all knobs that moved
since the last call go in one request, so a fader flood costs a few requests, never a queue. A refusal or an
unreachable server is shown on stderr and the bridge keeps going."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..engine.params import LORA_KNOB_PREFIX, lora_knob
from ..live.knobs import KnobChange, KnobRegistry
from ..live.osc import OscBridge, OscConfig
from .client import Client, ServerError

log = logging.getLogger("flowjam.bridge")

REPEAT_ERROR_S = 5.0  # the same error is shown again at most this often
FOLLOW_S = 1.0  # how often the mirror takes in knob changes other clients made on the server


class Forwarder:
    """Sends knob changes and prompts to the server from its own thread (latest value per knob and per prompt slot
    wins while a request is on its way)."""

    def __init__(self, client: Client, session: str, on_error: Callable[[str], None]):
        self.client, self.session = client, session
        self._on_error = on_error
        self._ready = threading.Condition()
        self._knobs: dict[str, float | str] = {}
        self._prompts: dict[str, str] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_error = ("", 0.0)
        self.requests = 0
        self.failures = 0

    def knob(self, name: str, value: float | str) -> None:
        with self._ready:
            self._knobs[name] = value
            self._ready.notify()

    def prompt(self, slot: str, text: str) -> None:
        with self._ready:
            self._prompts[slot] = text
            self._ready.notify()

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="flowjam-bridge-forward", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Send what is still waiting, then end the thread."""
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._ready:
                while not (self._knobs or self._prompts or self._stopping):
                    self._ready.wait()
                knobs, prompts = self._knobs, self._prompts
                self._knobs, self._prompts = {}, {}
                stopping = self._stopping
            for slot, text in prompts.items():
                self._send(f"prompt {slot}", self.client.set_prompt, self.session, slot, text)
            if knobs:
                self._send(", ".join(knobs), self.client.set_knobs, self.session, knobs)
            if stopping:
                return

    def _send(self, what: str, call: Callable, *args) -> None:
        """Make one request; `requests` and `failures` count it once the server has answered (or failed to)."""
        try:
            call(*args)
        except Exception as error:  # the server's refusal or an outage: say so, keep bridging
            self.failures += 1
            message = f"the server did not take {what}: {error}"
            last, shown_at = self._last_error
            if message != last or time.monotonic() - shown_at > REPEAT_ERROR_S:
                self._last_error = (message, time.monotonic())
                self._on_error(message)
        finally:
            self.requests += 1


class Bridge:
    """The mirror, its forwarder and the controllers on it; start() reads the session's knobs first. An OSC `status`
    query is answered with the server's status (the OSC receive thread waits for it)."""

    def __init__(
        self,
        client: Client,
        session: str,
        osc: OscConfig | None,
        on_error: Callable[[str], None] | None = None,
    ):
        self.client, self.session = client, session
        self.registry = KnobRegistry()
        self.forwarder = Forwarder(client, session, on_error or _print_error)
        self.osc = (
            None
            if osc is None
            else OscBridge(
                self.registry,
                osc,
                on_prompt=self.forwarder.prompt,
                on_transport=self._transport,
                status=lambda: self.client.status(self.session),
            )
        )
        self.midi = None
        self.mapper = None
        self._midi_map: Path | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._on_error = on_error or _print_error
        self._local_at = 0.0  # when a controller here last moved a knob (monotonic)
        self._stop_following = threading.Event()
        self._follower: threading.Thread | None = None

    def enable_midi(
        self, port: str | None, map_path: Path | None = None, learn: tuple[str, ...] = (), backend: str | None = None
    ) -> None:
        """Play the mirror from a MIDI input too: `map_path` loaded if it exists (and saved on stop), `learn` knobs
        mapped to the next controls moved, in order (see midi.py)."""
        from ..live.midi import MidiMapper
        from ..live.midi_port import MidiInput

        existing = map_path is not None and Path(map_path).is_file()
        self.mapper = MidiMapper.load(map_path, self.registry) if existing else MidiMapper(self.registry)
        if learn:
            self.mapper.learn(*learn)
        self._midi_map = map_path
        self.midi = MidiInput(self.mapper, port_name=port, backend=backend)

    def start(self) -> dict:
        """Mirror the session's current knobs, then forward every change and open the controllers -> its status."""
        status = self.client.status(self.session)
        unknown = []
        for name, value in status.get("knobs", {}).items():
            if name.startswith(LORA_KNOB_PREFIX) and name not in self.registry.specs:
                self.registry.add(lora_knob(name[len(LORA_KNOB_PREFIX) :]))  # a LoRA the server loaded
            if name in self.registry.specs:
                self.registry.set(name, value, origin="server")
            else:
                unknown.append(name)
        if unknown:
            log.warning("the server has knobs this bridge does not know (a newer flowjam?): %s", ", ".join(unknown))
        self._unsubscribe = self.registry.subscribe(self._forward)
        self.forwarder.start()
        self._stop_following.clear()
        self._follower = threading.Thread(target=self._follow, name="flowjam-bridge-follow", daemon=True)
        self._follower.start()
        try:
            if self.midi is not None:
                self.midi.start()
            if self.osc is not None:
                self.osc.start()
        except BaseException:
            self.stop()
            raise
        return status

    def stop(self) -> None:
        """Close the controllers, send what is still waiting, save a MIDI map. Safe to call twice."""
        for part in (self.midi, self.osc):
            if part is not None:
                part.stop()
        self._stop_following.set()
        if self._follower is not None:
            self._follower.join()
            self._follower = None
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
            self.forwarder.stop()
        if self.midi is not None and self._midi_map is not None:
            self.mapper.save(self._midi_map)

    def __enter__(self) -> Bridge:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _forward(self, change: KnobChange) -> None:
        """Registry subscriber: forwards the knob's value as it is now (callbacks from the OSC and MIDI threads may
        arrive out of order; the registry holds the newest), a choice by its name; what came from the server stays."""
        if change.origin == "server":
            return
        self._local_at = time.monotonic()
        spec = self.registry.specs[change.name]
        value = self.registry.get(change.name)
        self.forwarder.knob(change.name, spec.choice(value) if spec.choices else value)

    def _follow(self) -> None:
        """Every FOLLOW_S, take the knobs another client moved on the server into the mirror (the OSC feedback then
        shows them on the controller); skipped while a change from here may still be on its way."""
        while not self._stop_following.wait(FOLLOW_S):
            if time.monotonic() - self._local_at < 2 * FOLLOW_S:
                continue
            try:
                knobs = self.client.status(self.session).get("knobs", {})
            except (ServerError, OSError) as error:
                self._on_error(f"following the session's knobs: {error}")
                continue
            for name, value in knobs.items():
                spec = self.registry.specs.get(name)
                if spec is None:
                    continue
                mine = self.registry.get(name)
                if (spec.choice(mine) != value) if spec.choices else abs(mine - float(value)) > 1e-9:
                    self.registry.set(name, value, origin="server")

    def _transport(self, command: str) -> None:
        if command != "reset":
            raise ValueError(
                f"transport {command} is not served remotely: start or stop `flowjam listen` (or move the volume knob)"
            )
        self.registry.reset()


def _print_error(message: str) -> None:
    print(f"flowjam bridge: {message}", file=sys.stderr, flush=True)
