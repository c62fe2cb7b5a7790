"""A 10-minute 44.1 kHz stereo song as --cover, in FLAC and in MP3: a render reads only the part it uses, peak memory
stays under 2 GB, and the engine hears the same audio as from the WAV of the song. Peak memory is measured on child
processes (`ru_maxrss`, Linux kilobytes), run as a user runs them."""

import contextlib
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from flowjam.engine.audio.files import SAMPLE_RATE, read_audio, resample
from flowjam.engine.params import MAX_SONG_SECONDS
from flowjam.engine.render import cover_seconds

SONG_RATE = 44_100
SONG_SECONDS = 600
BAR_SECONDS = 2
CHORDS_HZ = ((220.0, 277.18, 329.63), (196.0, 246.94, 293.66), (174.61, 220.0, 261.63), (164.81, 207.65, 246.94))
PEAK_RSS = (  # runs the command given after it and prints its peak resident memory (kB) as the last line
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)"
)
READ_AND_RESAMPLE = (  # FILE SECONDS: what the session gets of a cover that a render reads
    "import sys; from flowjam.engine.audio.files import read_audio, resample; "
    "audio, rate = read_audio(sys.argv[1], float(sys.argv[2])); resample(audio, rate, 48_000)"
)


def bars() -> list[np.ndarray]:
    """[frames, 2] 16-bit samples of each bar: a struck chord of A, G, F or E, the right channel detuned a little.
    Whole 16-bit values, so the WAV and the FLAC hold the very same samples."""
    t = np.arange(SONG_RATE * BAR_SECONDS) / SONG_RATE
    envelope = np.minimum(1.0, t * 50) * np.exp(-t)
    return [
        np.round(
            np.stack([sum(np.sin(2 * np.pi * f * detune * t) for f in chord) for detune in (1.0, 1.002)], axis=1)
            * envelope[:, None]
            / 4
            * 32767
        ).astype(np.int16)
        for chord in CHORDS_HZ
    ]


@pytest.fixture(scope="module")
def song(tmp_path_factory) -> dict[str, Path]:
    """The same 10-minute song as 16-bit WAV, 16-bit FLAC and MP3, written bar by bar. The MP3 encoder is given
    floats: libsndfile 1.2.2 garbles 16-bit stereo on the way to MP3 (libsndfile pull request 1106)."""
    folder = tmp_path_factory.mktemp("song")
    paths = {kind: folder / f"song.{kind}" for kind in ("wav", "flac", "mp3")}
    chords = bars()
    with contextlib.ExitStack() as files:
        writers = {
            kind: files.enter_context(soundfile.SoundFile(path, "w", SONG_RATE, 2)) for kind, path in paths.items()
        }
        for index in range(SONG_SECONDS // BAR_SECONDS):
            samples = chords[index % len(chords)]
            writers["wav"].write(samples)
            writers["flac"].write(samples)
            writers["mp3"].write(samples / np.float32(32768))
    return paths


def peak_rss_gb(arguments: list[str]) -> float:
    """Run `arguments` in a child process; its peak resident memory in GB (the test fails if it fails)."""
    result = subprocess.run([sys.executable, "-c", PEAK_RSS, *arguments], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{' '.join(arguments)} failed:\n{result.stderr}"
    return int(result.stdout.splitlines()[-1]) / 1e6


def each_in_parallel(function: Callable[[str], float], items: list[str]) -> dict[str, float]:
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(items, pool.map(function, items)))


def test_ten_minute_flac_and_mp3_covers_render_in_under_2_gb(song, tmp_path):
    def render(kind: str) -> float:
        out = tmp_path / f"cover-of-{kind}.wav"
        peak = peak_rss_gb(
            [sys.executable, "-m", "flowjam", "render", "--prompt", "jazz cover", "--cover", str(song[kind])]
            + ["--denoise", "0.6", "--seconds", "4", "--out", str(out)]
        )
        audio, rate = read_audio(out)
        assert rate == SAMPLE_RATE and audio.shape == (2, 4 * SAMPLE_RATE), f"{kind}: {tuple(audio.shape)}"
        return peak

    peaks = each_in_parallel(render, ["flac", "mp3"])
    print(f"peak RSS of `flowjam render --cover` a 10-minute song: {peaks}")
    for kind, peak in peaks.items():
        assert peak < 2.0, f"rendering 4 s over a 10-minute {kind} peaked at {peak:.2f} GB of memory"


def test_the_longest_cover_a_render_reads_resamples_in_under_2_gb(song):
    seconds = str(cover_seconds(MAX_SONG_SECONDS))
    peaks = each_in_parallel(
        lambda kind: peak_rss_gb([sys.executable, "-c", READ_AND_RESAMPLE, str(song[kind]), seconds]), ["flac", "mp3"]
    )
    print(f"peak RSS reading and resampling all 10 minutes: {peaks}")
    for kind, peak in peaks.items():
        assert peak < 2.0, f"reading and resampling a 10-minute {kind} peaked at {peak:.2f} GB of memory"


def test_a_source_at_44101_hz_resamples_in_bounded_memory(tmp_path):
    path = tmp_path / "odd-rate.wav"
    t = np.arange(44_101 * 60) / 44_101
    soundfile.write(path, np.stack([np.sin(2 * np.pi * 440 * t)] * 2, axis=1) * 0.5, 44_101)
    peak = peak_rss_gb([sys.executable, "-c", READ_AND_RESAMPLE, str(path), "60"])
    assert peak < 1.0, f"resampling a minute at 44,101 Hz to 48 kHz peaked at {peak:.2f} GB of memory"


def at_48k(path: Path, seconds: float) -> torch.Tensor:
    audio, rate = read_audio(path, seconds)
    return resample(audio, rate, SAMPLE_RATE)


def test_flac_and_mp3_give_the_engine_the_same_audio_as_the_wav(song):
    wav = at_48k(song["wav"], 20.0)
    assert wav.shape == (2, 20 * SAMPLE_RATE) and wav.std() > 0.05, "the song is missing or silent"
    assert torch.equal(at_48k(song["flac"], 20.0), wav), "FLAC is lossless: it must give exactly the WAV's samples"
    mp3 = at_48k(song["mp3"], 20.0)
    lag = offset(mp3[0], wav[0], search=2_000)
    assert abs(lag) < 50, f"the MP3 is {lag} samples off the WAV (the encoder delay was not taken off)"
    margin = 4_800  # away from both ends, where the codec and the resampler start and stop
    aligned, reference = mp3[:, margin:-margin], wav[:, margin + lag : wav.shape[-1] - margin + lag]
    snr_db = 10 * torch.log10(reference.pow(2).mean() / (aligned - reference).pow(2).mean()).item()
    assert snr_db > 20, f"the MP3 is only {snr_db:.1f} dB above its difference from the WAV"


def offset(audio: torch.Tensor, reference: torch.Tensor, search: int) -> int:
    """The lag (within +-`search` samples) at which the second around the second bar's strike in `audio` best matches
    `reference`: audio[n] is reference[n + lag]. (A held chord repeats itself; the strike does not.)"""
    strike = BAR_SECONDS * SAMPLE_RATE
    second = audio[strike - SAMPLE_RATE // 2 : strike + SAMPLE_RATE // 2].numpy()
    around = reference[strike - SAMPLE_RATE // 2 - search : strike + SAMPLE_RATE // 2 + search].numpy()
    return int(np.argmax(np.correlate(around, second, "valid"))) - search
