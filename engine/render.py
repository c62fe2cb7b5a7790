"""Offline rendering: prompt (plus a cover source, or the 5 Hz LM's structure and metadata) -> a 48 kHz stereo WAV."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .audio.files import check_audio, read_audio, write_wav
from .lm.sampling import SamplingParams
from .lm.song import lm_duration
from .outputs import check_output_path
from .params import (
    DEFAULT_SHIFT,
    DEFAULT_STEPS,
    LATENT_RATE_HZ,
    MAX_SONG_SECONDS,
    check_prompt_length,
    check_seed,
    seconds_to_frames,
    song_frames,
)
from .prompts import check_bpm, check_key_scale, check_language, time_signature_numerator
from .sampling.schedule import validate_schedule_args
from .session import Session, peak_normalize


@dataclass(frozen=True)
class RenderRequest:
    prompt: str
    seconds: float
    out: Path
    lyrics: str = ""
    cover: Path | None = None
    seed: int = 0
    steps: int = DEFAULT_STEPS
    shift: float = DEFAULT_SHIFT
    denoise: float = 1.0
    bpm: float | None = None  # the caption carries it as a whole BPM
    key: str | None = None
    time_signature: str | None = None
    language: str = "unknown"
    lm: bool = False  # the 5 Hz LM writes the song structure (audio codes) from the text first
    lm_checkpoint: Path | None = None  # None: the seeded `lm_preset`
    lm_preset: str = "tiny"
    lm_sampling: SamplingParams = SamplingParams()

    def validate(self) -> None:
        """Refuse a request that could only fail later, before any model work: lengths, schedule, prompt, the metas
        (--bpm, --key, --time-signature, --language), a --cover that is not a usable audio file, an --out that cannot
        be written."""
        song_frames(self.seconds, "--seconds")
        check_seed(self.seed)
        validate_schedule_args(self.steps, self.shift, self.denoise)
        check_prompt(self.prompt)
        check_metas(self.bpm, self.key, self.time_signature, self.language)
        if self.cover is None and self.denoise < 1.0:
            raise ValueError("--denoise below 1 needs --cover AUDIO.wav to start from")
        if self.lm:
            if self.cover is not None:
                raise ValueError("--lm writes the structure from the text; a --cover brings its own: use one of them")
            self.lm_sampling.validate()
        if self.cover is not None:
            check_audio(self.cover)
        check_output_path(self.out, "--out")


def check_prompt(prompt: str, option: str = "--prompt") -> None:
    """An empty caption gives the model nothing to follow, a very long one is a mistake: refused with the fix."""
    if not prompt.strip():
        raise ValueError(f"the prompt is empty: describe the music, e.g. {option} 'ambient pads, slow'")
    check_prompt_length(prompt, option)


def check_metas(bpm: float | None, key: str | None, time_signature: str | None, language: str) -> None:
    """The caption's metas in the ranges the model knows, each refused by its flag with the fix."""
    if bpm is not None:
        check_bpm(bpm, "--bpm")
    if key is not None:
        check_key_scale(key, "--key")
    if time_signature is not None:
        try:
            time_signature_numerator(time_signature)
        except ValueError as error:
            raise ValueError(f"--time-signature: {error}") from None
    check_language(language, "--language")


def cover_seconds(seconds: float) -> float:
    """How much of a --cover a render of `seconds` reads: its latent frames, plus a second so the resampler and the
    VAE see real audio past the last frame used and its 5 Hz structure code is whole (the rest is never decoded)."""
    return seconds_to_frames(seconds) / LATENT_RATE_HZ + 1.0


def render(session: Session, request: RenderRequest, on_step: Callable[[int, int], None] | None = None) -> Path:
    """Generate and write the WAV; returns its path. Length is exactly `seconds` (rounded to whole samples)."""
    request.validate()
    source = None
    if request.cover is not None:
        audio, rate = read_audio(request.cover, cover_seconds(request.seconds))
        source = session.prepare_source(audio, rate)
    bpm, key, time_signature, language, options = request.bpm, request.key, request.time_signature, request.language, {}
    if request.lm:
        if session.song_writer is None:
            session.attach_lm(request.lm_checkpoint, request.lm_preset, request.lm_sampling)
        song = session.generate_codes(
            request.prompt,
            lm_duration(request.seconds),
            lyrics=request.lyrics,
            bpm=bpm,
            key=key,
            time_signature=time_signature,
            language=language,
            seeds=(request.seed,),
        )
        meta = song.metadata  # the DiT hears the metas the LM chose for the open fields, as upstream does
        bpm, key, time_signature, language = meta.bpm, meta.keyscale, meta.timesignature, meta.language or language
        options["context_latents"] = session.codes_context(song.codes[0], seconds_to_frames(request.seconds))
    conditioning = session.encode_text(
        request.prompt,
        request.lyrics,
        bpm=bpm,
        key=key,
        time_signature=time_signature,
        duration_s=min(max(request.seconds, 10.0), MAX_SONG_SECONDS),
        task="cover" if source is not None else "text2music",
        language=language,
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
        **options,
    )
    audio = peak_normalize(session.decode(latent))
    samples = round(request.seconds * session.sample_rate)
    if audio.shape[-1] < samples:
        audio = torch.nn.functional.pad(audio, (0, samples - audio.shape[-1]))
    return write_wav(request.out, audio[:, :samples], session.sample_rate)
