"""The phase lock's readings, step by step on a real loop buffer: the output's blocks are written into the buffer's
block counters as an output would (frames played, render time), and the clock is a band's steady tempo on the same
clock. The loop starts on the clock's next bar line, a late-woken callback moves nothing, an xrun (the output lost a
block) is corrected at the next reading, and after a switch the new loop's cycle is the one locked."""

from dataclasses import dataclass

import pytest
from flowjam.live.loop_buffer import ACTIVE, BLOCK, BLOCK_PLAYED, BLOCK_TIME, LATE_BLOCKS, START_AT, LoopBuffer
from flowjam.live.sync.clock import ClockState
from flowjam.live.sync.grid import Grid, phase_error
from flowjam.live.sync.lock import PhaseLock, cycle_for

SR, BLOCK_FRAMES = 48_000, 512


@dataclass
class Band:
    """A clock at `bpm`, its beat 0 at `start_s`."""

    bpm: float = 120.0
    start_s: float = 100.0

    def state(self, at_s: float | None = None) -> ClockState:
        return ClockState(self.bpm, True, (at_s - self.start_s) * self.bpm / 60.0)


class Output:
    """Blocks rendered on time (or late), as the output's callback stamps them."""

    def __init__(self, buffer: LoopBuffer, at_s: float):
        self.buffer, self.at_s, self.played = buffer, at_s, 0
        buffer.counters[BLOCK] = BLOCK_FRAMES

    def block(self, late_s: float = 0.0) -> None:
        self.buffer.counters[BLOCK_PLAYED] = self.played
        self.buffer.reals[BLOCK_TIME] = self.at_s + late_s
        self.played += BLOCK_FRAMES
        self.at_s += BLOCK_FRAMES / SR

    def lose_a_block(self) -> None:
        """An xrun: time goes on, the frames played do not, and the output says so."""
        self.at_s += BLOCK_FRAMES / SR
        self.buffer.counters[LATE_BLOCKS] += 1


def run(lock: PhaseLock, output: Output, blocks: int, late_s: float = 0.0) -> None:
    for _ in range(blocks):
        output.block(late_s)
        lock.step()


def heard_error_ms(buffer: LoopBuffer, output: Output, band: Band) -> float:
    """How far the loop position of the next block is from where the band's beat puts it, in ms."""
    error = phase_error(output.played + buffer.shift, buffer.frames, band.state(output.at_s).beats, 8)
    return 1000.0 * error / SR


@pytest.fixture
def looped():
    grid = Grid(120.0)
    buffer = LoopBuffer(grid.loop_samples(2, SR), 2, SR)
    yield buffer, grid
    buffer.unlink()


def test_the_loop_starts_on_the_clocks_next_bar_line_and_stays_on_it(looped):
    buffer, grid = looped
    band = Band(start_s=100.0 - 0.3)  # the band is 0.3 s into its first bar
    lock, output = PhaseLock(buffer, band, grid, 2), Output(buffer, 100.0)
    run(lock, output, 3)
    assert lock.starts == 1 and not buffer.playing
    start = int(buffer.counters[START_AT])  # the frame played the transport starts on
    start_s = 100.0 + start / SR
    assert band.state(start_s).beats == pytest.approx(4.0, abs=1 / SR), "the band's next bar line"
    assert (start + buffer.shift) % buffer.frames in (0, buffer.frames // 2), "the loop's bar line there"
    run(lock, output, 400, late_s=0.0)
    assert abs(heard_error_ms(buffer, output, band)) < 0.05 and lock.corrections == 0


def test_a_late_woken_callback_moves_nothing_but_an_xrun_is_corrected_at_once(looped):
    buffer, grid = looped
    band = Band(start_s=100.0)
    lock, output = PhaseLock(buffer, band, grid, 2), Output(buffer, 100.0)
    run(lock, output, 200)
    shift = buffer.shift
    run(lock, output, 20, late_s=0.004)  # 4 ms late wake-ups for 200 ms
    assert buffer.shift == shift and lock.corrections == 0, "jitter is not a phase error"
    output.lose_a_block()
    run(lock, output, 2)
    assert buffer.shift == shift + BLOCK_FRAMES and lock.corrections == 1, "the lost block made up at once"
    assert abs(heard_error_ms(buffer, output, band)) < 0.05


def test_after_a_switch_the_new_loops_cycle_is_locked():
    grid, faster = Grid(120.0), Grid(128.0)
    buffer = LoopBuffer(Grid(30.0).loop_samples(2, SR), 2, SR, regions=2, loop_frames=grid.loop_samples(2, SR))
    try:
        band = Band(start_s=100.0)
        lock, output = PhaseLock(buffer, band, grid, 2), Output(buffer, 100.0)
        run(lock, output, 100)
        band.bpm, band.start_s = 128.0, output.at_s - band.state(output.at_s).beats * 60.0 / 128.0  # the same beat
        cycle = cycle_for(faster, SR, faster.loop_samples(2, SR), 2)
        buffer.prepare(1, faster.loop_samples(2, SR), lock.aligned_shift(cycle))
        switch_at = output.played + 4 * BLOCK_FRAMES
        buffer.switch_at(switch_at, 1)
        lock.retarget(switch_at, faster, cycle)
        buffer.counters[ACTIVE] = 1  # the output switched in the block holding switch_at
        run(lock, output, 200)
        assert lock.cycle == cycle and lock.grid == faster
        error = phase_error(output.played + buffer.shift, cycle.samples, band.state(output.at_s).beats, 8)
        assert abs(error) < 0.5 * SR / 1000, "the new loop on the band's new bar lines"
    finally:
        buffer.unlink()
