"""Following JACK transport (Ardour, Carla, any JACK timebase master): tempo, metre, play/stop and the bar/beat/tick
position, read from the server each time they are asked for. `clock_state` is the pure part (one
`transport_query()` answer in, a `ClockState` out); `JackTransportFollower` holds the JACK client that asks."""

from __future__ import annotations

from typing import Any

from .clock import ClockState
from .unavailable import JACK_SERVER, START_JACK, ClockUnavailable


def clock_state(playing: bool, position: dict[str, Any], at_s: float | None = None) -> ClockState:
    """A `ClockState` from a transport's state and its position (`jack.Client.transport_query()`'s dict): with a
    timebase master (bar/beat/tick valid) its tempo and beats since the song's start; without one no tempo, and
    beats 0. The position holds at the start of the current cycle (`usecs`, on the sync clock); `at_s` (same clock)
    carries a rolling transport's beats on to that moment."""
    if "beats_per_minute" not in position:
        return ClockState(None, playing, 0.0)
    bpm = float(position["beats_per_minute"])
    beats = (
        (position["bar"] - 1) * position["beats_per_bar"]
        + (position["beat"] - 1)
        + position["tick"] / position["ticks_per_beat"]
    )
    if playing and at_s is not None and "usecs" in position:
        beats += (at_s - position["usecs"] / 1e6) * bpm / 60.0
    return ClockState(bpm, playing, float(beats))


def metre(position: dict[str, Any]) -> tuple[float, float] | None:
    """(beats per bar, beat type) from a transport position with bar/beat/tick, else None."""
    if "beats_per_bar" not in position:
        return None
    return float(position["beats_per_bar"]), float(position["beat_type"])


class JackTransportFollower:
    """A JACK client (no ports) that reads the server's transport; `JackTransportError` when there is no server."""

    def __init__(self, client_name: str = "flowjam-transport", server: str | None = None):
        try:
            import jack
        except ImportError as error:
            raise JackTransportError("jack", "JACK-Client", package="JACK-Client") from error
        try:
            self._client = jack.Client(client_name, no_start_server=True, servername=server)
        except jack.JackOpenError as error:
            raise JackTransportError("jack", JACK_SERVER, action=START_JACK) from error
        self._client.activate()
        self._rolling = (jack.ROLLING, jack.STARTING)  # a transport that is (about to be) playing

    def state(self, at_s: float | None = None) -> ClockState:
        """The transport now, or carried on to `at_s` (the sync clock) while it rolls."""
        state, position = self._client.transport_query()
        return clock_state(state in self._rolling, position, at_s)

    def metre(self) -> tuple[float, float] | None:
        return metre(self._client.transport_query()[1])

    def close(self) -> None:
        self._client.deactivate()
        self._client.close()


class JackTransportError(ClockUnavailable):
    """JACK transport cannot be followed here (no JACK-Client, no server); the message names the fix."""
