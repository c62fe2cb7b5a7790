"""A performance following a band's clock: the clock, the phase lock that keeps the loop on its bar lines and the
tempo switch that follows its tempo, started and stopped as one. The clock's tempo goes to the controllers and to the
loop."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .loop_buffer import LoopBuffer, LoopRegion
from .runner import LiveRunner
from .sync.follow import FollowedClock
from .sync.grid import Grid
from .sync.lock import PhaseLock
from .tempo_switch import TempoSwitch


class Following:
    def __init__(
        self,
        clock: FollowedClock,
        buffer: LoopBuffer,
        grid: Grid,
        bars: int | None,
        offset_s: float,
        runner: Callable[[], LiveRunner],
        make_runner: Callable[[LoopRegion, Grid], LiveRunner],
        switched: Callable[[LiveRunner, Grid], None],
        announce: Callable[[str, float], None],
    ):
        """`runner()`: the runner playing; `make_runner`, `switched`: see TempoSwitch; `announce(path, value)`: to
        the controllers."""
        self.clock, self._announce = clock, announce
        self.lock = PhaseLock(buffer, clock, grid, bars, offset_s, clock.at_output, self._on_tempo)
        self.tempo_switch = TempoSwitch(buffer, self.lock, bars, runner, make_runner, switched)

    @property
    def pending(self) -> LiveRunner | None:
        """The runner making a new tempo's loop, if one is being made."""
        return self.tempo_switch.pending

    def start(self) -> None:
        self.lock.start()
        self.tempo_switch.start()

    def stop(self) -> None:
        """Stop following; the clock is closed by its owner."""
        self.tempo_switch.stop()
        self.lock.stop()

    def _on_tempo(self, bpm: float) -> None:
        """The clock's tempo (to 0.01 BPM), from the lock's thread."""
        self._announce("tempo", bpm)
        self.tempo_switch.offer(bpm)

    def status(self) -> dict[str, Any]:
        return {"source": self.clock.kind, **self.lock.status(), "switches": self.tempo_switch.switches}
