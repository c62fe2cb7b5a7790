"""Audio files in (WAV of every common encoding, FLAC, OGG/Vorbis, MP3), 16-bit WAV out, and resampling with soxr."""

import math
import struct

import numpy as np
import pytest
import soundfile
import torch
from flowjam.engine.audio.files import check_audio, read_audio, resample, write_wav


def test_pcm16_round_trip(tmp_path):
    audio = torch.linspace(-1, 1, 2000).reshape(2, 1000)
    back, rate = read_audio(write_wav(tmp_path / "a.wav", audio, 48_000))
    assert rate == 48_000 and back.shape == (2, 1000)
    assert (back - audio).abs().max() < 1 / 16_000


def raw_wav(path, tag, bits, channels, data: bytes, rate=22_050, block=None, fmt_bytes=16, data_size=None):
    """A WAV written field by field; `rate`, `fmt_bytes` (fmt chunk length) and `data_size` (the data chunk's
    declared size) can be set to wrong values to build malformed files."""
    block = channels * bits // 8 if block is None else block
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block % 2**32, block, bits)[:fmt_bytes]
    path.write_bytes(
        b"RIFF"
        + struct.pack("<I", 20 + len(fmt) + len(data))
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", len(data) if data_size is None else data_size)
        + data
    )
    return path


def test_float32_and_24_bit_files_decode_exactly(tmp_path):
    frames = np.array([[0.5, -0.25], [-1.0, 0.75]], dtype="<f4")  # [frames, channels]
    audio, rate = read_audio(raw_wav(tmp_path / "f.wav", 3, 32, 2, frames.tobytes()))
    assert rate == 22_050 and torch.equal(audio, torch.from_numpy(frames.T.copy()))
    one_frame = (1 << 22).to_bytes(3, "little", signed=True) + (-(1 << 23)).to_bytes(3, "little", signed=True)
    audio24, _ = read_audio(raw_wav(tmp_path / "p.wav", 1, 24, 2, one_frame))
    assert audio24.flatten().tolist() == [0.5, -1.0]


def chord(rate: int, seconds: float) -> np.ndarray:
    """[frames, 2] float32: an A major chord, the right channel a little detuned."""
    t = np.arange(round(rate * seconds)) / rate
    left = sum(np.sin(2 * np.pi * f * t) for f in (220.0, 277.18, 329.63)) / 4
    right = sum(np.sin(2 * np.pi * f * 1.002 * t) for f in (220.0, 277.18, 329.63)) / 4
    return np.stack([left, right], axis=1).astype(np.float32)


FORMATS = {  # name -> (soundfile format, subtype, largest sample error after decoding)
    "WAV 8-bit": ("WAV", "PCM_U8", 1 / 100),
    "WAV 16-bit": ("WAV", "PCM_16", 1e-4),
    "WAV 24-bit": ("WAV", "PCM_24", 1e-6),
    "WAV 32-bit": ("WAV", "PCM_32", 1e-6),
    "WAV float": ("WAV", "FLOAT", 0.0),
    "WAV double": ("WAV", "DOUBLE", 0.0),
    "WAV mu-law": ("WAV", "ULAW", 1 / 30),
    "WAVE_FORMAT_EXTENSIBLE 24-bit": ("WAVEX", "PCM_24", 1e-6),
    "RF64 16-bit": ("RF64", "PCM_16", 1e-4),
    "FLAC 16-bit": ("FLAC", "PCM_16", 1e-4),
    "FLAC 24-bit": ("FLAC", "PCM_24", 1e-6),
    "OGG/Vorbis": ("OGG", "VORBIS", None),  # lossy: compared by signal-to-noise ratio
    "MP3": ("MP3", "MPEG_LAYER_III", None),
}


@pytest.mark.parametrize("name", FORMATS)
def test_every_format_reads_the_chord_that_was_written(name, tmp_path):
    container, subtype, tolerance = FORMATS[name]
    written = chord(44_100, 2.0)
    path = tmp_path / f"chord.{'ogg' if container == 'OGG' else container.lower()}"
    soundfile.write(path, written, 44_100, format=container, subtype=subtype)
    audio, rate = read_audio(path)
    assert rate == 44_100 and audio.shape == (2, len(written)), f"{name}: {tuple(audio.shape)} at {rate} Hz"
    if tolerance is not None:
        error = (audio - torch.from_numpy(written.T)).abs().max().item()
        assert error <= tolerance, f"{name}: samples off by up to {error:.2g}"
    else:
        middle = slice(4_410, -4_410)  # away from the codec's first and last frames
        noise = (audio[:, middle] - torch.from_numpy(written.T)[:, middle]).pow(2).mean()
        snr_db = 10 * math.log10(torch.from_numpy(written.T)[:, middle].pow(2).mean() / noise)
        assert snr_db > 20, f"{name}: the decoded chord is {snr_db:.1f} dB above its difference from the original"


def test_only_the_seconds_asked_for_are_read_and_they_are_the_start(tmp_path):
    path = tmp_path / "song.flac"
    soundfile.write(path, chord(44_100, 5.0), 44_100)
    whole, _ = read_audio(path)
    head, rate = read_audio(path, seconds=1.5)
    assert rate == 44_100 and head.shape == (2, 66_150)
    assert torch.equal(head, whole[:, :66_150])
    assert read_audio(path, seconds=60.0)[0].shape == whole.shape, "asking for more than the file holds reads it all"


def test_a_file_that_is_not_audio_names_the_formats_we_read(tmp_path):
    for name, content in (("notes.mp3", b"ID3 this is an mp3"), ("notes.wav", b"plain text, not audio" * 10)):
        path = tmp_path / name
        path.write_bytes(content)
        with pytest.raises(ValueError, match="is not an audio file we read; give WAV, FLAC, OGG/Vorbis or MP3"):
            check_audio(path)


