"""The ACE-Step 1.5 generation model as one module whose state dict equals the official `model.safetensors`."""

from __future__ import annotations

import torch
from torch import nn

from .condition import ConditionEncoder
from .dit import DiTDecoder
from .fsq import AudioDetokenizer, AudioTokenizer
from .presets import AceStepConfig


class AceStepModel(nn.Module):
    """decoder (DiT) + encoder (conditions) + tokenizer/detokenizer (FSQ) + null_condition_emb."""

    def __init__(self, config: AceStepConfig):
        super().__init__()
        self.config = config
        self.decoder = DiTDecoder(config)
        self.encoder = ConditionEncoder(config)
        self.tokenizer = AudioTokenizer(config)
        self.detokenizer = AudioDetokenizer(config)
        self.null_condition_emb = nn.Parameter(torch.randn(1, 1, config.condition_width))

    def pad_to_pool_window(self, latents: torch.Tensor, silence_latent: torch.Tensor) -> torch.Tensor:
        """Append silence frames [.., T, 64] so T is a multiple of the pool window (5 frames = one code)."""
        missing = (-latents.shape[1]) % self.config.pool_window_size
        if not missing:
            return latents
        filler = silence_latent[:, :missing].to(latents).expand(latents.shape[0], -1, -1)
        return torch.cat([latents, filler], dim=1)

    def tokenize(self, latents: torch.Tensor, silence_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """25 Hz latents [B, T, 64] -> (quantized [B, ceil(T/5), Hc], codes [B, ceil(T/5), 1])."""
        return self.tokenizer(self.pad_to_pool_window(latents, silence_latent))

    def detokenize(self, quantized: torch.Tensor) -> torch.Tensor:
        return self.detokenizer(quantized)

    def codes_to_hints(self, codes: torch.Tensor, frames: int) -> torch.Tensor:
        """5 Hz codes [B, N] -> 25 Hz structure hints [B, frames, 64] (cropped to `frames`)."""
        return self.detokenizer(self.tokenizer.quantizer.decode_indices(codes))[:, :frames]

    def null_condition(self, like: torch.Tensor) -> torch.Tensor:
        """The unconditional condition: `null_condition_emb` broadcast to the shape of `like` [B, L, Hc]."""
        return self.null_condition_emb.to(like).expand_as(like)
