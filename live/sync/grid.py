"""The band's grid as flowjam plays it: tempo and beats per bar, a loop of whole bars, bar 1 at the loop's frame 0.
Pure arithmetic in samples at the output's rate; where a clock is followed, `loop_phase_error` says how far the
playhead is from where the clock's beat puts it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...engine.prompts import BPM_RANGE, time_signature_numerator


@dataclass(frozen=True)
class Grid:
    bpm: float
    beats_per_bar: int = 4

    def __post_init__(self):
        if not (
            isinstance(self.bpm, int | float) and math.isfinite(self.bpm) and BPM_RANGE[0] <= self.bpm <= BPM_RANGE[1]
        ):
            raise ValueError(f"bpm must be a number in {BPM_RANGE[0]}..{BPM_RANGE[1]}, got {self.bpm!r}")
        time_signature_numerator(self.beats_per_bar)  # 2, 3, 4 or 6, as the model was trained with

    def samples_per_beat(self, rate: int) -> float:
        return rate * 60.0 / self.bpm

    def loop_samples(self, bars: int, rate: int) -> int:
        """A loop of `bars` bars in samples (to the nearest sample; the clock's phase lock absorbs the rest)."""
        if not isinstance(bars, int) or bars < 1:
            raise ValueError(f"bars must be a whole number of at least 1, got {bars!r}")
        return round(bars * self.beats_per_bar * self.samples_per_beat(rate))

    def bar_beat(self, sample: float, rate: int) -> tuple[int, int, float]:
        """(bar, beat, fraction of the beat) at `sample` samples from bar 1's start; bars and beats count from 1."""
        beats = sample / self.samples_per_beat(rate)
        whole = math.floor(beats)
        bar, beat = divmod(whole, self.beats_per_bar)
        return bar + 1, beat + 1, beats - whole


def loop_phase_error(position: float, loop_samples: int, clock_beats: float, grid: Grid, rate: int) -> float:
    """Samples the playhead's loop `position` is ahead of where the clock's beat puts it (negative: behind), the
    loop's frame 0 being a bar line of the clock; the shortest way round the loop."""
    target = (clock_beats * grid.samples_per_beat(rate)) % loop_samples
    error = (position - target) % loop_samples
    return error - loop_samples if error > loop_samples / 2 else error
