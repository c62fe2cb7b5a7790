"""MIDI ports: `MidiInput` feeds a `MidiMapper` (live/midi.py) from a MIDI input port (python-rtmidi calls back on its
own thread). Ports open through python-rtmidi directly, so the MIDI client is named "flowjam" (mido names it "RtMidiIn
Client" unless the port is virtual); a missing MIDI system or port is one `MidiError` (a ValueError) that names
`--midi-backend`."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .midi import MidiError, MidiMapper
from .sync.clock import now_s
from .sync.midi_clock import CLOCK_MESSAGES, MidiClockFollower

if TYPE_CHECKING:
    import mido

log = logging.getLogger("flowjam.midi")

INSTALL_HINT = "pip install 'flowjam[midi]' (mido and python-rtmidi)"
JACK_BACKEND = "mido.backends.rtmidi/UNIX_JACK"
MIDI_BACKENDS = {"alsa": "mido.backends.rtmidi/LINUX_ALSA", "jack": JACK_BACKEND}  # --midi-backend choices
JACK_HINT = "use --midi-backend jack with a running JACK server (jackd, or PipeWire's JACK)"
JACK_SERVER_HINT = "--midi-backend jack needs a running JACK server: start jackd (or PipeWire's JACK)"
ALSA_SEQUENCER = Path("/dev/snd/seq")


class MidiInput:
    """A MIDI input port feeding a `MidiMapper`. `port_name` is an existing port (exact name, or a unique part of
    one; None = the first port), or with `virtual=True` the name of a new port other programs connect to.
    `backend`: "alsa", "jack" (keys of `MIDI_BACKENDS`) or a mido backend name such as "mido.backends.portmidi";
    None: mido's default, or $MIDO_BACKEND. With python-rtmidi (the default) the MIDI client is `client_name`, so
    JACK and aconnect show "flowjam:midi in"; other backends open through mido and name their own client."""

    def __init__(
        self,
        mapper: MidiMapper,
        port_name: str | None = None,
        backend: str | None = None,
        virtual: bool = False,
        client_name: str = "flowjam",
        clock: MidiClockFollower | None = None,
    ):
        """`clock`: follow the port's MIDI clock too (its real-time messages go there, the rest to the mapper)."""
        self.mapper = mapper
        self.clock = clock
        self.port_name = port_name
        self.backend = backend
        self.virtual = virtual
        self.client_name = client_name
        self.errors = 0  # exceptions raised while handling a message (the first one is logged)
        self._port = None
        self._lock = threading.Lock()

    @property
    def name(self) -> str | None:
        """The name of the open port (None when stopped)."""
        return None if self._port is None else self._port.name

    def start(self) -> MidiInput:
        """Open the port; `MidiError` (a ValueError) when the MIDI system or the port is missing."""
        with self._lock:
            if self._port is None:
                self._port = _open_input(
                    self.port_name,
                    self.backend,
                    self.virtual,
                    self.client_name,
                    self._on_message,
                    self.clock is not None,
                )
                log.info("MIDI input open: %s (client %s)", self._port.name, self.client_name)
            return self

    def stop(self) -> None:
        """Close the port; safe to call twice or before start."""
        with self._lock:
            port, self._port = self._port, None
        if port is not None:
            port.close()

    def __enter__(self) -> MidiInput:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _on_message(self, message: mido.Message, at_s: float | None = None) -> None:
        """`at_s`: when the message arrived (now_s's clock; None: now)."""
        try:
            if self.clock is not None and message.type in CLOCK_MESSAGES:
                at_s = now_s() if at_s is None else at_s
                self.clock.handle(message.type, at_s, getattr(message, "pos", None))
            else:
                self.mapper.handle(message)
        except Exception:
            self.errors += 1
            if self.errors == 1:  # a callback that raises must not flood the log at controller rates
                log.exception("MIDI message %s failed; further errors are counted in MidiInput.errors", message)


def list_ports(backend: str | None = None) -> list[str]:
    """The names of the MIDI input ports the backend sees (`MidiInput` for `backend`)."""
    mido_backend = _load_backend(backend)
    if not _is_rtmidi(mido_backend):
        return _mido_call(mido_backend, mido_backend.get_input_names)
    client = _rtmidi_client(mido_backend, "flowjam")
    try:
        return _rtmidi_call(mido_backend, client.get_ports)
    finally:
        client.delete()


