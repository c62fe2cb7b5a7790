"""The band's grid as flowjam plays it: tempo and beats per bar, a loop of whole bars, bar 1 at the loop's frame 0.
Pure arithmetic in samples at the output's rate; where a clock is followed, `phase_error` says how far the playhead
is from where the clock's beat puts it."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...engine.params import MAX_SONG_SECONDS
from ...engine.prompts import check_bpm, time_signature_numerator


@dataclass(frozen=True)
class Grid:
    bpm: float
    beats_per_bar: int = 4

    def __post_init__(self):
        check_bpm(self.bpm)
        time_signature_numerator(self.beats_per_bar)  # 2, 3, 4 or 6, as the model was trained with

    def samples_per_beat(self, rate: int) -> float:
        return rate * 60.0 / self.bpm

    def loop_samples(self, bars: int, rate: int) -> int:
        """A loop of `bars` bars in samples (to the nearest sample; the clock's phase lock absorbs the rest)."""
        if not isinstance(bars, int) or bars < 1:
            raise ValueError(f"bars must be a whole number of at least 1, got {bars!r}")
        return round(bars * self.beats_per_bar * self.samples_per_beat(rate))

    def loop_of_bars(self, bars: int, rate: int, what: str = "bars") -> int:
        """`loop_samples`, refused (a ValueError naming `what` and the most bars that fit) when the loop is longer
        than the model generates."""
        samples = self.loop_samples(bars, rate)
        if samples > MAX_SONG_SECONDS * rate:
            raise ValueError(
                f"{what} {bars} at {self.bpm:g} BPM, {self.beats_per_bar} beats a bar, is a loop of "
                f"{samples / rate:.2f} s, longer than ACE-Step 1.5 generates (at most {MAX_SONG_SECONDS:g} s); use "
                f"{what} {self.most_bars(rate)} or less"
            )
        return samples

    def most_bars(self, rate: int) -> int:
        """The most whole bars a loop may hold (MAX_SONG_SECONDS)."""
        most = math.floor(MAX_SONG_SECONDS * rate / self.bar_samples(rate))
        while most > 1 and self.loop_samples(most, rate) > MAX_SONG_SECONDS * rate:
            most -= 1
        return max(1, most)

    def bar_samples(self, rate: int) -> float:
        return self.beats_per_bar * self.samples_per_beat(rate)

    def bar_beat(self, sample: float, rate: int) -> tuple[int, int, float]:
        """(bar, beat, fraction of the beat) at `sample` samples from bar 1's start; bars and beats count from 1."""
        beats = sample / self.samples_per_beat(rate)
        whole = math.floor(beats)
        bar, beat = divmod(whole, self.beats_per_bar)
        return bar + 1, beat + 1, beats - whole


def phase_error(position: float, cycle_samples: float, beats: float, cycle_beats: float) -> float:
    """Samples the playhead's `position` is ahead of where the clock's `beats` put it (negative: behind), on a cycle
    of `cycle_samples` samples spanning `cycle_beats` of the clock's beats whose start is on the clock's bar line (a
    loop of N bars; for endless play, one bar); the shortest way round the cycle. The clock's beats are mapped onto
    the cycle in proportion, so a loop rounded to the sample does not drift against the clock lap after lap."""
    target = (beats % cycle_beats) / cycle_beats * cycle_samples
    error = (position - target) % cycle_samples
    return error - cycle_samples if error > cycle_samples / 2 else error
