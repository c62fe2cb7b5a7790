"""A source song on the grid: its tempo and first downbeat estimated with librosa (`estimate_source_grid`), and
whole bars of it from that downbeat, looped and time-stretched to the loop's tempo (`bars_of_source`). Audio is
float32 [channels, frames]; librosa is imported only when a function needs it (pip install 'flowjam[grid]')."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..prompts import BPM_RANGE, check_bpm, time_signature_numerator

INSTALL_HINT = "pip install 'flowjam[grid]' (librosa)"
# estimating the grid
_LEAD_S = 0.1  # silence put before the source for the analysis
_SILENT_PEAK = 1e-4  # a source whose mono mix never reaches this has no beat to find
_HOP_S = 0.005  # onset envelope frames
_LOW_HZ = 200  # the mel bands of kicks and bass notes, whose onsets mark bar 1
_PEAK_WINDOW_S = 0.012  # an onset is read as the envelope's peak within this of a grid beat
_OUTLIER_BEATS = 1 / 8  # a tracked beat this far off the fitted line (in beats) is left out of the fit
_QUIET_SHARE = 0.5  # the grid reaches back before the first tracked beat while the beats there are this strong
_ATTACK_HOP_S = 0.001  # the step of the energy frames in which a downbeat's attack is found
_ATTACK_FRAME_S = 0.020  # their length: a period of 50 Hz, so a kick or a bass note has no energy dip inside it
_ATTACK_BEATS = 1 / 4  # the downbeat moves back to its attack's start by at most this much of a beat
# cutting bars
_SEAM_S = 0.010  # the loop's wrap (and every repeat of a short source) is crossfaded over this long
_STRETCH_MIN_BPM = 0.01  # a source this close to the loop's tempo is cut, not stretched
_STRETCH_FRAME_S = 0.020  # the phase vocoder's frames (rounded to a power of two of samples)


@dataclass(frozen=True)
class SourceGrid:
    """A source's tempo and the time of its first downbeat (bar 1, beat 1) in seconds from its start."""

    bpm: float
    downbeat_s: float

    def __post_init__(self):
        _check_bpm(self.bpm, "the source's bpm", "--source-bpm")
        if not (isinstance(self.downbeat_s, int | float) and math.isfinite(self.downbeat_s) and self.downbeat_s >= 0):
            raise ValueError(f"the source's first downbeat must be 0 s or later, got {self.downbeat_s!r}")


def estimate_source_grid(audio: np.ndarray, rate: int, beats_per_bar: int) -> SourceGrid:
    """The tempo of a steady-beat source (a line fitted through librosa's tracked beats, so a missed or stray beat
    does not bend it) and its first downbeat: of the `beats_per_bar` phases of the beat, the one with the strongest
    low-frequency onsets (the kick, a new bass note), at its earliest beat, moved back to just before that beat's
    attack so a cut there keeps it. librosa favours tempi near 120 BPM: a fast song (above about 170) can come out
    at half its tempo, and a kick on beats 1 and 3 alike leaves bar 1 and beat 3 to chance; --source-bpm and
    --source-downbeat set them."""
    librosa = import_librosa(
        "estimating a source's tempo and first downbeat", "give --source-bpm and --source-downbeat"
    )
    beats_per_bar = time_signature_numerator(beats_per_bar)
    _check_source(audio, rate)
    mono = audio.astype(np.float32).mean(axis=0)
    if np.abs(mono).max() < _SILENT_PEAK:
        raise ValueError("the source is silent: no beats to find; give --source-bpm and --source-downbeat")
    mono = np.pad(mono, (round(_LEAD_S * rate), 0))  # an attack on the source's first frame shows as an onset
    hop = max(1, round(rate * _HOP_S))
    onset, low_onset = _onset_envelopes(librosa, mono, rate, hop)
    _, beat_frames = librosa.beat.beat_track(onset_envelope=onset, sr=rate, hop_length=hop)
    if len(beat_frames) < 2 * beats_per_bar:
        raise ValueError(
            f"found {len(beat_frames)} beats in the source ({audio.shape[-1] / rate:.1f} s); estimating its grid "
            "needs at least two bars of steady beat: give --source-bpm and --source-downbeat"
        )
    first_beat_s, beat_s, indices = fit_beat_line(librosa.frames_to_time(beat_frames, sr=rate, hop_length=hop))
    bpm = 60.0 / beat_s
    if not BPM_RANGE[0] <= bpm <= BPM_RANGE[1]:
        raise ValueError(
            f"the source's tempo came out at {bpm:.1f} BPM, outside {BPM_RANGE[0]}..{BPM_RANGE[1]}: "
            "give --source-bpm and --source-downbeat"
        )
    peaks = _onset_peaks(onset, rate / hop, first_beat_s, beat_s)
    first = _first_strong_beat(peaks, first_beat_s, beat_s, indices, _LEAD_S - _PEAK_WINDOW_S)
    low_peaks = _onset_peaks(low_onset, rate / hop, first_beat_s, beat_s)
    phase = strongest_phase(low_peaks(np.arange(first, indices[-1] + 1)), beats_per_bar)
    attack_s = _attack_s(librosa, mono, rate, first_beat_s + beat_s * (first + phase), beat_s)
    return SourceGrid(bpm=bpm, downbeat_s=max(0.0, attack_s - _LEAD_S))