def find_input_port(port_name: str | None = None, backend: str | None = None) -> str:
    """The existing port `MidiInput(port_name=..., backend=...)` would open; `MidiError` in one line when the MIDI
    system or the port is missing, so a caller can fail before slow work (loading a model)."""
    return _resolve_port(port_name, list_ports(backend), _label(_load_backend(backend)))


POLL_S = 0.001  # how often the reader thread empties python-rtmidi's queue (1 ms: well under a MIDI clock pulse)


class _RtMidiPort:
    """An open python-rtmidi input read by our own thread. No rtmidi callback: JACK's process thread (and ALSA's
    reader) would then wait for the GIL inside the callback while `close_port` (which holds the GIL) waits for that
    thread to finish its cycle, a deadlock seen when a port closed under a stream of messages. Queued messages carry
    the time since the previous one; those read in one poll are dated back by it, the last one is now."""

    def __init__(self, name: str, client: Any, on_event: Callable[[list[int], float], None]):
        self.name = name
        self.client = client
        self._on_event = on_event
        self._stop = threading.Event()
        self._last_s = float("-inf")
        self._reader = threading.Thread(target=self._read, name=f"flowjam midi {name}", daemon=True)
        self._reader.start()

    def close(self) -> None:
        self._stop.set()
        if self._reader is not threading.current_thread():
            self._reader.join()
        self.client.close_port()
        self.client.delete()

    def _read(self) -> None:
        while not self._stop.wait(POLL_S):
            batch = []
            while (event := self.client.get_message()) is not None:
                batch.append(event)
            if batch:
                self._deliver(batch, now_s())

    def _deliver(self, batch: list[tuple[list[int], float]], read_s: float) -> None:
        for (data, _), at_s in zip(batch, arrival_times(batch, read_s, self._last_s), strict=True):
            self._last_s = at_s
            self._on_event(data, at_s)


def arrival_times(batch: list[tuple[list[int], float]], read_s: float, last_s: float) -> list[float]:
    """When each (message, delta) of one read arrived: the last one at `read_s`, each before it earlier by the delta
    (the gap after its predecessor) of the one after it; never before `last_s` (the previous read's last)."""
    times, at_s = [], read_s
    for _, delta_s in reversed(batch):
        times.append(at_s)
        at_s -= max(delta_s, 0.0)
    return list(itertools.accumulate(reversed(times), max, initial=last_s))[1:]


def _open_input(
    wanted: str | None,
    backend: str | None,
    virtual: bool,
    client_name: str,
    on_message: Callable[..., None],
    clock: bool = False,
) -> Any:
    """An open port (`.name`, `.close()`) that calls `on_message(message, at_s)` with each message from its own
    thread (mido's backends: `on_message(message)`); the MIDI clock's messages (24 a beat) only with `clock`."""
    mido_backend = _load_backend(backend)
    label = _label(mido_backend)
    if not _is_rtmidi(mido_backend):
        name = (wanted or "midi in") if virtual else _resolve_port(wanted, list_ports(backend), label)
        return _mido_call(mido_backend, lambda: mido_backend.open_input(name, virtual=virtual, callback=on_message))
    # mido's own rtmidi ports name their client only when virtual ("RtMidiIn Client" otherwise): open it here
    from mido import Message

    def on_event(data: list[int], at_s: float) -> None:
        try:
            message = Message.from_bytes(data)
        except ValueError:  # a malformed message from the wire
            return
        on_message(message, at_s)

    client = _rtmidi_client(mido_backend, client_name)
    try:
        client.ignore_types(sysex=True, timing=not clock, active_sense=True)  # no clock at 24 ppqn unless followed
        if virtual:
            name = wanted or "midi in"
            _rtmidi_call(mido_backend, lambda: client.open_virtual_port(name))
        else:
            available = _rtmidi_call(mido_backend, client.get_ports)
            name = _resolve_port(wanted, available, label)
            _rtmidi_call(mido_backend, lambda: client.open_port(available.index(name), "midi in"))
    except BaseException:
        client.delete()
        raise
    return _RtMidiPort(name, client, on_event)


def _load_backend(backend: str | None) -> Any:
    try:
        import mido
    except ImportError as error:
        raise MidiError(f"MIDI needs mido: {INSTALL_HINT}") from error
    return mido.Backend(MIDI_BACKENDS.get(backend, backend))


