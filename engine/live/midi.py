"""MIDI control: CC messages from a hardware controller (or any MIDI port) move knobs in the registry.

`MidiMapper` is the pure logic (mido messages in, `KnobChange`s out; no ports), `MidiInput` the thin I/O edge
that feeds it from a mido input port (python-rtmidi calls back on its own thread).

Rules a performer feels:
- Learn: `learn(knob)` arms the mapper; the next CC message maps its channel and controller to the knob.
  Channel-mode controllers 120..127 (all notes off, reset...) are never learned.
- Soft takeover (pickup): a control only moves a knob whose registry value is still the one this control last
  set. Otherwise (the knob was changed over OSC, by another control, reset, or this control never set it, which
  includes its first move right after learning) the control's values are ignored until it crosses the current
  value or comes within `takeover_window` (0..1 of the range) of it; from then on it follows. The sound never
  jumps by more than the window or the step that crossed it.
- 14-bit controllers (`high_resolution`): MSB on CC n (0..31), LSB on CC n+32; value = (msb << 7) | lsb of
  16383. Each message applies at once, so the rule is deterministic: the LSB applies `(latest msb << 7) | lsb`;
  an MSB applies `msb << 7` (the MIDI spec: a new MSB resets the LSB), except that a control that has never sent
  an LSB is treated as MSB-only and its MSB applies as msb / 127, so it still reaches both ends of the range.
  An LSB before any MSB is ignored.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .knobs import KnobChange, KnobError, KnobRegistry

if TYPE_CHECKING:
    import mido

log = logging.getLogger("flowjam.midi")

MAP_FILE_VERSION = 1
INSTALL_HINT = "pip install 'flowjam[midi]' (mido and python-rtmidi)"
JACK_BACKEND = "mido.backends.rtmidi/UNIX_JACK"
_CHANNEL_MODE_CCS = range(120, 128)
_LSB_OFFSET = 32


@dataclass(frozen=True)
class CCMapping:
    """One controller on one channel driving one knob. High resolution: MSB on `cc` (0..31), LSB on `cc + 32`."""

    knob: str
    channel: int  # 0..15 (mido numbering: MIDI channel 1 is 0)
    cc: int
    high_resolution: bool = False

    def __post_init__(self):
        for field_name, value, top in (("channel", self.channel, 15), ("cc", self.cc, 127)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
                raise ValueError(f"mapping of {self.knob!r}: {field_name} must be an integer 0..{top}, got {value!r}")
        if not isinstance(self.high_resolution, bool):
            raise ValueError(
                f"mapping of {self.knob!r}: high_resolution must be true or false, got {self.high_resolution!r}"
            )
        if self.high_resolution and self.cc >= _LSB_OFFSET:
            raise ValueError(
                f"mapping of {self.knob!r}: a 14-bit control has its MSB on CC 0..31 (LSB on CC+32), got CC {self.cc}"
            )

    @property
    def controls(self) -> tuple[tuple[int, int], ...]:
        """The (channel, cc) pairs this mapping listens to."""
        if self.high_resolution:
            return (self.channel, self.cc), (self.channel, self.cc + _LSB_OFFSET)
        return ((self.channel, self.cc),)


@dataclass(frozen=True)
class MidiStats:
    received: int = 0  # control-change messages handled (other message types are not counted)
    applied: int = 0  # of those, the ones that changed the registry
    ignored_takeover: int = 0  # held back because the control had not picked up the knob's value yet
    unmapped: int = 0  # no mapping for that channel and CC (and not learning)


@dataclass
class _Control:
    """What one mapped physical control has done: its last position and the registry value it last set."""

    mapping: CCMapping
    position: float | None = None  # 0..1, the last value the control sent (applied or not)
    last_set: float | None = None  # normalized registry value after this control's last write
    msb: int | None = None
    lsb_seen: bool = False


class MidiMapper:
    """Pure logic (no ports): mido messages in, knob changes out. Thread-safe: `handle` may run on a MIDI thread
    while another thread learns, saves or unmaps."""

    def __init__(self, registry: KnobRegistry, mappings: Iterable[CCMapping] = (), takeover_window: float = 0.03):
        if not 0.0 <= takeover_window <= 1.0:
            raise ValueError(f"takeover_window is a fraction of the knob's range (0..1), got {takeover_window}")
        self.registry = registry
        self.takeover_window = takeover_window
        self._lock = threading.RLock()
        self._controls: dict[str, _Control] = {}  # knob -> control, in mapping order
        self._by_cc: dict[tuple[int, int], _Control] = {}
        self._learning: tuple[str, bool] | None = None
        self._counts = dict.fromkeys(MidiStats.__dataclass_fields__, 0)
        for mapping in mappings:
            taken = [self._by_cc[key].mapping for key in mapping.controls if key in self._by_cc]
            if mapping.knob in self._controls or taken:
                clash = (
                    f"knob {mapping.knob!r} is mapped twice"
                    if mapping.knob in self._controls
                    else (f"channel {mapping.channel} CC {mapping.cc} is also used by {taken[0]}")
                )
                raise ValueError(f"conflicting MIDI mappings: {clash}")
            self.map(mapping)

    def map(self, mapping: CCMapping) -> None:
        """Add a mapping, replacing any earlier mapping of the same knob and of the same channel and CC(s)."""
        self.registry.normalized(mapping.knob)  # KnobError for unknown names
        with self._lock:
            self._remove(self._controls.get(mapping.knob))
            for key in mapping.controls:
                self._remove(self._by_cc.get(key))
            control = _Control(mapping)
            self._controls[mapping.knob] = control
            for key in mapping.controls:
                self._by_cc[key] = control

    def unmap(self, knob: str) -> bool:
        """Forget the knob's mapping; False if it had none."""
        self.registry.normalized(knob)
        with self._lock:
            control = self._controls.get(knob)
            self._remove(control)
            return control is not None

    def mappings(self) -> list[CCMapping]:
        with self._lock:
            return [control.mapping for control in self._controls.values()]

    def learn(self, knob: str, high_resolution: bool = False) -> None:
        """Map the next CC that arrives to `knob` (replacing earlier mappings of that knob and of that CC).
        High resolution learns only CCs 0..63: an MSB maps its own pair, an LSB (32..63) the pair of CC - 32."""
        self.registry.normalized(knob)
        with self._lock:
            self._learning = (knob, high_resolution)

    @property
    def learning(self) -> str | None:
        """The knob waiting for a control, if learning is armed."""
        with self._lock:
            return None if self._learning is None else self._learning[0]

    def cancel_learn(self) -> None:
        with self._lock:
            self._learning = None

    def stats(self) -> MidiStats:
        with self._lock:
            return MidiStats(**self._counts)

    def handle(self, message: mido.Message, sent_at: float | None = None) -> KnobChange | None:
        """Apply one message; returns the registry's change, or None when nothing moved (not a CC, unmapped, LSB
        before MSB, or held back by soft takeover)."""
        if getattr(message, "type", None) != "control_change":
            return None
        key = (message.channel, message.control)
        with self._lock:
            self._counts["received"] += 1
            if self._learning is not None:
                self._learn_from(key)
            control = self._by_cc.get(key)
            if control is None:
                self._counts["unmapped"] += 1
                return None
            position = self._position(control, message.control, message.value)
            if position is None:
                return None
            knob = control.mapping.knob
            current = self.registry.normalized(knob)
            if not self._has_pickup(control, position, current):
                control.position = position
                self._counts["ignored_takeover"] += 1
                return None
            change = self.registry.set_normalized(knob, position, origin="midi", sent_at=sent_at)
            control.position = position
            control.last_set = self.registry.specs[knob].to_normalized(change.value)
            self._counts["applied"] += 1
            return change

    def save(self, path: str | Path) -> Path:
        """Write the mappings as JSON ({"version": 1, "mappings": [...]}), replacing the file atomically."""
        path = Path(path)
        document = {"version": MAP_FILE_VERSION, "mappings": [asdict(mapping) for mapping in self.mappings()]}
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".partial")
        temporary.write_text(json.dumps(document, indent=2) + "\n")
        os.replace(temporary, path)
        return path

    @classmethod
    def load(cls, path: str | Path, registry: KnobRegistry, takeover_window: float = 0.03) -> MidiMapper:
        """A mapper with the mappings saved in `path`; errors name the file and the entry that is wrong."""
        path = Path(path)
        try:
            document = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"MIDI map file not found: {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise ValueError(f"MIDI map {path} is not valid JSON: {error}") from None
        if not isinstance(document, dict) or document.get("version") != MAP_FILE_VERSION:
            raise ValueError(
                f'MIDI map {path}: expected an object with "version": {MAP_FILE_VERSION}, as written by MidiMapper.save'
            )
        entries = document.get("mappings")
        if not isinstance(entries, list):
            raise ValueError(f'MIDI map {path}: "mappings" must be a list')
        mappings = []
        for index, entry in enumerate(entries):
            try:
                mappings.append(CCMapping(**entry))
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"MIDI map {path}, mapping {index}: {error}; expected "
                    '{"knob": NAME, "channel": 0-15, "cc": 0-127, "high_resolution": false}'
                ) from None
        try:
            return cls(registry, mappings, takeover_window)
        except KnobError as error:
            raise KnobError(f"MIDI map {path}: {error}", error.knob, error.reason) from None
        except ValueError as error:
            raise ValueError(f"MIDI map {path}: {error}") from None

    def _remove(self, control: _Control | None) -> None:
        if control is None:
            return
        del self._controls[control.mapping.knob]
        for key in control.mapping.controls:
            del self._by_cc[key]

    def _learn_from(self, key: tuple[int, int]) -> None:
        knob, high_resolution = self._learning
        channel, cc = key
        if cc in _CHANNEL_MODE_CCS or (high_resolution and cc >= 2 * _LSB_OFFSET):
            return
        self._learning = None
        self.map(CCMapping(knob, channel, cc % _LSB_OFFSET if high_resolution else cc, high_resolution))
        log.info("MIDI learn: %s <- channel %d CC %d%s", knob, channel, cc, " (14-bit)" if high_resolution else "")

    def _position(self, control: _Control, cc: int, value: int) -> float | None:
        """The control's 0..1 position after this message (see the module docstring for 14-bit)."""
        if not control.mapping.high_resolution:
            return value / 127
        if cc == control.mapping.cc:
            control.msb = value
            return (value << 7) / 16383 if control.lsb_seen else value / 127
        control.lsb_seen = True
        if control.msb is None:
            return None
        return ((control.msb << 7) | value) / 16383

    def _has_pickup(self, control: _Control, position: float, current: float) -> bool:
        if control.last_set is not None and math.isclose(current, control.last_set, rel_tol=0.0, abs_tol=1e-9):
            return True  # nothing else touched the knob since this control set it
        if abs(position - current) <= self.takeover_window:
            return True
        previous = control.position
        return previous is not None and min(previous, position) <= current <= max(previous, position)


