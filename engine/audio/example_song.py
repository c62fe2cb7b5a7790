"""A short song synthesized in code, for examples that need music and no file: a I-V-vi-IV progression in C major
(one chord a bar, 4/4) with a pad, a bass note on every beat, an eighth-note arpeggio, a kick and a hi-hat.
Deterministic, and a seamless loop: a note ringing past the end goes on at the start."""

from __future__ import annotations

import numpy as np

# (bass note, pad triad) per bar as MIDI note numbers: C, G, Am, F, voiced close together
CHORDS = ((36, (60, 64, 67)), (43, (59, 62, 67)), (45, (57, 60, 64)), (41, (57, 60, 65)))
PAD_EDGE_S = 0.02  # each bar's pad chord fades in and out over this at the bar lines (no click between chords)


def example_song(bars: int, bpm: float, sample_rate: int) -> np.ndarray:
    """float32 [2, N], N = `bars` bars of 4 beats at `bpm`; peak 0.8."""
    beat = round(60.0 / bpm * sample_rate)  # samples
    t = np.arange(bars * 4 * beat) / sample_rate
    hit = np.random.default_rng(0).uniform(-1.0, 1.0, t.size) * np.exp(-t / 0.03)
    kick = _ring(_kick(t), range(0, t.size, 2 * beat))
    hat = _ring(hit, range(beat // 2, t.size, beat))
    pad = bass = arpeggio = np.zeros(t.size)
    for bar in range(bars):
        bass_note, triad = CHORDS[bar % len(CHORDS)]
        start = bar * 4 * beat
        since = t - start / sample_rate  # seconds into this bar (negative before it)
        inside = np.clip(np.minimum(since, 4 * beat / sample_rate - since) / PAD_EDGE_S, 0.0, 1.0)
        pad = pad + sum(_tone(note, t) for note in triad) * inside
        bass = bass + _ring(_tone(bass_note, t) * np.exp(-t / 0.4), range(start, start + 4 * beat, beat))
        for offset, note in enumerate(triad):
            arpeggio = arpeggio + _ring(
                _tone(note + 12, t) * np.exp(-t / 0.18),
                range(start + offset * beat // 2, start + 4 * beat, 3 * beat // 2),
            )
    left = 0.5 * pad + 0.7 * bass + 0.3 * arpeggio + 0.8 * kick + 0.08 * hat
    right = 0.4 * pad + 0.7 * bass + 0.45 * arpeggio + 0.8 * kick + 0.12 * hat
    audio = np.stack([left, right])
    return (0.8 * audio / np.abs(audio).max()).astype(np.float32)


def _ring(note: np.ndarray, starts: range) -> np.ndarray:
    """`note` (sounding from sample 0) played at each of `starts`, a tail past the end going on at the start."""
    return sum((np.roll(note, start) for start in starts), np.zeros(note.size))


def _tone(note: int, t: np.ndarray) -> np.ndarray:
    """The note's fundamental and a quieter octave."""
    phase = 2 * np.pi * 440.0 * 2 ** ((note - 69) / 12) * t
    return np.sin(phase) + 0.3 * np.sin(2 * phase)


def _kick(since: np.ndarray) -> np.ndarray:
    """A sine gliding from 110 Hz down to 45 Hz (f = 45 + 65 exp(-t / 40 ms), its phase integrated exactly)."""
    phase = 2 * np.pi * (45 * since + 65 * 0.04 * (1 - np.exp(-since / 0.04)))
    return np.sin(phase) * np.exp(-since / 0.15)
