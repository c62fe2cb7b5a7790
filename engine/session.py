"""Session: load the networks once, then encode text, prepare source audio, generate latents and decode audio."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import prompts
from .audio_io import resample
from .checkpoints import ModelBundle, load_models, silence_frames
from .models.dit import CrossKV
from .models.presets import LATENT_RATE_HZ
from .schedule import timestep_schedule
from .solver import euler_step, noised

CAPTION_MAX_TOKENS = 256
LYRIC_MAX_TOKENS = 2048


@dataclass
class Conditioning:
    """One encoded prompt: the packed condition the DiT cross-attends to, and its K/V built on first use."""

    encoder_hidden_states: torch.Tensor  # [1, L, Hc]
    task: str
    caption: str
    _cross_kv: CrossKV | None = field(default=None, repr=False)

    def cross_kv(self, session: "Session") -> CrossKV:
        if self._cross_kv is None:
            with torch.no_grad():
                self._cross_kv = session.models.acestep.decoder.build_cross_kv(self.encoder_hidden_states)
        return self._cross_kv


@dataclass
class Source:
    """Source audio in latent form: clean VAE latents and the FSQ structure hints a cover conditions on."""

    latents: torch.Tensor  # [1, T, 64]
    hints: torch.Tensor  # [1, T, 64]
    codes: torch.Tensor  # [1, ceil(T/5)] int

    @property
    def frames(self) -> int:
        return self.latents.shape[1]


def seconds_to_frames(seconds: float) -> int:
    if not seconds > 0:
        raise ValueError(f"seconds must be > 0, got {seconds}")
    return max(1, round(seconds * LATENT_RATE_HZ))


class Session:
    def __init__(self, models: ModelBundle):
        self.models = models

    @classmethod
    def load(
        cls,
        checkpoint: str | Path | None = None,
        preset: str = "tiny",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> "Session":
        """Weights from a local checkpoint path, or the seeded preset (default: tiny, no files needed)."""
        return cls(load_models(checkpoint, preset=preset, device=device, dtype=dtype, seed=seed))

    @property
    def device(self) -> torch.device:
        return self.models.device

    @property
    def dtype(self) -> torch.dtype:
        return self.models.dtype

    @property
    def sample_rate(self) -> int:
        return self.models.vae.sample_rate

    # ---- conditioning ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode_text(
        self,
        tags: str,
        lyrics: str = "",
        bpm: int | None = None,
        key: str | None = None,
        time_signature: int | str | None = None,
        duration_s: float | None = None,
        task: str = "text2music",
        language: str = prompts.UNKNOWN_LANGUAGE,
        timbre: Source | None = None,
    ) -> Conditioning:
        """Caption + metas + lyrics (+ an optional timbre reference) -> the DiT's condition."""
        if task not in prompts.TASK_INSTRUCTIONS:
            raise ValueError(f"unknown task {task!r}: choose one of {', '.join(prompts.TASK_INSTRUCTIONS)}")
        caption = prompts.caption_prompt(
            tags, prompts.TASK_INSTRUCTIONS[task], bpm=bpm, time_signature=time_signature, key_scale=key, duration_s=duration_s
        )
        lyric = prompts.lyric_prompt(lyrics.strip() or prompts.INSTRUMENTAL_LYRICS, language)
        tokenizer, text_encoder = self.models.tokenizer, self.models.text_encoder
        caption_ids, caption_mask = tokenizer.batch_encode([caption], CAPTION_MAX_TOKENS)
        lyric_ids, lyric_mask = tokenizer.batch_encode([lyric], LYRIC_MAX_TOKENS)
        caption_ids, lyric_ids = caption_ids.to(self.device), lyric_ids.to(self.device)
        text_states = text_encoder(caption_ids, caption_mask.to(self.device))
        lyric_states = text_encoder.embed(lyric_ids)
        reference = timbre.latents if timbre is not None else silence_frames(self.models.silence_latent, self.models.config.timbre_fix_frame)
        states, _ = self.models.acestep.encoder(
            text_states,
            caption_mask.to(self.device),
            lyric_states,
            lyric_mask.to(self.device),
            reference[:, : self.models.config.timbre_fix_frame].to(self.device, self.dtype),
            torch.zeros(1, dtype=torch.long, device=self.device),
        )
        return Conditioning(states, task, tags)

    def null_conditioning(self, like: Conditioning) -> Conditioning:
        """The unconditional condition for CFG: `null_condition_emb` in every position of `like`."""
        return Conditioning(self.models.acestep.null_condition(like.encoder_hidden_states), like.task, "")

    # ---- source audio ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def prepare_source(self, audio: torch.Tensor, sample_rate: int) -> Source:
        """Audio [C, N] or [1, C, N] at any rate (mono is duplicated) -> VAE latents + FSQ structure hints."""
        if audio.dim() == 3:
            audio = audio[0]
        if audio.dim() != 2 or audio.shape[0] not in (1, 2):
            raise ValueError(f"source audio must be [channels (1 or 2), samples], got {tuple(audio.shape)}")
        if not torch.isfinite(audio).all():
            raise ValueError("source audio contains NaN or infinite samples")
        audio = resample(audio.float(), sample_rate, self.sample_rate)
        if audio.shape[0] == 1:
            audio = audio.expand(2, -1)
        hop = self.models.vae.hop_samples
        if audio.shape[-1] < hop:
            raise ValueError(f"source audio is shorter than one latent frame ({hop} samples at {self.sample_rate} Hz)")
        audio = audio[:, : audio.shape[-1] // hop * hop]
        latents = self.models.vae.encode(audio[None].to(self.device, self.dtype)).transpose(1, 2)
        model = self.models.acestep
        quantized, codes = model.tokenize(latents, self.models.silence_latent)
        hints = model.detokenize(quantized)[:, : latents.shape[1]]
        return Source(latents, hints, codes[..., 0])

    # ---- generation ------------------------------------------------------------------------------------------

    def context_latents(self, frames: int, source: Source | None) -> torch.Tensor:
        """[1, T, 128] = source context (silence for text2music, structure hints for a cover) || chunk mask of ones."""
        if source is None:
            src = silence_frames(self.models.silence_latent, frames).to(self.device, self.dtype)
        else:
            src = source.hints[:, :frames]
        return torch.cat([src, torch.ones_like(src)], dim=-1)

    def initial_noise(self, frames: int, seed: int) -> torch.Tensor:
        """Seeded Gaussian noise [1, T, 64], drawn on the CPU so a seed means the same noise on every device."""
        generator = torch.Generator("cpu").manual_seed(int(seed))
        noise = torch.randn(1, frames, self.models.config.audio_acoustic_hidden_dim, generator=generator)
        return noise.to(self.device, self.dtype)

    @torch.no_grad()
    def generate(
        self,
        conditioning: Conditioning,
        seconds: float | None = None,
        seed: int = 0,
        steps: int = 8,
        shift: float = 3.0,
        denoise: float = 1.0,
        source: Source | None = None,
        on_step: Callable[[int, int], None] | None = None,
    ) -> torch.Tensor:
        """One-shot generation -> latent [1, T, 64]. With a source, T follows it and denoise < 1 starts from it."""
        frames = source.frames if source is not None else seconds_to_frames(seconds if seconds is not None else 0.0)
        if source is not None and seconds is not None:
            frames = min(frames, seconds_to_frames(seconds))
        if denoise < 1.0 and source is None:
            raise ValueError("denoise < 1 needs source audio to start from (a cover); use denoise 1 for text2music")
        schedule = timestep_schedule(int(steps), float(shift), float(denoise))
        noise = self.initial_noise(frames, seed)
        x = noise if source is None or denoise >= 1.0 else noised(source.latents[:, :frames], noise, schedule[0])
        context = self.context_latents(frames, source)
        cross_kv = conditioning.cross_kv(self)
        decoder = self.models.acestep.decoder
        for index, (t, t_next) in enumerate(zip(schedule[:-1], schedule[1:])):
            velocity = decoder(x, torch.full((1,), t, device=self.device, dtype=self.dtype), context, cross_kv=cross_kv)
            x = euler_step(x, velocity, t, t_next)
            if on_step is not None:
                on_step(index + 1, len(schedule) - 1)
        return x

    @torch.no_grad()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent [1, T, 64] -> stereo audio [2, T*1920] at 48 kHz, scaled down only if it would clip."""
        audio = self.models.vae.decode(latent.transpose(1, 2).to(self.device, self.dtype))[0].float()
        peak = audio.abs().max()
        return audio / peak if peak > 1.0 else audio
