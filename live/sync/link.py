"""Following an Ableton Link session (Live, Bitwig, Reason, Traktor, many iOS apps) through `aalink`, a maintained
Python binding of Ableton's Link library: join the session on this network (peers find each other by multicast),
read its tempo and beat. aalink runs on an asyncio event loop; the follower keeps one on a thread of its own, so the
rest of flowjam stays synchronous. `ClockState.beats` is Link's beat on the session timeline: every peer with the
same quantum sees the same phase of it (beats modulo the quantum) at the same moment."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from .clock import ClockState
from .unavailable import ClockUnavailable


class LinkError(ClockUnavailable):
    """Link cannot be followed here (aalink missing); the message names the fix."""


class LinkFollower:
    def __init__(self, quantum: float = 4.0, bpm: float = 120.0, start_stop: bool = False):
        """Join with `quantum` beats a bar (the phase peers agree on) and `bpm` as this peer's tempo until it meets
        others (a session's tempo is its peers' latest). `start_stop`: follow the session's play/stop (Link's
        start/stop sync, which not every peer sends); else the session always plays."""
        try:
            from aalink import Link
        except ImportError as error:
            raise LinkError("link", "aalink", package="aalink") from error
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flowjam-link", daemon=True)
        self._thread.start()

        async def join() -> Any:
            link = Link(bpm)
            link.quantum = quantum
            link.start_stop_sync_enabled = start_stop
            link.enabled = True
            return link

        self._link = asyncio.run_coroutine_threadsafe(join(), self._loop).result(timeout=10)
        self._start_stop = start_stop

    @property
    def peers(self) -> int:
        return int(self._link.num_peers)

    def state(self, at_s: float | None = None) -> ClockState:
        """The session now, or its beat carried on to `at_s` (the sync clock: Link's own on Linux)."""
        link = self._link
        playing = bool(link.playing) if self._start_stop else True
        tempo, beat, now = float(link.tempo), float(link.beat), link.time.total_seconds()
        if at_s is not None:
            beat += (at_s - now) * tempo / 60.0
        return ClockState(tempo, playing, beat)

    def close(self) -> None:
        async def leave() -> None:
            self._link.enabled = False

        asyncio.run_coroutine_threadsafe(leave(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
