"""A source on the grid (engine/audio/beats.py): tempo and first downbeat of a drum track made here, and whole bars
of it from that downbeat, looped and stretched, with every bar's kick on the loop's bar lines."""

import importlib.util
import sys

import numpy as np
import pytest
from flowjam.engine.audio.beats import (
    INSTALL_HINT,
    SourceGrid,
    bars_of_source,
    estimate_source_grid,
    fit_beat_line,
    strongest_phase,
)

RATE = 48_000
needs_librosa = pytest.mark.skipif(
    importlib.util.find_spec("librosa") is None, reason="librosa is not installed (pip install 'flowjam[grid]')"
)


def drum_track(
    bpm: float, beats_per_bar: int, downbeat_s: float, seconds: float, tone_hz: float = 0.0, backbeat: float = 0.2
) -> np.ndarray:
    """Stereo [2, frames]: quiet noise until `downbeat_s`, then a loud low kick (and a click) on every bar's first
    beat and a softer click on the others; `tone_hz` adds a steady sine that a cut in the wrong place would break."""
    rng = np.random.default_rng(7)
    t = np.arange(round(0.25 * RATE)) / RATE
    kick = 0.9 * np.sin(2 * np.pi * (50 * t + 2 * (1 - np.exp(-t * 30)))) * np.exp(-t * 12)
    click = rng.standard_normal(round(0.03 * RATE)) * np.exp(-np.arange(round(0.03 * RATE)) / RATE * 200)
    frames = round(seconds * RATE)
    mono = 0.003 * rng.standard_normal(frames) + 0.2 * np.sin(2 * np.pi * tone_hz * np.arange(frames) / RATE)
    beat = 0
    while (start := round((downbeat_s + beat * 60 / bpm) * RATE)) + kick.size <= mono.size:
        if beat % beats_per_bar == 0:
            mono[start : start + kick.size] += kick
        accent = 0.3 if beat % beats_per_bar == 0 else backbeat if beat % beats_per_bar % 2 else 0.2
        mono[start : start + click.size] += accent * click
        beat += 1
    return np.stack([mono, 0.8 * mono]).astype(np.float32)


def kick_errors_ms(loop: np.ndarray, bpm: float, beats_per_bar: int, bars: int) -> np.ndarray:
    """For each bar line of a loop at `bpm`, how far (ms) the loudest attack within half a beat of it is from it:
    the first sample reaching half that neighbourhood's peak."""
    level = np.abs(loop.mean(axis=0))
    beat_frames = RATE * 60 / bpm
    errors = []
    for bar in range(bars):
        line = bar * beats_per_bar * beat_frames
        low, high = max(0, round(line - beat_frames / 2)), round(line + beat_frames / 2)
        near = level[low:high]
        errors.append((low + np.argmax(near >= near.max() / 2) - line) / RATE * 1000)
    return np.array(errors)


def test_the_beat_line_skips_a_missed_beat_and_ignores_a_stray_one():
    beats = 1.0 + 0.5 * np.array([0, 1, 2, 4, 5, 6, 7, 8])  # beat 3 missed
    beats[5] += 0.1  # beat 6 tracked 0.2 beats late
    first_s, beat_s, indices = fit_beat_line(beats)
    assert (first_s, beat_s) == (pytest.approx(1.0), pytest.approx(0.5)), f"line {first_s} + {beat_s} * beat"
    assert indices.tolist() == [0, 1, 2, 4, 5, 7, 8], "the missed beat leaves a gap; the stray beat is dropped"


def test_the_strongest_phase_is_the_one_the_kick_falls_on():
    assert strongest_phase(np.array([1.0, 3.0, 1.2, 1.0, 1.1, 2.8, 1.0, 0.9, 1.0]), 4) == 1
    assert strongest_phase(np.array([2.0, 1.0, 1.0, 3.0, 1.5, 1.5, 2.5]), 3) == 0  # means 2.5, 1.25, 1.25


@needs_librosa
@pytest.mark.parametrize(
    ("bpm", "beats_per_bar", "downbeat_s", "backbeat"),
    [(97, 4, 0.37, 0.2), (128, 4, 0.37, 0.2), (97, 3, 0.37, 0.2), (128, 3, 0.0, 0.2), (97, 4, 0.37, 0.6)],
    ids=["97 4/4", "128 4/4", "97 3/4", "128 3/4 from frame 0", "97 4/4 loud snare on 2 and 4"],
)
def test_tempo_and_first_downbeat_of_a_drum_track(bpm, beats_per_bar, downbeat_s, backbeat):
    source = drum_track(bpm, beats_per_bar, downbeat_s, 8.0, backbeat=backbeat)
    assert_grid(estimate_source_grid(source, RATE, beats_per_bar), bpm, downbeat_s)


@needs_librosa
def test_a_song_opening_on_a_lone_kick_starts_there():
    bpm, downbeat_s = 156.5, 0.089
    source = drum_track(bpm, 4, downbeat_s, 7.7)
    source[:, round((downbeat_s + 0.05) * RATE) : round((downbeat_s + 4 * 60 / bpm - 0.01) * RATE)] *= 0.1
    assert_grid(estimate_source_grid(source, RATE, 4), bpm, downbeat_s)


