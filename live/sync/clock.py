"""What every clock follower reports, and the clock they all report on."""

from __future__ import annotations

import time
from dataclasses import dataclass

# JACK (jack_get_time) and Ableton Link read CLOCK_MONOTONIC_RAW on Linux: a follower's beat, a MIDI pulse's arrival
# and an output block's render time are compared on it, so they need no conversion.
_CLOCK = getattr(time, "CLOCK_MONOTONIC_RAW", None)


def now_s() -> float:
    """The sync clock in seconds (CLOCK_MONOTONIC_RAW where the OS has it, else the monotonic clock)."""
    return time.clock_gettime(_CLOCK) if _CLOCK is not None else time.monotonic()


@dataclass(frozen=True)
class ClockState:
    """A clock at a moment: tempo (None until known), whether its transport plays, and the position in beats since
    the song's start (quarter notes for a MIDI clock, the metre's beats for JACK's bar/beat/tick)."""

    bpm: float | None
    playing: bool
    beats: float