def fit_beat_line(beat_times_s: np.ndarray) -> tuple[float, float, np.ndarray]:
    """(time of beat 0 in s, seconds per beat, each tracked beat's index) of the least-squares line through beat
    times against beat index. Indices count from the first beat in steps of the median gap, so a missed beat
    leaves a gap of two; beats more than an eighth of a beat off the first line are left out of the second."""
    times = np.asarray(beat_times_s, dtype=np.float64)
    indices = np.round((times - times[0]) / np.median(np.diff(times))).astype(np.int64)
    beat_s, first_s = np.polyfit(indices, times, 1)
    on_line = np.abs(times - (first_s + beat_s * indices)) <= _OUTLIER_BEATS * beat_s
    beat_s, first_s = np.polyfit(indices[on_line], times[on_line], 1)
    return float(first_s), float(beat_s), indices[on_line]


def strongest_phase(strengths: np.ndarray, beats_per_bar: int) -> int:
    """Which of the `beats_per_bar` phases of consecutive beats' onset `strengths` (0: the first beat's; a bar or
    more of them) is strongest on average: the downbeat's, where the kick falls."""
    means = [np.mean(strengths[phase::beats_per_bar]) for phase in range(beats_per_bar)]
    return int(np.argmax(means))


def bars_of_source(
    audio: np.ndarray, rate: int, grid: SourceGrid, bpm: float, beats_per_bar: int, bars: int
) -> np.ndarray:
    """`bars` bars of the source from its first downbeat (whole bars of it repeated when it is shorter), at `bpm`:
    float32 [channels, round(bars * beats_per_bar * rate * 60 / bpm)], bar 1 at frame 0. A tempo more than 0.01 BPM
    from the source's is reached with librosa's phase vocoder (pitch kept; transients soften a little). The end
    crossfades (sin², equal gain, 10 ms) into what precedes the downbeat, so the loop wraps without a click."""
    _check_source(audio, rate)
    _check_bpm(bpm, "the loop's bpm", "--bpm")
    beats_per_bar = time_signature_numerator(beats_per_bar)
    if isinstance(bars, bool) or not isinstance(bars, int) or bars < 1:
        raise ValueError(f"bars must be a whole number of at least 1, got {bars!r}: give --bars 1 or more")
    start = round(grid.downbeat_s * rate)
    if start >= audio.shape[-1]:
        raise ValueError(
            f"the source's first downbeat at {grid.downbeat_s:.3f} s is past its end ({audio.shape[-1] / rate:.3f} "
            "s): give a --source-downbeat inside the source"
        )
    loop_frames = round(bars * beats_per_bar * rate * 60 / bpm)
    seam_frames = max(1, round(_SEAM_S * rate))
    preroll = _preroll(audio, start, seam_frames)
    bar_frames = beats_per_bar * rate * 60 / grid.bpm
    if abs(bpm - grid.bpm) <= _STRETCH_MIN_BPM:
        body = _repeated_bars(audio, start, bar_frames, loop_frames, preroll)
    else:
        task = f"stretching the source from {grid.bpm:g} to {bpm:g} BPM"
        librosa = import_librosa(task, f"give --bpm {grid.bpm:g}, the source's tempo")
        speed = bpm / grid.bpm
        body = _repeated_bars(audio, start, bar_frames, math.ceil(loop_frames * speed) + seam_frames, preroll)
        body = _stretched(librosa, body, rate, speed)
    return _fade_into(body[:, :loop_frames], preroll).astype(np.float32)


