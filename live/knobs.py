"""The knob registry: one table of playable parameters that OSC, MIDI, ComfyUI and the CLI all write and read.

Every write is validated (a finite number for a known knob), clamped to the knob's range, stamped with a sequence
number and kept as the knob's latest `KnobChange`. Readers either poll (`changes_since(seq)`: the latest change of
each knob since a sequence number, which is what a runner picks up once per tick) or subscribe (a callback per
change, for feedback to controllers). Pure Python on purpose: the I/O edges import it without torch.
"""

from __future__ import annotations

import difflib
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from numbers import Real
from types import MappingProxyType

from ..engine.params import KNOB_SPECS, KnobSpec

log = logging.getLogger("flowjam.knobs")


@dataclass(frozen=True)
class KnobChange:
    name: str
    value: float  # what the knob now holds (clamped, rounded)
    requested: float  # what the caller asked for, in knob units (set_normalized: the unit value mapped, unclamped)
    clamped: bool  # requested was outside the range
    origin: str  # "osc", "midi", "api", "reset", ...
    seq: int
    received_at: float  # time.perf_counter() when set() ran
    sent_at: float | None = None  # the sender's timestamp if known (perf_counter domain), for latency measurement


class KnobError(ValueError):
    """A rejected write. `knob` is the name asked for, `reason` one of "unknown_knob", "not_a_number",
    "not_finite" (the OSC bridge counts rejections by it)."""

    def __init__(self, message: str, knob: str, reason: str):
        super().__init__(message)
        self.knob = knob
        self.reason = reason

    def __reduce__(self):  # crosses process boundaries (a Ray replica's error reaches the gateway whole)
        return type(self), (str(self), self.knob, self.reason)


class KnobRegistry:
    """Thread-safe knob values; the latest write wins.

    Subscribers run on the setter's thread after the lock is released, so callbacks from different threads may
    arrive out of order: compare `change.seq` to keep the newest."""

    def __init__(self, specs: Iterable[KnobSpec] = KNOB_SPECS):
        specs = tuple(specs)
        self.specs: Mapping[str, KnobSpec] = MappingProxyType({spec.name: spec for spec in specs})
        if len(self.specs) != len(specs):
            raise ValueError("knob names must be unique")
        self._lock = threading.Lock()
        self._values = {name: spec.clamp(spec.default) for name, spec in self.specs.items()}
        self._latest: dict[str, KnobChange] = {}
        self._seq = 0
        self._subscribers: tuple[Callable[[KnobChange], None], ...] = ()
        self._failed_subscribers: set[int] = set()

    def add(self, spec: KnobSpec) -> None:
        """A knob that comes with something loaded at run time (a LoRA's strength); at its default until set."""
        with self._lock:
            if spec.name in self.specs:
                raise ValueError(f"knob {spec.name!r} exists already")
            self.specs = MappingProxyType({**self.specs, spec.name: spec})
            self._values[spec.name] = spec.clamp(spec.default)

    def set(self, name: str, value: float | str, origin: str = "api", sent_at: float | None = None) -> KnobChange:
        """Set in the knob's own units; a choice knob also takes the name of a choice ("full")."""
        spec = self._spec(name)
        if isinstance(value, str) and spec.choices:
            try:
                requested = spec.index_of(value.strip())
            except ValueError as error:
                raise KnobError(str(error), name, "unknown_choice") from None
        else:
            requested = _finite_number(name, value)
        return self._apply(spec, requested, origin, sent_at)

    def set_normalized(
        self, name: str, unit_value: float, origin: str = "api", sent_at: float | None = None
    ) -> KnobChange:
        """Set from a 0..1 controller value; values outside 0..1 are clamped to the range's ends."""
        spec = self._spec(name)
        requested = spec.unclamped(_finite_number(name, unit_value))
        return self._apply(spec, requested, origin, sent_at)

    def get(self, name: str) -> float:
        self._spec(name)
        with self._lock:
            return self._values[name]

    def normalized(self, name: str) -> float:
        return self._spec(name).to_normalized(self.get(name))

    def values(self) -> dict[str, float]:
        with self._lock:
            return dict(self._values)

    def changes_since(self, seq: int) -> list[KnobChange]:
        """The latest change of each knob whose seq is above `seq`, oldest first."""
        with self._lock:
            changes = [change for change in self._latest.values() if change.seq > seq]
        return sorted(changes, key=lambda change: change.seq)

    @property
    def seq(self) -> int:
        """The last issued sequence number (0 = nothing set yet)."""
        with self._lock:
            return self._seq

    def subscribe(self, callback: Callable[[KnobChange], None]) -> Callable[[], None]:
        """Call `callback(change)` after every write; returns a function that unsubscribes (safe to call twice)."""
        with self._lock:
            self._subscribers += (callback,)

        def unsubscribe() -> None:
            with self._lock:
                self._subscribers = tuple(s for s in self._subscribers if s is not callback)

        return unsubscribe

    def reset(self, name: str | None = None) -> None:
        """Set one knob, or every knob, back to its default (origin "reset")."""
        names = [name] if name is not None else list(self.specs)
        for knob in names:
            spec = self._spec(knob)
            self._apply(spec, spec.default, "reset", None)

    def _apply(self, spec: KnobSpec, requested: float, origin: str, sent_at: float | None) -> KnobChange:
        value = spec.clamp(requested)
        with self._lock:
            self._seq += 1
            change = KnobChange(
                spec.name,
                value,
                requested,
                not spec.minimum <= requested <= spec.maximum,
                origin,
                self._seq,
                time.perf_counter(),
                sent_at,
            )
            self._values[spec.name] = value
            self._latest[spec.name] = change
            subscribers = self._subscribers
        for callback in subscribers:
            try:
                callback(change)
            except Exception:
                if id(callback) not in self._failed_subscribers:  # once per subscriber; later errors stay silent
                    self._failed_subscribers.add(id(callback))
                    log.exception(
                        "knob subscriber %r failed on %s; set() goes on, further errors are not logged",
                        callback,
                        spec.name,
                    )
        return change

    def _spec(self, name: str) -> KnobSpec:
        try:
            return self.specs[name]
        except (KeyError, TypeError):
            close = difflib.get_close_matches(str(name), self.specs, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise KnobError(
                f"unknown knob {name!r}{hint}; valid knobs: {', '.join(self.specs)}", str(name), "unknown_knob"
            ) from None


def _finite_number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise KnobError(
            f"knob {name!r} needs a number, got {type(value).__name__} {value!r}; "
            "send a float or an int (convert text with float(...))",
            name,
            "not_a_number",
        )
    try:
        number = float(value)
    except OverflowError:  # an int too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise KnobError(
            f"knob {name!r} needs a finite number, got {number}; send a value inside its range", name, "not_finite"
        )
    return number