class MidiInput:
    """A mido input port feeding a `MidiMapper`. `port_name` is an existing port (exact name, or a unique part of
    one; None = the first port), or with `virtual=True` the name of a new port other programs connect to.
    `backend` is a mido backend such as "mido.backends.rtmidi/UNIX_JACK" (None: mido's default, or $MIDO_BACKEND);
    `client_name` names the MIDI client of a virtual port (python-rtmidi backends only)."""

    def __init__(
        self,
        mapper: MidiMapper,
        port_name: str | None = None,
        backend: str | None = None,
        virtual: bool = False,
        client_name: str = "flowjam",
    ):
        self.mapper = mapper
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
        with self._lock:
            if self._port is not None:
                return self
            backend = _load_backend(self.backend)
            # mido's rtmidi backend opens a virtual port whenever it is given a client name
            extra = {"client_name": self.client_name} if self.virtual and "rtmidi" in backend.name else {}
            if self.virtual:
                name = self.port_name or "midi in"
            else:
                name = _resolve_port(self.port_name, _midi_call(backend, backend.get_input_names), backend)
            self._port = _midi_call(
                backend, partial(backend.open_input, name, virtual=self.virtual, callback=self._on_message, **extra)
            )
            log.info("MIDI input open: %s", self._port.name)
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

    def _on_message(self, message: mido.Message) -> None:
        try:
            self.mapper.handle(message)
        except Exception:
            self.errors += 1
            if self.errors == 1:  # a callback that raises must not flood the log at controller rates
                log.exception("MIDI message %s failed; further errors are counted in MidiInput.errors", message)


