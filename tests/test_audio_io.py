"""WAV reading/writing without extra dependencies, and band-limited resampling."""

import math
import struct

import numpy as np
import pytest
import torch
from flowjam.engine.audio.files import check_wav, read_wav, resample, write_wav


def test_pcm16_round_trip(tmp_path):
    audio = torch.linspace(-1, 1, 2000).reshape(2, 1000)
    back, rate = read_wav(write_wav(tmp_path / "a.wav", audio, 48_000))
    assert rate == 48_000 and back.shape == (2, 1000)
    assert (back - audio).abs().max() < 1 / 16_000


def raw_wav(path, tag, bits, channels, data: bytes, rate=22_050, block=None, fmt_bytes=16, data_size=None):
    """A WAV written field by field; `block`, `fmt_bytes` (fmt chunk length) and `data_size` (the data chunk's
    declared size) can be set to wrong values to build malformed files."""
    block = channels * bits // 8 if block is None else block
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)[:fmt_bytes]
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


def test_float32_and_24_bit_files(tmp_path):
    frames = np.array([[0.5, -0.25], [-1.0, 0.75]], dtype="<f4")  # [frames, channels]
    audio, rate = read_wav(raw_wav(tmp_path / "f.wav", 3, 32, 2, frames.tobytes()))
    assert rate == 22_050 and torch.equal(audio, torch.from_numpy(frames.T.copy()))
    one_frame = (1 << 22).to_bytes(3, "little", signed=True) + (-(1 << 23)).to_bytes(3, "little", signed=True)
    audio24, _ = read_wav(raw_wav(tmp_path / "p.wav", 1, 24, 2, one_frame))
    assert audio24.flatten().tolist() == [0.5, -1.0]


def test_not_a_wav_is_a_clear_error(tmp_path):
    path = tmp_path / "x.wav"
    path.write_bytes(b"ID3 this is an mp3")
    with pytest.raises(ValueError, match="not a WAV file"):
        read_wav(path)


@pytest.mark.parametrize("src, dst", [(44_100, 48_000), (48_000, 44_100), (16_000, 48_000)])
def test_resampled_sine_keeps_its_frequency_and_level(src, dst):
    t = torch.arange(src, dtype=torch.float64) / src
    out = resample(torch.sin(2 * math.pi * 440 * t).float(), src, dst)
    assert out.shape[-1] == dst
    expected = torch.sin(2 * math.pi * 440 * torch.arange(dst, dtype=torch.float64) / dst).float()
    assert (out[300:-300] - expected[300:-300]).abs().max() < 1e-3


BAD_WAVS = {  # name -> (raw_wav arguments after the path, what the error says)
    "block align 0": (dict(tag=1, bits=16, channels=2, data=bytes(400), block=0), "block align 0, but 2 channels"),
    "0 Hz": (dict(tag=1, bits=16, channels=2, data=bytes(400), rate=0), "sample rate 0 Hz"),
    "short fmt": (dict(tag=1, bits=16, channels=2, data=bytes(400), fmt_bytes=12), "fmt chunk of 12 bytes"),
    "0 channels": (dict(tag=1, bits=16, channels=0, data=bytes(400)), "0 channels"),
    "truncated": (dict(tag=1, bits=16, channels=2, data=bytes(400), data_size=4000), "truncated (400 of 4000 bytes"),
    "0 frames": (dict(tag=1, bits=16, channels=2, data=b""), "holds no audio (0 frames)"),
    "12-bit PCM": (dict(tag=1, bits=12, channels=1, data=bytes(400), block=2), "unsupported WAV encoding"),
    "mu-law": (dict(tag=7, bits=8, channels=1, data=bytes(400)), "unsupported WAV encoding (format tag 0x7"),
}


@pytest.mark.parametrize("name", BAD_WAVS)
def test_malformed_wavs_are_refused_naming_the_file_and_the_problem(name, tmp_path):
    fields, expected = BAD_WAVS[name]
    path = raw_wav(tmp_path / "bad.wav", **fields)
    for check in (read_wav, check_wav):
        with pytest.raises(ValueError) as error:
            check(path)
        assert str(path) in str(error.value) and expected in str(error.value), f"{name}: {error.value}"


def test_a_folder_or_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="is a folder"):
        read_wav(tmp_path)
    with pytest.raises(FileNotFoundError, match="audio file not found"):
        read_wav(tmp_path / "missing.wav")


def test_streamed_wav_with_unknown_data_size_reads_to_the_end(tmp_path):
    frames = np.array([[0.5, -0.25], [-1.0, 0.75]], dtype="<f4")
    audio, _ = read_wav(raw_wav(tmp_path / "pipe.wav", 3, 32, 2, frames.tobytes(), data_size=0xFFFFFFFF))
    assert torch.equal(audio, torch.from_numpy(frames.T.copy()))


def test_write_wav_replaces_the_file_whole(tmp_path):
    path = write_wav(tmp_path / "a.wav", torch.zeros(2, 100))
    old = path.read_bytes()
    with pytest.raises(ValueError, match="NaN"):
        write_wav(path, torch.full((2, 100), float("nan")))
    assert path.read_bytes() == old, "a refused write must leave the previous file as it was"
    write_wav(path, torch.zeros(2, 50))
    assert read_wav(path)[0].shape == (2, 50)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.wav"], "a temporary file was left behind"
