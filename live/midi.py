"""MIDI control: CC messages from a hardware controller (or any MIDI port) move knobs in the registry.

`MidiMapper` is the pure logic (mido messages in, `KnobChange`s out; no ports); `midi_port.MidiInput` is the thin
I/O edge that feeds it from a MIDI input port.

Rules a performer feels:
- Learn: `learn(*knobs)` arms the first knob; the next CC message maps its channel and controller to it. The next
  knob is armed only once that control is released: no message from it for `learn_release_s` (0.5 s). Messages
  from other controls meanwhile are not learned either, so a knob that is still turning can never be taken by the
  next knob, and the player moves one control per knob, in order. Channel-mode controllers 120..127 (all notes
  off, reset...) are never learned.
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
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.outputs import write_atomic
from .knobs import KnobChange, KnobError, KnobRegistry

if TYPE_CHECKING:
    import mido

log = logging.getLogger("flowjam.midi")

MAP_FILE_VERSION = 1
_CHANNEL_MODE_CCS = range(120, 128)
_LSB_OFFSET = 32


class MidiError(ValueError):
    """MIDI cannot start as configured (no MIDI system, no such port); the message says what to change."""


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

    def __init__(
        self,
        registry: KnobRegistry,
        mappings: Iterable[CCMapping] = (),
        takeover_window: float = 0.03,
        learn_release_s: float = 0.5,
    ):
        if not 0.0 <= takeover_window <= 1.0:
            raise ValueError(f"takeover_window is a fraction of the knob's range (0..1), got {takeover_window}")
        if learn_release_s < 0:
            raise ValueError(f"learn_release_s must be >= 0, got {learn_release_s}")
        self.registry = registry
        self.takeover_window = takeover_window
        self.learn_release_s = learn_release_s
        self._lock = threading.RLock()
        self._learn_changed = threading.Condition(self._lock)
        self._controls: dict[str, _Control] = {}  # knob -> control, in mapping order
        self._by_cc: dict[tuple[int, int], _Control] = {}
        self._learn_queue: list[str] = []  # knobs still to learn; the first is armed unless a control is held
        self._learn_high_resolution = False
        self._held: _Control | None = None  # the control learned last, until it is released
        self._held_at_s = 0.0  # monotonic time of the held control's latest message
        self._watching_release = False
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

    def learn(self, *knobs: str, high_resolution: bool = False) -> None:
        """Map the next CC that arrives to the first knob, then each further knob to the next control moved after
        the previous one was released (see the module docstring); replaces any learning in progress and earlier
        mappings of those knobs and CCs. High resolution learns only CCs 0..63: an MSB maps its own pair, an LSB
        (32..63) the pair of CC - 32."""
        if not knobs:
            raise ValueError("name at least one knob to learn")
        for knob in knobs:
            self.registry.normalized(knob)  # KnobError for unknown names
        twice = sorted({knob for knob in knobs if knobs.count(knob) > 1})
        if twice:
            raise ValueError(f"MIDI learn lists {', '.join(map(repr, twice))} more than once; name each knob once")
        with self._lock:
            self._learn_queue = list(knobs)
            self._learn_high_resolution = high_resolution
            self._held = None
            self._learn_changed.notify_all()
            log.warning("MIDI learn: move the control for %r", knobs[0])

    @property
    def learning(self) -> str | None:
        """The knob the next control moved will be mapped to (None: not learning, or waiting for a release)."""
        with self._lock:
            self._release_if_due(time.monotonic())
            return self._learn_queue[0] if self._learn_queue and self._held is None else None

    @property
    def learn_queue(self) -> tuple[str, ...]:
        """The knobs still to learn, in order; the first is armed once the control learned last is released."""
        with self._lock:
            return tuple(self._learn_queue)

    def cancel_learn(self) -> None:
        with self._lock:
            self._learn_queue = []
            self._held = None
            self._learn_changed.notify_all()

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
            if self._learn_queue:
                self._learn_from(key, time.monotonic())
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
        write_atomic(path, (json.dumps(document, indent=2) + "\n").encode())
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

    def _learn_from(self, key: tuple[int, int], now_s: float) -> None:
        self._release_if_due(now_s)
        if self._held is not None:
            if key in self._held.mapping.controls:
                self._held_at_s = now_s  # still moving: the next knob waits
            return
        channel, cc = key
        high_resolution = self._learn_high_resolution
        if cc in _CHANNEL_MODE_CCS or (high_resolution and cc >= 2 * _LSB_OFFSET):
            return
        knob = self._learn_queue.pop(0)
        self.map(CCMapping(knob, channel, cc % _LSB_OFFSET if high_resolution else cc, high_resolution))
        following = f"; release it to arm {self._learn_queue[0]!r}" if self._learn_queue else ""
        log.warning(
            "MIDI learn: %s <- channel %d CC %d%s%s",
            knob,
            channel,
            cc,
            " (14-bit)" if high_resolution else "",
            following,
        )
        if self._learn_queue:
            self._held, self._held_at_s = self._controls[knob], now_s
            if not self._watching_release:
                self._watching_release = True
                threading.Thread(target=self._watch_release, name="flowjam-midi-learn", daemon=True).start()

    def _release_if_due(self, now_s: float) -> None:
        """Arm the next knob once the held control has been still for `learn_release_s` (caller holds the lock)."""
        if self._held is not None and now_s - self._held_at_s >= self.learn_release_s:
            self._held = None
            if self._learn_queue:
                log.warning("MIDI learn: move the control for %r", self._learn_queue[0])

    def _watch_release(self) -> None:
        """Arms the next knob on time (and says so) even when no message arrives, independent of any polling."""
        with self._learn_changed:
            while self._held is not None:
                self._learn_changed.wait(self._held_at_s + self.learn_release_s - time.monotonic())
                self._release_if_due(time.monotonic())
            self._watching_release = False

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
