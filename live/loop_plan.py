"""What a performance loops, decided before anything is built: the loop's length in samples and the musical grid it
is on (tempo, metre, bars) where there is one. A source on a grid is cut here to whole bars from its first downbeat."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from ..engine.audio.beats import SourceGrid, bars_of_source, estimate_source_grid
from ..engine.audio.files import resample
from ..engine.params import MAX_SONG_SECONDS, song_frames
from ..engine.prompts import BPM_RANGE
from ..engine.stream.windows import ring_frames, window_frames
from .loop_buffer import LoopBuffer
from .loop_map import LoopMap
from .sync.grid import Grid

log = logging.getLogger("flowjam.live")


@dataclass(frozen=True)
class LoopPlan:
    samples: int  # the loop, or endless play's ring, in samples at the output's rate
    grid: Grid | None = None
    bars: int | None = None  # the loop's bars (None: endless play, or a loop off the grid)
    source_grid: SourceGrid | None = None  # a source's own tempo and first downbeat

    def buffer(self, rate: int, tempo_may_change: bool) -> LoopBuffer:
        """The loop buffer: one loop, or where a followed clock may change the tempo of a loop of bars, room for a
        second loop at any tempo (the next one is made there while this one plays)."""
        if not tempo_may_change or self.bars is None:
            return LoopBuffer(self.samples, 2, rate)
        slowest = Grid(float(BPM_RANGE[0]), self.grid.beats_per_bar).loop_samples(self.bars, rate)
        capacity = max(self.samples, min(slowest, int(MAX_SONG_SECONDS * rate)))
        return LoopBuffer(capacity, 2, rate, regions=2, loop_frames=self.samples)


def text_plan(
    grid: Grid | None, bars: int | None, seconds: float, rate: int, hop: int, endless: bool, window_s: float
) -> LoopPlan:
    """A text loop: `bars` bars of the grid (else `seconds` in whole bars), `seconds` off the grid, or endless
    play's ring."""
    if endless:
        return LoopPlan(ring_frames(window_frames(window_s, None), None) * hop, grid)
    if grid is None:
        return LoopPlan(song_frames(seconds, "song_seconds") * hop)
    bars = bars or max(1, round(seconds * rate / grid.bar_samples(rate)))
    return LoopPlan(grid.loop_of_bars(bars, rate, "--bars"), grid, bars)


def source_plan(
    audio: torch.Tensor,
    rate: int,
    out_rate: int,
    hop: int,
    bpm: float | None,
    beats_per_bar: int,
    bars: int | None,
    source_bpm: float | None,
    source_downbeat_s: float | None,
) -> tuple[torch.Tensor, LoopPlan]:
    """A source on the grid: whole bars of it from its first downbeat (its tempo and downbeat given, or estimated),
    at `bpm` (its own tempo when None), every whole bar after the downbeat unless `bars` -> (the audio its latent
    is made of: the loop, its start repeated past its end to whole latent frames, at `out_rate`; the plan)."""
    audio = resample(audio.float(), rate, out_rate).numpy()
    if source_bpm is not None:
        found = SourceGrid(source_bpm, source_downbeat_s or 0.0)
    else:
        found = estimate_source_grid(audio, out_rate, beats_per_bar)
        if source_downbeat_s is not None:
            found = SourceGrid(found.bpm, source_downbeat_s)
    grid = Grid(float(bpm or round(found.bpm, 2)), beats_per_bar)
    available = (audio.shape[1] / out_rate - found.downbeat_s) / (beats_per_bar * 60.0 / found.bpm)
    bars = bars or max(1, math.floor(available + 1e-6))
    grid.loop_of_bars(bars, out_rate, "--bars")  # before the loop is cut: a loop too long is refused, not built
    loop = torch.from_numpy(bars_of_source(audio, out_rate, found, grid.bpm, beats_per_bar, bars))
    log.info(
        "source on the grid: %.2f BPM, first downbeat %.3f s; %d bars at %.2f BPM",
        found.bpm,
        found.downbeat_s,
        bars,
        grid.bpm,
    )
    latent_audio = LoopMap(loop.shape[1], hop, "loop").latent_audio(loop)
    return latent_audio, LoopPlan(loop.shape[1], grid, bars, found)