def list_ports(backend: str | None = None) -> list[str]:
    """The names of the MIDI input ports the backend sees."""
    mido_backend = _load_backend(backend)
    return list(_midi_call(mido_backend, mido_backend.get_input_names))


def _load_backend(backend: str | None) -> Any:
    try:
        import mido
    except ImportError as error:
        raise ImportError(f"MIDI needs mido: {INSTALL_HINT}") from error
    mido_backend = mido.Backend(backend)
    try:
        mido_backend.load()
    except ImportError as error:
        raise ImportError(f"MIDI backend {mido_backend.name!r} cannot be imported ({error}): {INSTALL_HINT}") from error
    return mido_backend


def _midi_call(backend: Any, call: Callable[[], Any]) -> Any:
    """Run a backend call; a missing MIDI system (no ALSA sequencer, no JACK server, unknown API) gets a hint."""
    try:
        return call()
    except (OSError, ValueError) as error:
        if "unknown port" in str(error).lower():  # the port vanished after it was listed
            raise
        api = f"/{backend.api}" if backend.api else ""
        raise RuntimeError(
            f"MIDI backend {backend.name}{api} is not usable here ({error}). Without an ALSA sequencer "
            f"(/dev/snd/seq), start a JACK server (jackd) and use backend={JACK_BACKEND!r}"
        ) from error


def _resolve_port(wanted: str | None, available: list[str], backend: Any) -> str:
    if not available:
        raise ValueError(
            f"no MIDI input ports found (backend {backend.name}); plug in a controller, "
            "or open a virtual port (virtual=True) and connect your controller to it"
        )
    if wanted is None:
        return available[0]
    if wanted in available:
        return wanted
    matches = [name for name in available if wanted.lower() in name.lower()]
    if len(matches) == 1:
        return matches[0]
    found = "matches several ports" if matches else "not found"
    raise ValueError(f"MIDI input port {wanted!r} {found}; available ports: {', '.join(matches or available)}")