BAD_WAVS = {  # name -> (raw_wav arguments after the path, what the error says)
    "0 Hz": (dict(tag=1, bits=16, channels=2, data=bytes(400), rate=0), "sample rate 0 Hz"),
    "4,294,967,295 Hz": (dict(tag=1, bits=8, channels=1, data=bytes(400), rate=2**32 - 1), "sample rate 0 Hz or"),
    "800 kHz": (dict(tag=1, bits=16, channels=2, data=bytes(400), rate=800_000), "800,000 Hz is outside 1,000..768"),
    "999 Hz": (dict(tag=1, bits=16, channels=2, data=bytes(400), rate=999), "999 Hz is outside 1,000..768,000 Hz"),
    "short fmt": (dict(tag=1, bits=16, channels=2, data=bytes(400), fmt_bytes=12), "Short 'fmt ' chunk"),
    "0 channels": (dict(tag=1, bits=16, channels=0, data=bytes(400)), "Channel count is zero"),
    "unknown encoding": (dict(tag=0x1234, bits=16, channels=2, data=bytes(400)), "Malformed 'fmt ' chunk"),
    "truncated": (dict(tag=1, bits=16, channels=2, data=bytes(400), data_size=4000), "truncated (400 of 4,000 bytes"),
    "0 frames": (dict(tag=1, bits=16, channels=2, data=b""), "holds no audio (0 frames)"),
}


@pytest.mark.parametrize("name", BAD_WAVS)
def test_malformed_wavs_are_refused_naming_the_file_and_the_problem(name, tmp_path):
    fields, expected = BAD_WAVS[name]
    path = raw_wav(tmp_path / "bad.wav", **fields)
    for check in (read_audio, check_audio):
        with pytest.raises(ValueError) as error:
            check(path)
        assert str(path) in str(error.value) and expected in str(error.value), f"{name}: {error.value}"
        assert "\n" not in str(error.value), f"{name}: the error is more than one line"


@pytest.mark.parametrize("container, subtype", [("FLAC", "PCM_16"), ("MP3", "MPEG_LAYER_III")])
def test_a_compressed_file_cut_short_is_refused_when_its_missing_part_is_read(container, subtype, tmp_path):
    whole = tmp_path / f"whole.{container.lower()}"
    soundfile.write(whole, chord(44_100, 4.0), 44_100, format=container, subtype=subtype)
    cut = tmp_path / f"cut.{container.lower()}"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    assert read_audio(cut, seconds=0.5)[0].shape == (2, 22_050), "the intact start of a cut file is still usable"
    with pytest.raises(ValueError, match="truncated") as error:
        read_audio(cut)
    assert str(cut) in str(error.value) and "export or copy it again" in str(error.value), str(error.value)


def test_a_folder_or_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="is a folder; give an audio file"):
        read_audio(tmp_path)
    with pytest.raises(FileNotFoundError, match="audio file not found"):
        read_audio(tmp_path / "missing.flac")


def test_streamed_wav_with_unknown_data_size_reads_to_the_end(tmp_path):
    frames = np.array([[0.5, -0.25], [-1.0, 0.75]], dtype="<f4")
    audio, _ = read_audio(raw_wav(tmp_path / "pipe.wav", 3, 32, 2, frames.tobytes(), data_size=0xFFFFFFFF))
    assert torch.equal(audio, torch.from_numpy(frames.T.copy()))


def test_write_wav_replaces_the_file_whole(tmp_path):
    path = write_wav(tmp_path / "a.wav", torch.zeros(2, 100))
    old = path.read_bytes()
    with pytest.raises(ValueError, match="NaN"):
        write_wav(path, torch.full((2, 100), float("nan")))
    assert path.read_bytes() == old, "a refused write must leave the previous file as it was"
    write_wav(path, torch.zeros(2, 50))
    assert read_audio(path)[0].shape == (2, 50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"], "a temporary file was left behind"


@pytest.mark.parametrize("src, dst", [(44_100, 48_000), (48_000, 44_100), (16_000, 48_000), (44_101, 48_000)])
def test_a_resampled_1_khz_sine_keeps_its_frequency_and_level(src, dst):
    t = torch.arange(src, dtype=torch.float64) / src
    out = resample(torch.sin(2 * math.pi * 1000 * t).float()[None].expand(2, -1), src, dst)
    assert out.shape == (2, dst), f"one second at {src} Hz became {out.shape[-1]} samples at {dst} Hz"
    expected = torch.sin(2 * math.pi * 1000 * torch.arange(dst, dtype=torch.float64) / dst).float()
    error = (out[:, 300:-300] - expected[300:-300]).abs().max().item()
    assert error < 1e-4, f"{src} -> {dst} Hz: the sine is off by up to {error:.2g}"


def test_downsampling_removes_a_tone_above_the_new_nyquist_instead_of_folding_it_down():
    t = torch.arange(96_000, dtype=torch.float64) / 96_000
    ultrasonic, audible = (torch.sin(2 * math.pi * f * t).float() for f in (30_000, 20_000))
    folded = resample(ultrasonic, 96_000, 48_000)[500:-500].pow(2).mean().sqrt().item()
    kept = resample(audible, 96_000, 48_000)[500:-500].pow(2).mean().sqrt().item()
    assert folded < 1e-4, f"a 30 kHz tone came out at RMS {folded:.2g} (aliased to 18 kHz)"
    assert abs(kept - math.sqrt(0.5)) < 1e-3, f"a 20 kHz tone came out at RMS {kept:.4f}, expected 0.7071"
