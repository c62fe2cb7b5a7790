"""Prompt -> audio codes with the 5 Hz LM: Phase 1 metadata when needed, then batched Phase 2 codes (one row per seed)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..models.lm import Qwen3LM
from ..models.text_tokenizer import Qwen3Tokenizer
from ..prompts import DURATION_RANGE_S, UNKNOWN_LANGUAGE, time_signature_numerator
from .generate import CodeGenerator, CodeRequest
from .metadata import SongMetadata, generate_metadata
from .prompts import codes_prompt, codes_uncond_prompt
from .sampling import SamplingParams
from .vocabulary import LMTokenizer

CODE_RATE_HZ = 5  # one code per 5 latent frames (25 Hz / 5)


def lm_duration(seconds: float) -> float:
    """The song length to ask the LM for so its codes cover `seconds`: at least its shortest song (10 s), at most
    its longest (600 s); the caller keeps the first `seconds`."""
    low, high = DURATION_RANGE_S
    return min(max(seconds, low), high)


def codes_for_seconds(duration_s: float) -> int:
    """Codes that cover `duration_s` (exact for whole 0.2 s steps, rounded up otherwise)."""
    return math.ceil(round(duration_s * CODE_RATE_HZ, 6))


@dataclass(frozen=True)
class SongCodes:
    codes: torch.Tensor  # [len(seeds), num_codes] int64 on the CPU, each in 0..63,999
    metadata: SongMetadata  # what the codes were conditioned on: the given fields plus what Phase 1 wrote


class SongWriter:
    """The LM side of a session: owns the LM, its tokenizer and the batched code generator."""

    def __init__(
        self,
        lm: Qwen3LM,
        tokenizer: Qwen3Tokenizer,
        sampling: SamplingParams | None = None,
        compile_layers: bool = False,
    ):
        self.lm = lm
        self.tokenizer = LMTokenizer(tokenizer)
        self.generator = CodeGenerator(lm, sampling, compile_layers=compile_layers)

    @property
    def sampling(self) -> SamplingParams:
        return self.generator.sampling

    @torch.no_grad()
    def write(
        self,
        caption: str,
        duration_s: float,
        lyrics: str = "",
        bpm: float | None = None,
        key: str | None = None,
        time_signature: int | str | None = None,
        language: str | None = None,
        seeds: Sequence[int] = (0,),
        negative: str = "",
        on_code: Callable[[int, int], None] | None = None,
    ) -> SongCodes:
        """Codes for `duration_s` seconds of the described song, one row per seed (rows generated together).
        `on_code(done, total)` runs after each code step of Phase 2 and may raise to stop (`CodeGenerator.generate`)."""
        if not caption.strip():
            raise ValueError("the prompt is empty: describe the music, e.g. 'ambient pads, slow'")
        low, high = DURATION_RANGE_S
        if not low <= duration_s <= high:
            raise ValueError(
                f"duration {duration_s:g} s is outside the LM's range {low}..{high} s; pick a length in it"
            )
        if not seeds:
            raise ValueError("give at least one seed (one code sequence is generated per seed)")
        known = SongMetadata(
            bpm=None if bpm is None else round(bpm),  # the LM writes and reads whole BPMs
            caption=caption.strip(),
            duration_s=round(duration_s),
            keyscale=key,
            language=None if language in (None, UNKNOWN_LANGUAGE) else language,
            timesignature=None if time_signature is None else time_signature_numerator(time_signature),
        )
        metadata = known
        if not known.is_complete:
            metadata = generate_metadata(self.lm, self.tokenizer, caption, lyrics, known, self.sampling, seed=seeds[0])
        prompt = self._ids(codes_prompt(caption, lyrics, metadata.cot()))
        uncond = self._ids(codes_uncond_prompt(caption, lyrics, negative))
        num_codes = codes_for_seconds(duration_s)
        requests = [CodeRequest(prompt, num_codes, seed=seed, uncond_ids=uncond) for seed in seeds]
        return SongCodes(torch.stack(self.generator.generate(requests, on_code)), metadata)

    def _ids(self, text: str) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text))
