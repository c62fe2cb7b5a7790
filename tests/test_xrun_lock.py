"""In time after an xrun: the real output callback (BlockRenderer) and the real phase lock, driven by a simulated
device whose frame clock goes on while the callback misses whole periods (1, 2, 5 and 20 of them), and the callback
after the stall wakes late, as it does on a loaded machine. Under each clock (JACK transport, Ableton Link, a MIDI
clock read with its frames) every bar line from the next one on is heard within 2 ms of the clock's."""

from dataclasses import dataclass

import numpy as np
import pytest
from flowjam.live.loop_buffer import BLOCK, LATENCY_S, LoopBuffer
from flowjam.live.renderer import BlockRenderer
from flowjam.live.sync.clock import ClockState
from flowjam.live.sync.grid import Grid, phase_error
from flowjam.live.sync.jack_transport import clock_state
from flowjam.live.sync.lock import PhaseLock
from flowjam.live.sync.midi_clock import CLOCK, PULSES_PER_BEAT, START, MidiClockFollower

SR, PERIOD, BPM, BEATS_PER_BAR, BARS = 48_000, 512, 120.0, 4, 2
T0 = 100.0  # the sync clock when the device's frame 0 plays
BAND_START_S = T0 - 0.37  # the band's beat 0: the loop starts mid-bar of the band's
LATENCY = PERIOD / SR


@dataclass
class Status:
    output_underflow: bool = False


@dataclass
class TimeInfo:
    currentTime: float  # noqa: N815 (PortAudio's name)


def band_beats(at_s: float) -> float:
    return (at_s - BAND_START_S) * BPM / 60.0


class Transport:
    """A JACK timebase master's transport, as `transport_query()` gives it: the position at the current cycle's start."""

    def __init__(self):
        self.cycle_s = T0

    def state(self, at_s: float | None = None) -> ClockState:
        beats = band_beats(self.cycle_s)
        bar, in_bar = divmod(beats, BEATS_PER_BAR)
        position = {
            "beats_per_minute": BPM,
            "bar": int(bar) + 1,
            "beat": int(in_bar) + 1,
            "tick": (in_bar % 1.0) * 1920.0,
            "ticks_per_beat": 1920.0,
            "beats_per_bar": float(BEATS_PER_BAR),
            "beat_type": 4.0,
            "usecs": self.cycle_s * 1e6,
        }
        return clock_state(True, position, at_s)


class Link:
    """A Link session: its beat on the sync clock, the one heard."""

    def state(self, at_s: float | None = None) -> ClockState:
        return ClockState(BPM, True, band_beats(at_s))


class MidiOverJack:
    """A DAW's frame-exact MIDI clock read by a JACK client in the same cycles as the output: a cycle the output
    misses, the clock's port misses too (it says so), and the pulses in it are lost."""

    def __init__(self):
        self.follower = MidiClockFollower()
        self.pulse_s = 60.0 / (BPM * PULSES_PER_BEAT)
        self.next_pulse = 0
        self.follower.handle(START, BAND_START_S - 1e-3)

    def state(self, at_s: float | None = None) -> ClockState:
        return self.follower.state(at_s)

    def cycle(self, start_s: float, missed: int) -> None:
        """The port's process cycle starting at `start_s`, `missed` cycles after the last one it ran."""
        if missed:
            self.follower.lost(missed * PERIOD / SR)
        lost_from_s = start_s - missed * PERIOD / SR
        while BAND_START_S + self.next_pulse * self.pulse_s < start_s + PERIOD / SR:
            at = BAND_START_S + self.next_pulse * self.pulse_s
            if not lost_from_s <= at < start_s:
                self.follower.handle(CLOCK, at)
            self.next_pulse += 1


