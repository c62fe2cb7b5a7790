"""Following a clock's tempo change. A loop of N bars at a new tempo is a new loop: it is made beside the one playing,
in the loop buffer's other region, by a runner of its own whose prompts carry the new tempo in their metas; once its
audio is written the output switches to it on the clock's next bar line (crossfaded over that block) and the old
runner stops. Endless play keeps its runner: the prompts are encoded again at the new tempo, and the phase lock and
the click take the new bar from the next bar line. A tempo that moves again while a loop is being made starts
over with the newest one."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .loop_buffer import LoopBuffer, LoopRegion
from .runner import LiveRunner
from .sync.grid import Grid
from .sync.lock import START_MARGIN_BLOCKS, Cycle, PhaseLock, cycle_for

log = logging.getLogger("flowjam.sync")
TEMPO_TOLERANCE_BPM = 0.05  # a clock this close to the grid's tempo keeps the loop
STEADY_S = 0.1  # a new tempo is made once the clock has held it this long (a MIDI clock's estimate moves while
# its pulses change pace; JACK's and Link's tempo jumps at once)
FIRST_WRITE_TIMEOUT_S = 60.0


class TempoSwitch:
    def __init__(
        self,
        buffer: LoopBuffer,
        lock: PhaseLock,
        bars: int | None,
        runner: Callable[[], LiveRunner],
        make_runner: Callable[[LoopRegion, Grid], LiveRunner],
        switched: Callable[[LiveRunner, Grid], None],
    ):
        """`bars`: the loop's bars (None: endless play); `runner()`: the runner playing now; `make_runner`: a runner
        for a region at a grid (not started); `switched(runner, grid)`: the output plays `runner`'s loop now."""
        self.buffer, self.lock, self.bars = buffer, lock, bars
        self._runner, self._make_runner, self._switched = runner, make_runner, switched
        self.grid = lock.grid
        self.pending: LiveRunner | None = None  # the runner making the next tempo's loop
        self.switches = 0
        self.errors = 0
        self.switched_at_s: float | None = None  # the sync clock at the newest switch
        self._wanted: float | None = None
        self._steady: tuple[float, float] = (0.0, 0.0)  # (tempo, time.monotonic()) since when the clock held it
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def offer(self, bpm: float) -> None:
        """The clock's tempo now (from the lock's thread)."""
        with self._wake:
            if abs(bpm - self._steady[0]) > TEMPO_TOLERANCE_BPM:
                self._steady = (bpm, time.monotonic())
            self._wanted = bpm
            self._wake.notify()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flowjam-tempo", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(10.0)
        if self.pending is not None:
            self.pending.stop()
            self.pending = None

    def _due(self) -> float | None:
        wanted = self._wanted
        if self._stopping or wanted is None or abs(wanted - self.grid.bpm) <= TEMPO_TOLERANCE_BPM:
            return None
        return wanted

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or self._due() is not None)
                if self._stopping:
                    return
                settling = self._steady[1] + STEADY_S - time.monotonic()
                if settling > 0:
                    self._wake.wait(settling)
                    continue
                bpm = self._due()
                if bpm is None:
                    continue
            try:
                grid = Grid(round(bpm, 2), self.grid.beats_per_bar)
                if self.bars is None:
                    self._retempo_endless(grid)
                else:
                    self._make_loop(grid)
            except Exception as error:  # a failed switch leaves the loop playing at its tempo
                self.errors += 1
                log.warning("following the tempo to %.2f BPM failed: %s", bpm, error)
                time.sleep(0.5)

    def _switch_frame(self, cycle: Cycle, shift: int) -> int:
        """The frame played of the clock's next bar line, far enough ahead for the output to see the switch."""
        played = self.lock.newest_played or self.buffer.played_frames
        margin = START_MARGIN_BLOCKS * max(self.buffer.block_frames, 1)
        return played + cycle.next_bar(played + shift, margin)

    def _retempo_endless(self, grid: Grid) -> None:
        rate = self.buffer.sample_rate
        cycle = cycle_for(grid, rate, self.buffer.frames, None)
        runner = self._runner()
        runner.retempo(round(grid.bpm))
        at = self._switch_frame(cycle, self.buffer.shift)
        bar = grid.bar_samples(rate) if self.buffer.click_bar_frames else 0.0
        self.buffer.switch_at(at, self.buffer.active, bar, bar)
        self._note_switch_time(at)
        self.lock.retarget(at, grid, cycle)
        self.grid = grid
        self._switched(runner, grid)
        self.switches += 1

    def _make_loop(self, grid: Grid) -> None:
        buffer, rate = self.buffer, self.buffer.sample_rate
        samples = grid.loop_samples(self.bars, rate)
        cycle = cycle_for(grid, rate, samples, self.bars)
        shift = self.lock.aligned_shift(cycle)
        if shift is None:  # the clock stopped: the loop follows its tempo once it plays again
            time.sleep(0.1)
            return
        region = 1 - buffer.active
        buffer.prepare(region, samples, shift)
        runner = self.pending = self._make_runner(buffer.region(region), grid)
        runner.start()
        deadline = time.monotonic() + FIRST_WRITE_TIMEOUT_S
        while runner.stats.writes == 0:
            if self._stopping or time.monotonic() > deadline or self._moved_on(grid):
                self.pending = None
                runner.stop()
                return
            time.sleep(0.01)
        at = self._switch_frame(cycle, buffer.get_shift(region))
        bar = grid.bar_samples(rate) if buffer.click_bar_frames else 0.0
        buffer.switch_at(at, region, bar, 0.0)
        self._note_switch_time(at)
        self.lock.retarget(at, grid, cycle)
        while buffer.active != region and not self._stopping:
            time.sleep(0.005)
        old = self._runner()
        self.grid, self.pending = grid, None
        self._switched(runner, grid)
        old.stop()
        self.switches += 1
        log.info("following the clock: %d bars at %.2f BPM from frame %d", self.bars, grid.bpm, at)

    def _note_switch_time(self, at_played: int) -> None:
        """When the switch at frame `at_played` plays, on the sync clock (from the output's newest block)."""
        block = self.buffer.last_block()
        if block is not None:
            self.switched_at_s = block[1] + (at_played - block[0]) / self.buffer.sample_rate

    def _moved_on(self, grid: Grid) -> bool:
        """The clock's tempo moved away from the one being made."""
        wanted = self._wanted
        return wanted is not None and abs(wanted - grid.bpm) > TEMPO_TOLERANCE_BPM
