"""Offline rendering: prompt (and optional cover source) -> a 48 kHz stereo WAV file."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .audio_io import read_wav, write_wav
from .session import Session, peak_normalize, seconds_to_frames


@dataclass(frozen=True)
class RenderRequest:
    prompt: str
    seconds: float
    out: Path
    lyrics: str = ""
    cover: Path | None = None
    seed: int = 0
    steps: int = 8
    shift: float = 3.0
    denoise: float = 1.0
    bpm: int | None = None
    key: str | None = None
    time_signature: str | None = None
    language: str = "unknown"

    def validate(self) -> None:
        seconds_to_frames(self.seconds)
        if not self.prompt.strip():
            raise ValueError("the prompt is empty: describe the music, e.g. --prompt 'ambient pads, slow'")
        if self.cover is None and self.denoise < 1.0:
            raise ValueError("--denoise below 1 needs --cover AUDIO.wav to start from")


def render(session: Session, request: RenderRequest, on_step: Callable[[int, int], None] | None = None) -> Path:
    """Generate and write the WAV; returns its path. Length is exactly `seconds` (rounded to whole samples)."""
    request.validate()
    source = None
    if request.cover is not None:
        audio, rate = read_wav(request.cover)
        source = session.prepare_source(audio, rate)
    conditioning = session.encode_text(
        request.prompt,
        request.lyrics,
        bpm=request.bpm,
        key=request.key,
        time_signature=request.time_signature,
        duration_s=min(max(request.seconds, 10.0), 600.0),
        task="cover" if source is not None else "text2music",
        language=request.language,
    )
    latent = session.generate(
        conditioning,
        seconds=request.seconds,
        seed=request.seed,
        steps=request.steps,
        shift=request.shift,
        denoise=request.denoise,
        source=source,
        on_step=on_step,
    )
    audio = peak_normalize(session.decode(latent))
    samples = round(request.seconds * session.sample_rate)
    if audio.shape[-1] < samples:
        audio = torch.nn.functional.pad(audio, (0, samples - audio.shape[-1]))
    return write_wav(request.out, audio[:, :samples], session.sample_rate)
