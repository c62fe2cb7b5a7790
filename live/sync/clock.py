"""What every clock follower reports."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ClockState:
    """A clock at a moment: tempo (None until known), whether its transport plays, and the position in beats since
    the song's start (quarter notes for a MIDI clock, the metre's beats for JACK's bar/beat/tick)."""

    bpm: float | None
    playing: bool
    beats: float
