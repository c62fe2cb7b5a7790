"""The phase lock: keeps the loop's frame 0 on a followed clock's bar lines. A thread reads the output's newest block
(its frames played and when it was rendered, on the sync clock) and the clock's beat at that moment, and moves the
loop buffer's shift by the phase error (the output crossfades the move over a block). When the clock starts playing,
the loop is aligned while silent and the transport starts on the clock's next bar line; when it stops, the output
fades out. `correction` is the pure step."""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..loop_buffer import LoopBuffer
from .clock import ClockState
from .grid import Grid, phase_error

log = logging.getLogger("flowjam.sync")
PERIOD_S = 0.02  # a reading every 20 ms
MEDIAN_OF = 5  # corrections follow the median of this many readings: a late-woken callback's time stamp is not one
TOLERANCE_S = 0.0005  # a phase error below this is left alone
START_MARGIN_BLOCKS = 2  # a start is set at least this many output blocks ahead (the output must see it in time)
BLOCK_CLOCK_S = 2.0  # a block's time is read off the earliest-woken block of the last this many seconds
RECENT_S = 0.3  # ... unless every block of this last while woke later: the output lost time (an xrun), start afresh
SHIFTED_S = 0.001
MAX_OFFSET_MS = 1000.0  # a sync offset makes up for an output's latency (a DAW's, Bluetooth's): under a second


def check_offset_ms(offset_ms: float, what: str = "sync offset") -> float:
    """`offset_ms` if it is a finite number within +-MAX_OFFSET_MS; else a ValueError naming `what` and the range."""
    if not (math.isfinite(offset_ms) and abs(offset_ms) <= MAX_OFFSET_MS):
        raise ValueError(
            f"{what} {offset_ms:g} ms is outside -{MAX_OFFSET_MS:g}..{MAX_OFFSET_MS:g} ms; give the output's latency "
            "against the clock, e.g. 20"
        )
    return offset_ms


class Clock(Protocol):
    def state(self, at_s: float | None = None) -> ClockState: ...


@dataclass(frozen=True)
class Cycle:
    """What the lock aligns: `samples` of the loop position spanning `beats` of the clock, from a bar line (a loop of
    N bars; for endless play, one bar)."""

    samples: float
    beats: float
    bars: int

    def next_bar(self, position: int, margin: int) -> int:
        """Frames from loop `position` to the first bar line at least `margin` frames ahead."""
        at = position % self.samples
        bar = self.samples / self.bars
        index = math.ceil((at + margin) / bar - 1e-9)
        return round(index * bar - at)


def cycle_for(grid: Grid, rate: int, loop_frames: int, bars: int | None) -> Cycle:
    """A loop of `bars` bars (`loop_frames` long), or endless play's one bar."""
    if bars is None:
        return Cycle(grid.bar_samples(rate), grid.beats_per_bar, 1)
    return Cycle(loop_frames, bars * grid.beats_per_bar, bars)


def correction(errors: list[float], tolerance: float) -> int | None:
    """The shift change the phase errors of the latest readings call for, None while they are within tolerance."""
    error = statistics.median(errors)
    return None if abs(error) <= tolerance else -round(error)


