"""WAV reading/writing without extra dependencies, and band-limited resampling."""

import math
import struct

import numpy as np
import pytest
import torch
from flowjam.engine.audio_io import read_wav, resample, write_wav


def test_pcm16_round_trip(tmp_path):
    audio = torch.linspace(-1, 1, 2000).reshape(2, 1000)
    back, rate = read_wav(write_wav(tmp_path / "a.wav", audio, 48_000))
    assert rate == 48_000 and back.shape == (2, 1000)
    assert (back - audio).abs().max() < 1 / 16_000


def raw_wav(path, tag, bits, channels, data: bytes, rate=22_050):
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", tag, channels, rate, rate * block, block, bits)
    path.write_bytes(
        b"RIFF"
        + struct.pack("<I", 36 + len(data))
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", len(data))
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
