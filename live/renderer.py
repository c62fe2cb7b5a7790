"""The body of the audio callback, shared by every output mode and by serve's sessions: the block at the loop
position, the volume, a metronome click on the bar starts, the transport's fades and a start on a given frame, a
crossfade where a clock's phase lock moved the position, the gap count, the recording ring, the clock counters.

All arrays are allocated in the constructor, none per block: the callback never allocates audio memory, never locks
and never waits."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np

from .loop_buffer import (
    ACTIVE,
    APPLIED_GAIN,
    APPLIED_TRANSPORT,
    BLOCK_PLAYED,
    BLOCK_TIME,
    CALLBACKS,
    CLICK_BAR,
    CLICK_CYCLE,
    FADE_STARTED,
    GAIN,
    GAPS,
    LATE_BLOCKS,
    LENGTHS,
    NEXT_CLICK_BAR,
    NEXT_CLICK_CYCLE,
    PLAYED,
    RECORDED,
    SHIFTS,
    START_AT,
    SWITCH_AT,
    SWITCH_TO,
    TRANSPORT,
    TRANSPORT_FADE_FRAMES,
    LoopBuffer,
)
from .sync.clock import now_s

CLICK_HZ = 2_000.0  # the metronome: a decaying 2 kHz burst, loudest on its first sample (a sharp onset)
CLICK_DECAY_S = 0.0015
CLICK_GAIN = 0.5
START_FADE_FRAMES = 32  # a start on a given frame fades in over these (no click from a hard edge)
MAX_LOST_BLOCKS = 200  # an xrun longer than this (blocks) is a stall, not lost time to make up
RECENT_BLOCKS = 128  # the blocks whose times on the device's clock tell where its cycles start


class DeviceClock:
    """Where a block's cycle started on the clock the output plays to, from the callback's time on it (PortAudio's
    stream time: for JACK, JACK's frame counter; else the system clock). A callback wakes late, never early, so the
    earliest of the recent blocks (device time less frames played) came at its cycle's start; how far a block came
    after that is its lateness, whole periods of it lost blocks. No allocation per block."""

    def __init__(self, rate: int, blocks: int = RECENT_BLOCKS):
        self.rate = rate
        self.offsets = np.full(blocks, np.inf)
        self.kept = 0

    def late_s(self, device_s: float, played: int) -> float:
        """How long after its cycle's start a callback at `device_s` with `played` frames played came."""
        offset = device_s - played / self.rate
        return offset - min(offset, float(self.offsets.min()))

    def keep(self, device_s: float, played: int) -> None:
        self.offsets[self.kept % self.offsets.size] = device_s - played / self.rate
        self.kept += 1

    def restart(self) -> None:
        """Forget the earlier blocks: the frames played no longer count the device's cycles from them."""
        self.offsets.fill(np.inf)


def click_wave(rate: int) -> np.ndarray:
    """The metronome's click, [N, 1] float32. Its curves and the crossfade's come from the C library's sin, cos and
    exp in double precision (Python's math module), which the plugin's renderer (plugin/src/render_core.cpp) calls
    too: the two give the same samples bit for bit, where numpy's own vectorised float32 sin would not."""
    wave = [
        CLICK_GAIN * math.cos(2 * math.pi * CLICK_HZ * n / rate) * math.exp(-n / (CLICK_DECAY_S * rate))
        for n in range(int(6 * CLICK_DECAY_S * rate))
    ]
    return np.array(wave, np.float32)[:, None]


def crossfade_rise(frames: int) -> np.ndarray:
    """The equal-gain (sin²) rise of a crossfade over one block, [frames, 1] float32."""
    rise = [math.sin(0.5 * math.pi * (k + 0.5) / frames) for k in range(frames)]
    return np.array([s * s for s in rise], np.float32)[:, None]


class BlockRenderer:
    def __init__(
        self, buffer: LoopBuffer, blocksize: int, record: np.ndarray | None, clock: Callable[[], float] = now_s
    ):
        """`clock`: the sync clock (a simulated one in tests)."""
        self.clock = clock
        self.buffer, self.counters, self.reals, self.record = buffer, buffer.counters, buffer.reals, record
        self.heard = False  # a block with sound has played: from then on an all-zero block is a gap
        self.native_id = 0  # the thread the callback runs on, once it ran
        self.unit_ramp = ((np.arange(blocksize, dtype=np.float32) + 1) / blocksize)[:, None]
        self.gain_curve = np.empty_like(self.unit_ramp)
        self.fade_steps = (np.arange(blocksize, dtype=np.float32) + 1)[:, None] / TRANSPORT_FADE_FRAMES
        self.fade_curve = np.empty_like(self.fade_steps)
        self.rise = crossfade_rise(blocksize)
        self.fall = 1.0 - self.rise
        self.before = np.empty((blocksize, buffer.channels), np.float32)  # the old position's block, crossfaded from
        self.start_ramp = ((np.arange(START_FADE_FRAMES, dtype=np.float32) + 1) / START_FADE_FRAMES)[:, None]
        self.click = click_wave(buffer.sample_rate)
        self.click_left = 0  # samples of a click begun in an earlier block still to play
        self.click_shift: tuple[int, int] | None = None  # (region, shift) the last block's clicks were placed at
        self.applied = self.where()  # (region, shift) the last block was read at
        self.device_clock = DeviceClock(buffer.sample_rate)

    def callback(self, outdata: np.ndarray, frames: int, time_info, status) -> None:
        if not self.native_id:  # once: the output process raises this thread's priority from outside
            self.native_id = threading.get_native_id()
        now = self.clock()
        device_s = float(time_info.currentTime) or now  # 0.0 where the host API keeps no stream time
        late_s = self.device_clock.late_s(device_s, int(self.counters[PLAYED]))
        if status.output_underflow:
            self.counters[LATE_BLOCKS] += 1
            late_s -= self.make_up(late_s, frames) * frames / self.buffer.sample_rate
            if late_s >= frames / self.buffer.sample_rate:  # a stall not made up: its cycle starts from here
                self.device_clock.restart()
                late_s = 0.0
        self.device_clock.keep(device_s, int(self.counters[PLAYED]))
        self.render(outdata, frames, now - late_s)

    def make_up(self, late_s: float, frames: int) -> int:
        """The device lost whole blocks (an xrun): its clock went on meanwhile, so the frames played do too, and the
        loop stays in time with it (and with a followed clock) instead of falling behind by the lost blocks. `late_s`:
        how long after its cycle's start on the device's clock this callback came; the whole periods of it were
        played without this output, the rest is a late wake-up. -> the blocks made up."""
        lost = int(late_s * self.buffer.sample_rate // frames)
        if not 0 < lost <= MAX_LOST_BLOCKS:
            return 0
        self.counters[PLAYED] += lost * frames
        return lost

    def count_gap(self, out: np.ndarray) -> None:
        """An exact-zero block while playing at a non-zero volume is a hole in the loop (the engine fell behind
        the playhead): counted as an underrun, like a late device callback."""
        if out.any():
            self.heard = True
        elif (
            self.heard
            and self.reals[TRANSPORT] == 1.0
            and self.reals[APPLIED_TRANSPORT] == 1.0
            and self.reals[GAIN] > 0
        ):
            self.counters[GAPS] += 1

    def where(self) -> tuple[int, int]:
        """The region playing and its shift."""
        region = int(self.counters[ACTIVE])
        return region, int(self.counters[SHIFTS[region]])

    def switch(self, played: int, frames: int) -> None:
        """A switch due within this block (a new tempo's loop, a new click) takes effect for the whole block."""
        switch_at = int(self.counters[SWITCH_AT])
        if 0 <= switch_at < played + frames:
            reals = self.reals
            reals[CLICK_BAR], reals[CLICK_CYCLE] = reals[NEXT_CLICK_BAR], reals[NEXT_CLICK_CYCLE]
            self.counters[ACTIVE] = self.counters[SWITCH_TO]
            self.counters[SWITCH_AT] = -1

    def read(self, out: np.ndarray, frames: int, played: int) -> None:
        """The block at the loop position; where the phase lock moved it or the output switched loops since the
        last block, a crossfade over this block from the old position's audio to the new one's."""
        self.switch(played, frames)
        region, shift = self.where()
        self.buffer.read_into(out, played + shift, region)
        if (region, shift) != self.applied and frames == self.rise.shape[0]:
            self.buffer.read_into(self.before, played + self.applied[1], self.applied[0])
            out *= self.rise
            self.before *= self.fall
            out += self.before
        self.applied = (region, shift)

    def add_clicks(self, out: np.ndarray, frames: int, position: int) -> None:
        """The metronome: a click from every bar start of the loop position in this block (bar starts at whole
        multiples of CLICK_BAR frames from each start of the cycle: the loop, or for endless play one bar; rounded
        to the frame). Where the phase lock moved the loop (its shift) by less than half a bar since the last block,
        a bar start it jumped over clicks at the block's start, and one it moved back over (clicked already) not
        again; a jump of the frames played (a host's transport, blocks made up after an xrun) is no correction."""
        if self.click_left:
            done = self.click.shape[0] - self.click_left
            take = min(frames, self.click_left)
            out[:take] += self.click[done : done + take]
            self.click_left -= take
        before, self.click_shift = self.click_shift, self.applied
        bar = float(self.reals[CLICK_BAR])
        if bar <= 0.0:
            return
        cycle = float(self.reals[CLICK_CYCLE]) or float(self.counters[LENGTHS[self.applied[0]]])
        start = position % cycle
        moved = self.applied[1] - before[1] if before is not None and before[0] == self.applied[0] else 0
        low = -moved if abs(moved) < 0.5 * bar else 0  # the block's bar starts click from this offset on
        index = max(0, int(np.ceil((start + low) / bar - 1e-9)))
        while True:
            at = round(index * bar)
            if at >= cycle - 0.5 * bar:  # the next bar start is the cycle's start again: count from there
                index, start = 0, start - cycle
                at = 0
            offset = round(at - start)
            if offset >= frames:
                return
            if offset >= low:
                offset = max(offset, 0)
                take = min(frames - offset, self.click.shape[0])
                out[offset : offset + take] += self.click[:take]
                self.click_left = self.click.shape[0] - take
            index += 1

    def apply_transport(self, out: np.ndarray, frames: int, played: int) -> None:
        """Fade toward the transport state at 1/TRANSPORT_FADE_FRAMES per frame; stopped means exact zeros. A start
        asked for at a frame inside this block (`Buffer.start_at`) begins there, with a short fade-in."""
        counters, reals = self.counters, self.reals
        start_at = int(counters[START_AT])
        if 0 <= start_at < played + frames:
            counters[START_AT] = -1
            counters[FADE_STARTED] = start_at
            reals[TRANSPORT] = reals[APPLIED_TRANSPORT] = 1.0
            begin = max(0, start_at - played)
            out[:begin] = 0.0
            ramp = min(START_FADE_FRAMES, frames - begin)
            out[begin : begin + ramp] *= self.start_ramp[:ramp]
            return
        target, applied = float(reals[TRANSPORT]), float(reals[APPLIED_TRANSPORT])
        if target != applied and frames == self.fade_steps.shape[0]:
            if applied in (0.0, 1.0):
                counters[FADE_STARTED] = played
            curve = self.fade_curve
            np.multiply(self.fade_steps, 1.0 if target > applied else -1.0, out=curve)
            curve += applied
            np.clip(curve, 0.0, 1.0, out=curve)
            out *= curve
            reals[APPLIED_TRANSPORT] = float(curve[-1, 0])
            return
        if target != applied:  # an odd-sized block: no ramp to fit, jump
            counters[FADE_STARTED] = played
            reals[APPLIED_TRANSPORT] = applied = target
        if applied == 0.0:
            out.fill(0.0)
        elif applied != 1.0:
            out *= applied

    def render(self, out: np.ndarray, frames: int, at_s: float | None = None) -> None:
        """The next block into `out`; `at_s`: when its cycle started on the sync clock (default: now)."""
        counters, reals = self.counters, self.reals
        played = int(counters[PLAYED])
        counters[BLOCK_PLAYED] = -1  # the pair below is read as one (LoopBuffer.last_block)
        reals[BLOCK_TIME] = self.clock() if at_s is None else at_s
        counters[BLOCK_PLAYED] = played
        self.read(out, frames, played)
        target, applied = float(reals[GAIN]), float(reals[APPLIED_GAIN])
        if target != applied and frames == self.unit_ramp.shape[0]:  # ramp over the block: no zipper clicks
            np.multiply(self.unit_ramp, target - applied, out=self.gain_curve)
            self.gain_curve += applied
            out *= self.gain_curve
        elif target != 1.0:
            out *= target
        reals[APPLIED_GAIN] = target
        self.count_gap(out)
        self.add_clicks(out, frames, played + self.applied[1])
        self.apply_transport(out, frames, played)
        if self.record is not None:
            size, written = self.record.shape[0], int(counters[RECORDED])
            start = written % size
            first = min(frames, size - start)
            self.record[start : start + first] = out[:first]
            self.record[: frames - first] = out[first:]
            counters[RECORDED] = written + frames
        counters[PLAYED] = played + frames
        counters[CALLBACKS] += 1
