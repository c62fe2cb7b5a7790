"""Opening the clock `--sync` names, and reading the tempo and metre a performance starts with."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .clock import ClockState, now_s
from .grid import Grid
from .midi_clock import MidiClockFollower

SYNC_SOURCES = ("link", "midi", "jack")
TEMPO_WAIT_S = 10.0  # how long a start waits for a clock's first tempo
STEADY_S = 0.25  # a first tempo is taken once two readings this far apart agree
LINK_JOIN_S = 1.0  # a Link peer finds the session's peers within this (then the session's tempo is known)


@dataclass
class FollowedClock:
    """A running clock follower. `midi_follower`: a MIDI clock the live app's MIDI input must feed (ALSA or another
    python-rtmidi port), None where the clock reads its own port; `at_output`: the clock's beat is the one heard
    (Link), so the lock aims the output's latency ahead."""

    kind: str
    state: Callable[[float | None], ClockState]
    close: Callable[[], None]
    midi_follower: MidiClockFollower | None = None
    at_output: bool = False
    beats_per_bar: Callable[[], int | None] = field(default=lambda: None)
    counts: Callable[[], dict[str, int]] = field(default=dict)  # what the follower met (a bench tells them)


def open_clock(kind: str, beats_per_bar: int, bpm: float | None, midi_port: str | None, midi_backend: str | None):
    """The follower of `kind` (link | midi | jack), joined or listening."""
    if kind == "jack":
        from .jack_transport import JackTransportFollower

        transport = JackTransportFollower()

        def metre() -> int | None:
            found = transport.metre()
            return None if found is None else round(found[0])

        return FollowedClock(kind, transport.state, transport.close, beats_per_bar=metre)
    if kind == "link":
        from .link import LinkFollower

        link = LinkFollower(quantum=beats_per_bar, bpm=bpm or 120.0)
        time.sleep(LINK_JOIN_S)
        return FollowedClock(kind, link.state, link.close, at_output=True)
    if kind == "midi":
        follower = MidiClockFollower()
        if midi_backend == "jack":
            from .jack_midi import JackMidiClock

            port = JackMidiClock(follower, midi_port)

            def counts() -> dict[str, int]:
                return {
                    "missed cycles": port.missed_cycles,
                    "pauses": follower.pauses,
                    "recounts": follower.recounts,
                }

            return FollowedClock(kind, follower.state, port.close, counts=counts)
        return FollowedClock(kind, follower.state, lambda: None, midi_follower=follower)
    raise ValueError(f"unknown clock {kind!r}: --sync takes one of {', '.join(SYNC_SOURCES)}")


def clock_grid(clock: FollowedClock, bpm: float | None, beats_per_bar: int | None) -> Grid:
    """The grid a clock sets: its tempo unless `bpm`, its metre (JACK's) unless `beats_per_bar`, else 4."""
    tempo = bpm if bpm is not None else wait_for_tempo(clock)
    return Grid(float(tempo), int(beats_per_bar or clock.beats_per_bar() or 4))


def wait_for_tempo(clock: FollowedClock, timeout_s: float = TEMPO_WAIT_S) -> float:
    """The clock's tempo once it holds (within 0.005 BPM over STEADY_S: a MIDI clock's first pulses give a rough
    one); a ValueError naming the fix after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    held: float | None = None
    while True:
        bpm, late = clock.state(now_s()).bpm, time.monotonic() > deadline
        if bpm is not None and (late or (held is not None and abs(bpm - held) <= 0.005)):
            return bpm
        if late:
            hints = {
                "jack": "start a JACK timebase master (Ardour, Carla: its transport's tempo)",
                "midi": "have the DAW send MIDI clock to this port",
                "link": "enable Link in the DAW",
            }
            raise ValueError(
                f"no tempo from the {clock.kind} clock within {timeout_s:g} s: {hints[clock.kind]}, or give --bpm"
            )
        held = bpm
        time.sleep(STEADY_S if bpm is not None else 0.05)