class PhaseLock:
    def __init__(
        self,
        buffer: LoopBuffer,
        clock: Clock,
        grid: Grid,
        bars: int | None,
        offset_s: float = 0.0,
        at_output: bool = False,
        on_tempo: Callable[[float], None] | None = None,
    ):
        """`offset_s`: the block rendered at a moment plays the clock's beat this much later; `at_output`: plus the
        output's latency (for clocks that mean the beat heard, as Link does; JACK transport's position is the
        cycle's own). `on_tempo` hears the clock's tempo when it changes (to 0.01 BPM), from the lock's thread."""
        self.buffer, self.clock, self.grid = buffer, clock, grid
        self.offset_s, self.at_output, self.on_tempo = offset_s, at_output, on_tempo
        self._told_tempo: float | None = None
        self.cycle = cycle_for(grid, buffer.sample_rate, buffer.frames, bars)
        self.state: ClockState | None = None
        self.phase_error_frames: float | None = None
        self.corrections = 0
        self.starts = 0
        self.errors = 0
        self._errors: deque[float] = deque(maxlen=MEDIAN_OF)
        self._blocks: deque[tuple[int, float]] = deque()  # (frames played, render time) of recent blocks
        self._late_blocks = buffer.late_blocks  # the output's late blocks seen: a new one lost time
        self._snap = False  # the next reading corrects alone (the output just lost time)
        self._rolling = False  # the clock plays and the loop was started on its bar line
        self._moved_at = -1  # frames played when the shift last moved: readings of older blocks predate it
        self._reading: tuple[int, ClockState] | None = None  # the newest (frames played, clock state) of a block
        self._retarget: tuple[int, Grid, Cycle] | None = None  # from this frame played on, this grid and cycle
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.buffer.playing = False  # silent until the clock's next bar line
        self._thread = threading.Thread(target=self._run, name="flowjam-phase-lock", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _run(self) -> None:
        while not self._stop.wait(PERIOD_S):
            try:
                self.step()
            except Exception:  # a clock that fails once (a JACK server gone) must not stop the lock's thread
                self.errors += 1
                if self.errors == 1:
                    log.exception("reading the clock failed; further failures are counted")

    def step(self) -> None:
        """One reading: start, stop or correct the loop's phase."""
        buffer = self.buffer
        block = buffer.last_block()
        if block is None:
            return
        late = buffer.late_blocks
        if late != self._late_blocks:  # the output came late (an xrun): the earlier blocks no longer tell its clock
            self._late_blocks, self._snap = late, True
            self._blocks.clear()
        played, at = self._block_time(*block)
        if played <= self._moved_at:
            return
        retarget = self._retarget
        if retarget is not None and played + buffer.block_frames > retarget[0]:  # the output switched in this block
            self.grid, self.cycle, self._retarget = retarget[1], retarget[2], None
            self._errors.clear()
        offset = self.offset_s + (buffer.latency_s if self.at_output else 0.0)
        state = self.state = self.clock.state(at + offset)
        self._reading = (played, state)
        if state.bpm is not None and self.on_tempo is not None and round(state.bpm, 2) != self._told_tempo:
            self._told_tempo = round(state.bpm, 2)
            self.on_tempo(self._told_tempo)
        if state.bpm is None or not state.playing:
            if self._rolling:
                buffer.playing = False
            self._rolling = False
            self._errors.clear()
            return
        shift = buffer.shift
        error = phase_error(played + shift, self.cycle.samples, state.beats, self.cycle.beats)
        self.phase_error_frames = error
        if not self._rolling:  # the clock (re)started: align while silent, play from its next bar line
            shift -= round(error)
            buffer.playing = False
            buffer.shift, self._moved_at = shift, played
            margin = START_MARGIN_BLOCKS * max(buffer.block_frames, 1)
            buffer.start_at(played + self.cycle.next_bar(played + shift, margin))
            self._rolling, self.starts = True, self.starts + 1
            self._errors.clear()
            return
        self._errors.append(error)
        if self._snap:  # correct at once, from this reading: the loop is a block or more off its bar lines
            self._errors, self._snap = deque([error], maxlen=MEDIAN_OF), False
        elif len(self._errors) < MEDIAN_OF:
            return
        change = correction(list(self._errors), TOLERANCE_S * buffer.sample_rate)
        if change is not None:
            buffer.shift, self._moved_at = shift + change, played
            self.corrections += 1
            self._errors.clear()

    def _block_time(self, played: int, at: float) -> tuple[int, float]:
        """A block's render time as the audio clock puts it: a callback can wake late, never early, so the earliest
        of the recent blocks (time less frames played) is the clock's, and a late wake-up moves nothing. When every
        block of the last RECENT_S woke later than that, the output lost time (an xrun: time went on, the frames
        played did not), and the earlier blocks no longer tell the clock."""
        blocks, rate = self._blocks, self.buffer.sample_rate
        if not blocks or blocks[-1][0] != played:
            blocks.append((played, at))
        while blocks[0][0] < played - BLOCK_CLOCK_S * rate:
            blocks.popleft()
        offsets = [(p, t - p / rate) for p, t in blocks]
        earliest = min(offset for _, offset in offsets)
        recent = min(offset for p, offset in offsets if p >= played - RECENT_S * rate)
        if offsets[0][0] < played - RECENT_S * rate and recent - earliest > SHIFTED_S:
            while blocks[0][0] < played - RECENT_S * rate:
                blocks.popleft()
            return played, recent + played / rate
        return played, earliest + played / rate

    def aligned_shift(self, cycle: Cycle) -> int | None:
        """The shift that puts a loop of `cycle` on the clock's bar lines now (from the newest reading); None before
        the clock plays."""
        reading = self._reading
        if reading is None or reading[1].bpm is None or not reading[1].playing:
            return None
        played, state = reading
        return -round(phase_error(played, cycle.samples, state.beats, cycle.beats))

    def retarget(self, at_played: int, grid: Grid, cycle: Cycle) -> None:
        """From the block holding the frame played `at_played` (where the output switches loops or clicks), lock
        to `grid` and `cycle`."""
        self._retarget = (at_played, grid, cycle)

    @property
    def newest_played(self) -> int | None:
        return None if self._reading is None else self._reading[0]

    def status(self) -> dict:
        """The clock (tempo, transport, bar.beat) and the lock (phase error, corrections, starts)."""
        state = self.state
        per_bar = self.grid.beats_per_bar
        clock_bar = None
        if state is not None and state.bpm is not None:
            whole = math.floor(state.beats)
            clock_bar = f"{whole // per_bar + 1}.{whole % per_bar + 1}"
        return {
            "clock_bpm": None if state is None or state.bpm is None else round(state.bpm, 3),
            "clock_playing": bool(state and state.playing),
            "clock_bar_beat": clock_bar,
            "phase_error_ms": None
            if self.phase_error_frames is None
            else round(1000.0 * self.phase_error_frames / self.buffer.sample_rate, 2),
            "corrections": self.corrections,
            "starts": self.starts,
        }