class Device:
    """A device clock of PERIOD-frame cycles; each cycle calls the output's callback (unless the callback misses it)
    a little late, stamped with the device's time of its frame counter, as PortAudio's JACK host API does."""

    def __init__(self, renderer: BlockRenderer, clock):
        self.renderer, self.clock = renderer, clock
        self.cycle = 0
        self.now_s = T0
        self.heard: list[tuple[float, float]] = []  # (sync time the block is heard at, loop position in it)
        self.last_ran = -1

    def run(self, late_s: float, underflow: bool = False) -> None:
        start_s = T0 + self.cycle * PERIOD / SR
        self.now_s = start_s + late_s
        missed = self.cycle - self.last_ran - 1
        if isinstance(self.clock, Transport):
            self.clock.cycle_s = start_s
        if isinstance(self.clock, MidiOverJack):
            self.clock.cycle(start_s, missed)
        out = np.zeros((PERIOD, 2), np.float32)
        self.renderer.callback(out, PERIOD, TimeInfo(7.25 + self.cycle * PERIOD / SR + late_s), Status(underflow))
        position = self.renderer.buffer.played_frames - PERIOD + self.renderer.applied[1]
        self.heard.append((start_s, position))
        self.last_ran = self.cycle
        self.cycle += 1

    def miss(self, periods: int) -> None:
        self.cycle += periods


def jitter_s(cycle: int) -> float:
    """An ordinary wake-up: up to 0.3 ms late."""
    return (cycle * 7919 % 13) / 13 * 0.0003


@pytest.mark.parametrize("periods", [1, 2, 5, 20])
@pytest.mark.parametrize("kind", ["jack", "link", "midi"])
def test_every_bar_from_the_next_one_on_is_on_the_clock_after_late_blocks(kind, periods):
    grid = Grid(BPM, BEATS_PER_BAR)
    buffer = LoopBuffer(grid.loop_samples(BARS, SR), 2, SR)
    try:
        buffer.counters[BLOCK] = PERIOD
        buffer.reals[LATENCY_S] = LATENCY
        clock = {"jack": Transport, "link": Link, "midi": MidiOverJack}[kind]()
        device = Device(None, clock)
        renderer = BlockRenderer(buffer, PERIOD, None, clock=lambda: device.now_s)
        device.renderer = renderer
        lock = PhaseLock(buffer, clock, grid, BARS, at_output=kind == "link")

        def play(blocks: int, late=jitter_s) -> None:
            for _ in range(blocks):
                device.run(late(device.cycle))
                if device.cycle % 2 == 0:
                    lock.step()

        play(round(5.0 * SR / PERIOD))  # locked and playing
        bar_s = BEATS_PER_BAR * 60.0 / BPM
        next_bar_s = BAND_START_S + (int(band_beats(device.now_s) // BEATS_PER_BAR) + 1) * bar_s
        stall_s = periods * PERIOD / SR
        play(round((next_bar_s - 0.08 - stall_s - device.now_s) * SR / PERIOD))  # a bar line 80 ms after the stall
        stalled_at = device.now_s
        device.miss(periods)
        device.run(0.7 * PERIOD / SR, underflow=True)  # the first callback after the stall wakes late
        play(2, late=lambda cycle: 0.4 * PERIOD / SR)
        play(round(3 * bar_s * SR / PERIOD))
        offset_s = LATENCY if kind == "link" else 0.0
        errors_ms = {}
        for start_s, position in device.heard:
            beats = band_beats(start_s + offset_s)
            bar_line = round(beats / BEATS_PER_BAR) * BEATS_PER_BAR
            at_line = BAND_START_S + bar_line * 60.0 / BPM - offset_s
            if start_s > stalled_at and 0 <= at_line - start_s < PERIOD / SR:
                error = phase_error(position, buffer.frames, beats, BARS * BEATS_PER_BAR)
                errors_ms[round(bar_line / BEATS_PER_BAR) + 1] = round(1000.0 * error / SR, 3)
        assert len(errors_ms) >= 3, errors_ms
        assert all(abs(e) <= 2.0 for e in errors_ms.values()), f"bar: error ms {errors_ms}"
    finally:
        buffer.unlink()