def import_librosa(task: str, instead: str):
    """librosa, or a ValueError saying that `task` needs it: install the extra, or `instead` (flags that avoid it)."""
    try:
        import librosa
    except ImportError:
        raise ValueError(f"{task} needs librosa: {INSTALL_HINT}, or {instead}") from None
    return librosa


def _equal_gain_ramps(length: int) -> tuple[np.ndarray, np.ndarray]:
    """(fade_out, fade_in) of `length` samples, cos² and sin², summing to 1 (constant gain for correlated audio)."""
    fade_in = np.sin((np.arange(length) + 0.5) / length * (math.pi / 2)) ** 2
    return (1.0 - fade_in).astype(np.float32), fade_in.astype(np.float32)


def _stretched(librosa, audio: np.ndarray, rate: int, speed: float) -> np.ndarray:
    """Each channel played `speed` times as fast at the same pitch by librosa's phase vocoder, in frames of about
    20 ms: long enough for a bass note's pitch, short enough that a kick's attack stays within a few milliseconds."""
    n_fft = 2 ** round(math.log2(_STRETCH_FRAME_S * rate))
    return np.stack([librosa.effects.time_stretch(channel, rate=speed, n_fft=n_fft) for channel in audio])


def _check_bpm(bpm: float, what: str, flag: str) -> None:
    """A ValueError naming `flag` unless `bpm` is a finite number in the range the model knows."""
    try:
        check_bpm(bpm, what)
    except ValueError as error:
        raise ValueError(f"{error}: give {flag} in it") from None


def _check_source(audio: np.ndarray, rate: int) -> None:
    """A ValueError unless `audio` is a finite numpy [channels, frames] array with some frames, at a positive rate."""
    if isinstance(rate, bool) or not isinstance(rate, int) or rate <= 0:
        raise ValueError(f"rate must be a positive whole number of Hz, got {rate!r}")
    if not isinstance(audio, np.ndarray) or audio.ndim != 2 or audio.shape[0] < 1 or audio.shape[1] < 1:
        shape = getattr(audio, "shape", type(audio).__name__)
        raise ValueError(f"the source must be a numpy array [channels, frames], got {shape}")
    if not np.isfinite(audio).all():
        raise ValueError("the source contains NaN or infinite samples: export it again")


def _onset_envelopes(librosa, mono: np.ndarray, rate: int, hop: int) -> tuple[np.ndarray, np.ndarray]:
    """librosa's onset strength in `hop`-frame steps over all mel bands (for the beat) and over those below 200 Hz
    (for the downbeat: a kick or a bass note changes them, a snare or a hi-hat hardly)."""
    mel_db = librosa.power_to_db(librosa.feature.melspectrogram(y=mono, sr=rate, hop_length=hop))
    centres_hz = librosa.mel_frequencies(n_mels=mel_db.shape[0] + 2, fmax=rate / 2)[1:-1]
    low_bands = max(1, int(np.sum(centres_hz < _LOW_HZ)))
    onset = librosa.onset.onset_strength(S=mel_db, sr=rate, hop_length=hop)
    return onset, librosa.onset.onset_strength(S=mel_db[:low_bands], sr=rate, hop_length=hop)