def assert_grid(grid: SourceGrid, bpm: float, downbeat_s: float) -> None:
    """The tempo within 0.5 BPM, the first downbeat within 20 ms before the kick's attack (a cut there keeps it)."""
    assert abs(grid.bpm - bpm) <= 0.5, f"tempo {grid.bpm:.3f}, made at {bpm}"
    error_ms = (grid.downbeat_s - downbeat_s) * 1000
    assert -20 <= error_ms <= 2, f"first downbeat {error_ms:+.1f} ms from the first kick's attack"


@needs_librosa
@pytest.mark.parametrize("bpm", [97.0, 120.0])
def test_bars_of_source_put_every_kick_on_a_bar_line(bpm):
    source = drum_track(97, 4, 0.37, 12.0)
    loop = bars_of_source(source, RATE, SourceGrid(97, 0.37), bpm, 4, 4)
    assert loop.shape == (2, round(4 * 4 * RATE * 60 / bpm)), f"{loop.shape[-1]} frames, not whole bars at {bpm}"
    assert loop.dtype == np.float32, loop.dtype
    errors = kick_errors_ms(loop, bpm, 4, 4)
    assert np.abs(errors).max() <= 5, f"kicks off their bar lines by {np.round(errors, 2)} ms"


@needs_librosa
@pytest.mark.parametrize("bpm", [97.0, 120.0])
def test_a_source_shorter_than_the_loop_repeats_its_whole_bars(bpm):
    source = drum_track(97, 3, 0.37, 0.37 + 2 * 3 * 60 / 97 + 0.1)  # two bars and a little
    loop = bars_of_source(source, RATE, SourceGrid(97, 0.37), bpm, 3, 5)
    assert loop.shape == (2, round(5 * 3 * RATE * 60 / bpm)), f"{loop.shape[-1]} frames, not whole bars at {bpm}"
    errors = kick_errors_ms(loop, bpm, 3, 5)
    assert np.abs(errors).max() <= 5, f"kicks off their bar lines by {np.round(errors, 2)} ms"


def test_the_loop_wraps_into_its_downbeat_without_a_jump():
    source = drum_track(97, 4, 0.37, 8.0, tone_hz=233.0)  # 576.5 cycles of the tone in a bar: cut, it jumps
    loop = bars_of_source(source, RATE, SourceGrid(97, 0.37), 97, 4, 1)
    assert_no_jump(loop[:, -1], loop[:, 0], "the wrap")


def test_a_short_sources_repeats_join_without_a_jump():
    source = drum_track(97, 4, 0.37, 0.37 + 4 * 60 / 97 + 0.1, tone_hz=233.0)  # one bar and a little
    loop = bars_of_source(source, RATE, SourceGrid(97, 0.37), 97, 4, 3)
    for repeat in (1, 2):
        join = round(repeat * 4 * 60 / 97 * RATE)
        assert_no_jump(loop[:, join - 1], loop[:, join], f"repeat {repeat}")


def assert_no_jump(before: np.ndarray, after: np.ndarray, where: str) -> None:
    """No step between two neighbouring frames larger than the steady tone's steepest (and the noise's) allows."""
    step = np.abs(after - before).max()
    assert step <= 3 * 0.2 * 2 * np.pi * 233 / RATE + 0.02, f"{where} jumps by {step:.3f}: a click"


def test_a_missing_library_names_the_extra_and_the_flags(monkeypatch):
    monkeypatch.setitem(sys.modules, "librosa", None)  # `import librosa` fails as if it were not installed
    source = drum_track(120, 4, 0.0, 2.0)
    with pytest.raises(ValueError) as error:
        estimate_source_grid(source, RATE, 4)
    assert str(error.value).endswith(
        "needs librosa: pip install 'flowjam[grid]' (librosa), or give --source-bpm and --source-downbeat"
    ), error.value
    with pytest.raises(ValueError) as error:
        bars_of_source(source, RATE, SourceGrid(120, 0.0), 100, 4, 1)
    assert f"{INSTALL_HINT}, or give --bpm 120, the source's tempo" in str(error.value), error.value


@needs_librosa
@pytest.mark.parametrize(
    ("audio", "message"),
    [
        (np.zeros((2, 5 * RATE), np.float32), "silent.*--source-bpm and --source-downbeat"),
        (drum_track(97, 4, 0.2, 1.5), "two bars of steady beat: give --source-bpm and --source-downbeat"),
    ],
    ids=["silence", "too short"],
)
def test_a_source_without_a_grid_to_find_names_the_flags(audio, message):
    with pytest.raises(ValueError, match=message):
        estimate_source_grid(audio, RATE, 4)


@pytest.mark.parametrize(
    ("bpm", "bars", "grid", "message"),
    [
        (20.0, 2, (97, 0.37), "the loop's bpm must be a number in 30..300.*--bpm"),
        (float("nan"), 2, (97, 0.37), "--bpm"),
        (97.0, 0, (97, 0.37), "bars must be a whole number of at least 1.*--bars"),
        (97.0, 2, (97, 9.0), "past its end.*--source-downbeat"),
        (97.0, 2, (97, 3.5), "0.20 of a bar after its first downbeat, too little to loop.*--source-downbeat"),
        (97.0, 2, (301, 0.37), "the source's bpm must be.*--source-bpm"),
    ],
    ids=["slow loop", "nan loop bpm", "no bars", "downbeat past the end", "under a bar", "fast source"],
)
def test_bars_of_source_refuses_what_it_cannot_cut(bpm, bars, grid, message):
    with pytest.raises(ValueError, match=message):
        bars_of_source(drum_track(97, 4, 0.37, 4.0), RATE, SourceGrid(*grid), bpm, 4, bars)
