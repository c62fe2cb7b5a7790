"""Audio files in (WAV, FLAC, OGG/Vorbis, MP3 through libsndfile) and out (16-bit WAV), and resampling (soxr)."""

from __future__ import annotations

import math
import re
import struct
from pathlib import Path

import numpy as np
import soundfile
import soxr
import torch

from ..outputs import write_atomic

SAMPLE_RATE = 48_000
READ_FORMATS = "WAV, FLAC, OGG/Vorbis or MP3"
MIN_RATE_HZ, MAX_RATE_HZ = 1_000, 768_000
_PCM = 1
_STREAMED_SIZE = 0xFFFFFFFF  # the data size a WAV writer leaves when it cannot seek back: the audio runs to the end
# libsndfile's notes on a WAV (bytes) or an RF64 (frames) whose audio data is shorter than its header says
_DATA_SIZE_LOG = re.compile(r"^data : (\d+) \(should be (\d+)\)$", re.MULTILINE)
_DS64_FRAMES_LOG = re.compile(r"Calculated frame count (\d+) does not match value from 'ds64' chunk of (\d+)")
_AGAIN = "export or copy it again"
# the share of the frames a header promises that must decode: an MP3 without a Xing header has its length estimated
# from the bitrate, a little off; a file that ends sooner is cut short
_MIN_SHARE_READ = 0.99


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


def read_audio(path: str | Path, seconds: float | None = None) -> tuple[torch.Tensor, int]:
    """-> (float32 audio [channels, samples] in [-1, 1], the file's sample rate): its first `seconds` (all of it when
    None); only those frames are decoded. A file `check_audio` refuses, or one whose audio ends early, is refused
    with a ValueError naming it."""
    path = Path(path)
    frames, rate = check_audio(path)
    if seconds is not None:
        frames = min(frames, math.ceil(seconds * rate))
    try:
        data, _ = soundfile.read(path, frames=frames, dtype="float32", always_2d=True)
    except soundfile.LibsndfileError as error:
        raise ValueError(f"{path} is damaged or truncated ({error.error_string}); {_AGAIN}") from None
    if len(data) < frames * _MIN_SHARE_READ:
        raise ValueError(f"{path} is truncated (its audio ends at frame {len(data):,} of {frames:,}); {_AGAIN}")
    return torch.from_numpy(np.ascontiguousarray(data.T)), rate


def check_audio(path: str | Path) -> tuple[int, int]:
    """(frames, sample rate) of a file `read_audio` reads, from the header alone: a command refuses a bad file before
    it loads a model."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a folder; give an audio file ({READ_FORMATS})")
    if not path.is_file():
        raise FileNotFoundError(f"audio file not found: {path}")
    try:
        info = soundfile.info(path)
    except soundfile.LibsndfileError as error:
        raise ValueError(_unreadable(path, error.error_string)) from None
    if not MIN_RATE_HZ <= info.samplerate <= MAX_RATE_HZ:
        raise ValueError(
            f"{path}: sample rate {info.samplerate:,} Hz is outside {MIN_RATE_HZ:,}..{MAX_RATE_HZ:,} Hz; "
            "convert it first"
        )
    shortfall = _truncation(info.extra_info)
    if shortfall:
        raise ValueError(f"{path} is truncated ({shortfall}); {_AGAIN}")
    if info.frames == 0:
        raise ValueError(f"{path} holds no audio (0 frames); give a file with sound in it")
    return info.frames, info.samplerate


def _truncation(log: str) -> str:
    """What libsndfile's header log says is missing from a WAV or RF64 cut short ("" when nothing is)."""
    for declared, present in _DATA_SIZE_LOG.findall(log):
        if int(declared) != _STREAMED_SIZE and int(declared) > int(present):
            return f"{int(present):,} of {int(declared):,} bytes of audio data"
    for present, declared in _DS64_FRAMES_LOG.findall(log):
        if int(declared) > int(present):
            return f"{int(present):,} of {int(declared):,} frames"
    return ""


def _unreadable(path: Path, reason: str) -> str:
    """The one line for a file libsndfile cannot open, from its reason."""
    if "SF_INFO struct incomplete" in reason:  # libsndfile's word for a header with no usable rate
        return f"{path}: malformed header (sample rate 0 Hz or beyond 2,147,483,647 Hz); export it again"
    if "Format not recognised" in reason or "not a regular file" in reason:  # the second: an MP3 decoder giving up
        return f"{path} is not an audio file we read; give {READ_FORMATS} (convert it first)"
    return f"{path}: malformed audio file ({reason.rstrip('.')}); export it again or convert it to {READ_FORMATS}"


def resample(audio: torch.Tensor, from_rate: int, to_rate: int) -> torch.Tensor:
    """[..., samples] audio from one rate to another (soxr, high quality, anti-aliased); memory stays in proportion
    to the input and output, whatever the ratio of the rates."""
    if from_rate == to_rate:
        return audio
    samples = audio.shape[-1]
    by_frame = audio.detach().reshape(-1, samples).T.float().cpu().numpy()
    out = soxr.resample(by_frame, from_rate, to_rate, quality="HQ")
    return torch.from_numpy(np.ascontiguousarray(out.T)).reshape(*audio.shape[:-1], -1).to(audio.device)
