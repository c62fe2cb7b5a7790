"""Following a DAW host's tempo, metre and the plugin's `bars` parameter through the control block. A loop of N bars
at a new tempo (or of other bars) is a new loop, made beside the one playing in the buffer's other region by a runner of its own (prompts with the new
tempo in their metas), as live/tempo_switch.py does for a followed clock. The switch needs no clock arithmetic here:
the engine marks it BAR_SWITCH and the plugin, which knows the host's bars, makes it on the host's next bar line once
the host plays at the new loop's tempo. Until then the old loop plays on."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..engine.prompts import check_bpm, time_signature_numerator
from .loop_buffer import BAR_SWITCH, LoopBuffer, LoopRegion
from .plugin_link import (
    ENGINE_LOOP_BARS,
    HOST_BEATS_PER_BAR,
    HOST_BPM,
    HOST_LOOP_BARS,
    MAX_LOOP_BARS,
    ControlBlock,
)
from .runner import LiveRunner
from .sync.grid import Grid
from .tempo_switch import FIRST_WRITE_TIMEOUT_S, STEADY_S, TEMPO_TOLERANCE_BPM

log = logging.getLogger("flowjam.plugin")


class HostTempo:
    def __init__(
        self,
        control: ControlBlock,
        buffer: LoopBuffer,
        grid: Grid,
        bars: int,
        runner: Callable[[], LiveRunner],
        make_runner: Callable[[LoopRegion, Grid], LiveRunner],
        switched: Callable[[LiveRunner, Grid, int], None],
    ):
        """`runner()`: the runner playing; `make_runner(region, grid)`: one for a new loop (not started);
        `switched(runner, grid, bars)`: the output plays that runner's loop of `bars` bars now."""
        self.control, self.buffer, self.grid, self.bars = control, buffer, grid, bars
        self.default_bars = bars  # the engine's --bars, where the plugin's `bars` parameter is 0
        self._runner, self._make_runner, self._switched = runner, make_runner, switched
        self.pending: LiveRunner | None = None
        self.switches = self.errors = 0
        self._steady: tuple[tuple[Grid, int] | None, float] = (None, 0.0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flowjam-host-tempo", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10.0)
        if self.pending is not None:
            self.pending.stop()
            self.pending = None

    def wanted(self) -> tuple[Grid, int] | None:
        """The host's grid and the bars it asks for, once held STEADY_S, where they differ from the loop's; else
        None."""
        bpm, beats = float(self.control.reals[HOST_BPM]), float(self.control.reals[HOST_BEATS_PER_BAR])
        try:
            check_bpm(bpm)
            time_signature_numerator(int(beats))
        except ValueError:  # no host tempo yet, or one the model was not trained on: the loop keeps its own
            bpm, beats = self.grid.bpm, self.grid.beats_per_bar
        grid = Grid(round(bpm, 2), int(beats))
        asked = int(self.control.counters[HOST_LOOP_BARS])
        bars = asked if 0 < asked <= MAX_LOOP_BARS else self.default_bars
        if grid.loop_samples(bars, self.buffer.sample_rate) > self.buffer.capacity:
            bars = self.bars  # more than the buffer holds at this tempo: the bars playing stay
        same_grid = (
            abs(grid.bpm - self.grid.bpm) <= TEMPO_TOLERANCE_BPM and grid.beats_per_bar == self.grid.beats_per_bar
        )
        if same_grid and bars == self.bars:
            self._steady = (None, 0.0)
            return None
        target = (self.grid if same_grid else grid, bars)
        if self._steady[0] != target:
            self._steady = (target, time.monotonic())
        return target if time.monotonic() - self._steady[1] >= STEADY_S else None

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            wanted = self.wanted()
            if wanted is None:
                continue
            try:
                self._make_loop(*wanted)
            except Exception as error:  # a failed switch leaves the loop playing at its tempo
                self.errors += 1
                log.warning("following the host to %d bars at %.2f BPM failed: %s", wanted[1], wanted[0].bpm, error)
                self._stop.wait(0.5)

    def _make_loop(self, grid: Grid, bars: int) -> None:
        buffer, rate = self.buffer, self.buffer.sample_rate
        region = 1 - buffer.active
        buffer.prepare(region, grid.loop_samples(bars, rate), 0)
        buffer.set_bars(region, bars, grid.bar_samples(rate))
        runner = self.pending = self._make_runner(buffer.region(region), grid)
        runner.start()
        deadline = time.monotonic() + FIRST_WRITE_TIMEOUT_S
        while runner.stats.writes == 0:
            if self._stop.is_set() or time.monotonic() > deadline or self.wanted() not in (None, (grid, bars)):
                self.pending = None
                runner.stop()
                return
            time.sleep(0.01)
        bar = grid.bar_samples(rate) if buffer.click_bar_frames else 0.0
        buffer.switch_at(BAR_SWITCH, region, bar, 0.0)
        while buffer.active != region and not self._stop.is_set():
            time.sleep(0.005)
        old = self._runner()
        self.grid, self.bars, self.pending = grid, bars, None
        self.control.counters[ENGINE_LOOP_BARS] = bars
        self._switched(runner, grid, bars)
        old.stop()
        self.switches += 1
        log.info("following the host: %d bars at %.2f BPM", bars, grid.bpm)