def _is_rtmidi(backend: Any) -> bool:
    return backend.name == "mido.backends.rtmidi"


def _label(backend: Any) -> str:
    """How the user names the backend: "jack", "alsa", or mido's name (with its API)."""
    full = f"{backend.name}/{backend.api}" if backend.api else backend.name
    return next((alias for alias, name in MIDI_BACKENDS.items() if name == full), full)


def _rtmidi_client(backend: Any, client_name: str) -> Any:
    """A python-rtmidi input client of the backend's API. A missing ALSA sequencer is caught before rtmidi tries to
    open it; other failures (no JACK server) become one `MidiError` with the library's own chatter kept off stderr."""
    try:
        import rtmidi
    except ImportError as error:
        raise MidiError(f"MIDI backend {_label(backend)!r} needs python-rtmidi: {INSTALL_HINT}") from error
    compiled = rtmidi.get_compiled_api()
    api = rtmidi.API_UNSPECIFIED if backend.api is None else getattr(rtmidi, f"API_{backend.api}", None)
    if api != rtmidi.API_UNSPECIFIED and api not in compiled:
        names = ", ".join(rtmidi.get_api_name(each) for each in compiled)
        raise MidiError(
            f"MIDI backend {_label(backend)!r} is not available (python-rtmidi here has: {names}); {_hint(backend)}"
        )
    alsa_first = api == rtmidi.API_LINUX_ALSA or (api == rtmidi.API_UNSPECIFIED and rtmidi.API_LINUX_ALSA in compiled)
    if sys.platform.startswith("linux") and alsa_first and not ALSA_SEQUENCER.exists():
        raise MidiError(
            f"MIDI backend {_label(backend)!r} needs the ALSA sequencer and this machine has none "
            f"({ALSA_SEQUENCER} is missing); {JACK_HINT}"
        )
    return _rtmidi_call(backend, lambda: _with_native_stderr_captured(lambda: rtmidi.MidiIn(api, client_name)))


def _rtmidi_call(backend: Any, call: Callable[[], Any]) -> Any:
    import rtmidi

    try:
        return call()
    except rtmidi.RtMidiError as error:
        raise MidiError(f"MIDI backend {_label(backend)!r} failed: {error}; {_hint(backend)}") from None


def _mido_call(backend: Any, call: Callable[[], Any]) -> Any:
    try:
        backend.load()
    except ImportError as error:
        raise MidiError(f"MIDI backend {backend.name!r} cannot be imported ({error}): {INSTALL_HINT}") from error
    try:
        return call()
    except OSError as error:
        raise MidiError(f"MIDI backend {_label(backend)!r} failed: {error}; {_hint(backend)}") from None


def _hint(backend: Any) -> str:
    return JACK_SERVER_HINT if _label(backend) == "jack" else JACK_HINT


def _with_native_stderr_captured(call: Callable[[], Any]) -> Any:
    """Run `call` with file descriptor 2 captured: ALSA and JACK print their failures there themselves, beside the
    exception that becomes one clear line. On failure the text goes to the debug log, on success back to stderr."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr at all
        return call()
    with tempfile.TemporaryFile() as captured:
        sys.stderr.flush()
        os.dup2(captured.fileno(), 2)
        failed = True
        try:
            result = call()
            failed = False
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read()
            if failed and text:
                log.debug("MIDI library output: %s", text.decode(errors="replace").strip())
            elif text:
                os.write(2, text)
    return result


def _resolve_port(wanted: str | None, available: list[str], label: str) -> str:
    if not available:
        raise MidiError(
            f"no MIDI input ports found (MIDI backend {label!r}): connect a controller "
            "(--midi-backend alsa or jack chooses another MIDI system)"
        )
    if wanted is None:
        return available[0]
    if wanted in available:
        return wanted
    matches = [name for name in available if wanted.lower() in name.lower()]
    if len(matches) == 1:
        return matches[0]
    found = "matches several ports" if matches else "not found"
    raise MidiError(
        f"MIDI input port {wanted!r} {found}; available ports: {', '.join(matches or available)} "
        f"(MIDI backend {label!r}; --midi-backend alsa or jack chooses another MIDI system)"
    )
