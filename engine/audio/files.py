"""WAV files in and out (PCM 8/16/24/32-bit and float 32/64, no extra dependency) and band-limited resampling."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..outputs import write_atomic

SAMPLE_RATE = 48_000
_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
_UNKNOWN_SIZE = 0xFFFFFFFF  # a data size streaming writers leave when they cannot seek back


def write_wav(path: str | Path, audio: torch.Tensor | np.ndarray, sample_rate: int = SAMPLE_RATE) -> Path:
    """Write [channels, samples] float audio in [-1, 1] as 16-bit PCM; values outside are clipped. Missing folders
    are created; the file appears whole or not at all (engine/outputs.py)."""
    data = audio.detach().float().cpu().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio, np.float32)
    if data.ndim == 1:
        data = data[None]
    if data.ndim != 2:
        raise ValueError(f"audio must be [channels, samples], got shape {tuple(data.shape)}")
    if not np.isfinite(data).all():
        raise ValueError("audio contains NaN or infinite samples")
    pcm = np.round(np.clip(data, -1.0, 1.0) * 32767.0).astype("<i2").T.tobytes()
    channels = data.shape[0]
    header = b"RIFF" + struct.pack("<I", 36 + len(pcm)) + b"WAVE"
    fmt = struct.pack("<HHIIHH", _PCM, channels, sample_rate, sample_rate * channels * 2, channels * 2, 16)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(
        path, header + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", len(pcm)) + pcm
    )


def read_wav(path: str | Path) -> tuple[torch.Tensor, int]:
    """-> (float32 audio [channels, samples] in [-1, 1], sample rate). A file that is malformed, truncated, in an
    encoding we do not decode or without a single frame of audio is refused with a ValueError naming it."""
    tag, channels, rate, bits, data = _parse_wav(Path(path))
    frames = len(data) // (channels * bits // 8)
    samples = _DECODERS[tag, bits](data)
    return torch.from_numpy(samples.reshape(frames, channels).T.copy()), rate


def check_wav(path: str | Path) -> None:
    """The checks `read_wav` makes, without decoding: a command refuses a bad file before it loads a model."""
    _parse_wav(Path(path))


def _parse_wav(path: Path) -> tuple[int, int, int, int, bytes]:
    """(format tag, channels, sample rate, bits per sample, whole frames of sample data) of a WAV we can decode."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give a WAV file")
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    raw = path.read_bytes()
    if raw[:4] != b"RIFF" or raw[8:12] != b"WAVE":
        raise ValueError(f"{path} is not a WAV file (convert it to .wav first)")
    fmt, data, pos = None, None, 12
    while pos + 8 <= len(raw):
        chunk_id, size = raw[pos : pos + 4], struct.unpack("<I", raw[pos + 4 : pos + 8])[0]
        if chunk_id == b"data" and size == _UNKNOWN_SIZE:  # written to a pipe: the audio runs to the end
            size = len(raw) - pos - 8
        body = raw[pos + 8 : pos + 8 + size]
        if chunk_id == b"fmt ":
            fmt = body
        elif chunk_id == b"data":
            if len(body) < size:
                raise ValueError(
                    f"{path}: the file is truncated ({len(body)} of {size} bytes of audio data); "
                    "export or copy it again"
                )
            data = body
        pos += 8 + size + (size & 1)
    if fmt is None or data is None:
        raise ValueError(f"{path}: WAV without fmt or data chunk")
    tag, channels, rate, bits = _check_format(fmt, path)
    block = channels * bits // 8
    frames = len(data) // block
    if frames == 0:
        raise ValueError(f"{path} holds no audio (0 frames); give a WAV with sound in it")
    return tag, channels, rate, bits, data[: frames * block]


def _check_format(fmt: bytes, path: Path) -> tuple[int, int, int, int]:
    """(format tag, channels, sample rate, bits per sample) of a fmt chunk we can decode; ValueError otherwise."""
    if len(fmt) < 16:
        raise ValueError(f"{path}: malformed WAV (fmt chunk of {len(fmt)} bytes, at least 16 expected)")
    tag, channels, rate, _, block, bits = struct.unpack("<HHIIHH", fmt[:16])
    if tag == _EXTENSIBLE and len(fmt) >= 26:
        tag = struct.unpack("<H", fmt[24:26])[0]
    if channels < 1:
        raise ValueError(f"{path}: malformed WAV (0 channels)")
    if rate == 0:
        raise ValueError(f"{path}: malformed WAV (sample rate 0 Hz)")
    if (tag, bits) not in _DECODERS:
        encoding = f"format tag {tag:#x}, {bits} bits"
        raise ValueError(f"{path}: unsupported WAV encoding ({encoding}); use 8/16/24/32-bit PCM or 32/64-bit float")
    if block != channels * bits // 8:
        raise ValueError(
            f"{path}: malformed WAV (block align {block}, but {channels} channels of {bits} bits need "
            f"{channels * bits // 8})"
        )
    return tag, channels, rate, bits


def _pcm24(data: bytes) -> np.ndarray:
    b = np.frombuffer(data, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
    value = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    return (np.where(value >= 1 << 23, value - (1 << 24), value) / float(1 << 23)).astype(np.float32)


_DECODERS = {
    (_FLOAT, 32): lambda data: np.frombuffer(data, dtype="<f4").astype(np.float32),
    (_FLOAT, 64): lambda data: np.frombuffer(data, dtype="<f8").astype(np.float32),
    (_PCM, 8): lambda data: (np.frombuffer(data, dtype=np.uint8).astype(np.float32) - 128.0) / 128.0,
    (_PCM, 16): lambda data: np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0,
    (_PCM, 24): _pcm24,
    (_PCM, 32): lambda data: (np.frombuffer(data, dtype="<i4").astype(np.float64) / 2147483648.0).astype(np.float32),
}


def resample(audio: torch.Tensor, from_rate: int, to_rate: int, taps_per_side: int = 32) -> torch.Tensor:
    """Kaiser-windowed sinc polyphase resampling of [..., samples] audio (anti-aliased on downsampling)."""
    if from_rate == to_rate:
        return audio
    g = math.gcd(from_rate, to_rate)
    up, down = to_rate // g, from_rate // g
    cutoff = min(1.0, up / down) * 0.97
    width = taps_per_side * max(1, down // up if down > up else 1)
    phases = torch.arange(up, dtype=torch.float64)[:, None] / up
    offsets = torch.arange(-width, width + 1, dtype=torch.float64)[None, :]
    x = (offsets - phases) * cutoff
    window = torch.special.i0(8.0 * torch.sqrt(torch.clamp(1 - ((offsets - phases) / (width + 1)) ** 2, min=0.0)))
    kernels = (cutoff * torch.sinc(x) * window / torch.special.i0(torch.tensor(8.0, dtype=torch.float64))).to(
        audio.dtype
    )
    lead = audio.shape[:-1]
    flat = audio.reshape(-1, 1, audio.shape[-1])
    padded = F.pad(flat, (width, width + 1))
    phased = F.conv1d(padded, kernels[:, None, :])  # [N, up, samples + 1]
    interleaved = phased.transpose(1, 2).reshape(flat.shape[0], -1)
    out_len = math.ceil(audio.shape[-1] * up / down)
    return interleaved[:, ::down][:, :out_len].reshape(*lead, out_len)