def _onset_peaks(onset: np.ndarray, frame_rate_hz: float, first_beat_s: float, beat_s: float):
    """A function from beat indices on the fitted line to the onset envelope's peak around each of those beats."""
    reach = max(1, round(_PEAK_WINDOW_S * frame_rate_hz))

    def peaks(indices: np.ndarray) -> np.ndarray:
        centres = np.round((first_beat_s + beat_s * np.asarray(indices)) * frame_rate_hz).astype(np.int64)
        return np.array([onset[max(0, c - reach) : max(0, c + reach + 1)].max(initial=0.0) for c in centres])

    return peaks


def _first_strong_beat(peaks, first_beat_s: float, beat_s: float, indices: np.ndarray, earliest_s: float) -> int:
    """The index of the earliest beat of the source's steady part: beat tracking drops leading beats, so the line
    is followed back from the first tracked beat while its beats come at `earliest_s` or later and are as strong as
    half the tracked beats' median."""
    floor = _QUIET_SHARE * np.median(peaks(indices))
    first = int(indices[0])
    while first_beat_s + beat_s * (first - 1) >= earliest_s and peaks(np.array([first - 1]))[0] >= floor:
        first -= 1
    return first


def _attack_s(librosa, mono: np.ndarray, rate: int, beat_time_s: float, beat_s: float) -> float:
    """Where the attack of the beat that the onset envelope puts at `beat_time_s` (a few milliseconds into the
    attack, where a cut would clip the kick) starts: the end of the last energy frame before it, found as the
    nearest energy minimum before the beat (librosa.onset.onset_backtrack), at most a quarter beat back."""
    hop = max(1, round(rate * _ATTACK_HOP_S))
    frame = 2 * round(rate * _ATTACK_FRAME_S / 2)
    energy = librosa.feature.rms(y=mono, frame_length=frame, hop_length=hop)[0]
    beat_frame = min(round(beat_time_s * rate / hop), energy.size - 1)
    quiet_frame = int(librosa.onset.onset_backtrack(np.array([beat_frame]), energy)[0])
    attack_s = (quiet_frame * hop + frame // 2) / rate  # frames are centred: the quiet one ends half a frame on
    return min(beat_time_s, max(attack_s, beat_time_s - _ATTACK_BEATS * beat_s))


def _preroll(audio: np.ndarray, start: int, frames: int) -> np.ndarray:
    """The `frames` frames before `start` (silence where the source has none): what the loop's end fades into."""
    available = audio[:, max(0, start - frames) : start].astype(np.float32)
    return np.pad(available, ((0, 0), (frames - available.shape[-1], 0)))


def _fade_into(block: np.ndarray, preroll: np.ndarray) -> np.ndarray:
    """`block` with its last frames crossfaded into `preroll`, so it runs on into the downbeat that follows it."""
    frames = min(preroll.shape[-1], block.shape[-1])
    fade_out, fade_in = _equal_gain_ramps(frames)
    faded = block.astype(np.float32)  # a copy
    faded[:, -frames:] = faded[:, -frames:] * fade_out + preroll[:, -frames:] * fade_in
    return faded


def _repeated_bars(audio: np.ndarray, start: int, bar_frames: float, length: int, preroll: np.ndarray) -> np.ndarray:
    """`length` frames of the source from `start`; where it runs out, its whole bars from `start` again, each repeat
    starting on the nearest frame to its exact bar line (no drift) and the one before it faded into the downbeat."""
    if audio.shape[-1] - start >= length:
        return audio[:, start : start + length].astype(np.float32)
    whole_bars = math.floor((audio.shape[-1] - start) / bar_frames)
    if whole_bars < 1:
        raise ValueError(
            f"the source has {(audio.shape[-1] - start) / bar_frames:.2f} of a bar after its first downbeat, too "
            "little to loop: give a longer source or an earlier --source-downbeat"
        )
    repeat_frames = whole_bars * bar_frames
    bounds = [round(repeat * repeat_frames) for repeat in range(math.ceil(length / repeat_frames) + 1)]
    repeats = [_fade_into(audio[:, start : start + end - begin], preroll) for begin, end in zip(bounds, bounds[1:])]
    return np.concatenate(repeats, axis=-1)[:, :length]
