"""ACE-Step 1.5 audio tokenizer / detokenizer (`tokenizer.*`, `detokenizer.*` keys).

25 Hz latents -> 5 Hz FSQ codes (one per `pool_window_size` frames, levels 8,8,8,5,5,5 = 64,000 codes) and
back to 25 Hz "structure hints" that the DiT takes as its source context for covers and LM-guided text2music.
Every 5-frame group is processed independently, so codes can be streamed.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .condition import EncoderStack
from .presets import AceStepConfig


class FiniteScalarQuantizer(nn.Module):
    """Residual FSQ with one quantizer, symmetric levels, soft clamp then hard clamp (vector-quantize-pytorch >= 1.26)."""

    def __init__(self, dim: int, levels: tuple[int, ...]):
        super().__init__()
        self.project_in = nn.Linear(dim, len(levels))
        self.project_out = nn.Linear(len(levels), dim)
        self.level_counts = tuple(levels)
        self.codebook_size = math.prod(levels)

    def _levels(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(levels, mixed-radix basis [1, 8, 64, ...]) as fp32 tensors on `device`."""
        levels = torch.tensor(self.level_counts, dtype=torch.float32, device=device)
        basis = torch.cumprod(torch.cat([levels.new_ones(1), levels[:-1]]), dim=0)
        return levels, basis

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, N, dim] -> (quantized [B, N, dim], indices [B, N, 1] int32). Quantization runs in fp32."""
        levels, basis = self._levels(x.device)
        z = self.project_in(x).float()
        clamp = 1.0 + 1.0 / (levels - 1)
        z = torch.tanh(z / clamp) * clamp
        level = torch.floor((levels - 1) * (z.clamp(-1.0, 1.0) + 1.0) / 2.0 + 0.5)
        indices = (level * basis).sum(dim=-1).round().to(torch.int32)
        codes = level * (2.0 / (levels - 1)) - 1.0
        return self.project_out(codes.to(x.dtype)), indices.unsqueeze(-1)

    def decode_indices(self, indices: torch.Tensor) -> torch.Tensor:
        """Code indices [B, N] (or [B, N, 1]) -> quantized features [B, N, dim]."""
        if indices.dim() == 3:
            indices = indices[..., 0]
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.codebook_size):
            raise ValueError(f"audio codes must lie in 0..{self.codebook_size - 1}")
        levels, basis = self._levels(indices.device)
        level = torch.div(indices.long()[..., None], basis.long(), rounding_mode="floor") % levels.long()
        codes = level.float() * (2.0 / (levels - 1)) - 1.0
        return self.project_out(codes.to(self.project_out.weight.dtype))


class AttentionPooler(EncoderStack):
    """Pools each group of frames into its special (first) token's output: [B, N, P, H] -> [B, N, H]."""

    def __init__(self, config: AceStepConfig):
        shape = config.encoder_view()
        super().__init__(shape, shape.hidden, config.num_attention_pooler_hidden_layers)
        self.special_token = nn.Parameter(torch.randn(1, 1, shape.hidden) * 0.02)

    def forward(self, groups: torch.Tensor) -> torch.Tensor:
        b, n, p, h = groups.shape
        x = self.embed_tokens(groups)
        x = torch.cat([self.special_token.expand(b, n, 1, h), x], dim=2).reshape(b * n, p + 1, h)
        return self.run_layers(x)[:, 0].reshape(b, n, h)


class AudioTokenizer(nn.Module):
    """25 Hz latents [B, T, 64] (T a multiple of the pool window) -> (quantized [B, T/5, Hc], indices [B, T/5, 1])."""

    def __init__(self, config: AceStepConfig):
        super().__init__()
        self.pool_window = config.pool_window_size
        self.audio_acoustic_proj = nn.Linear(config.audio_acoustic_hidden_dim, config.condition_width)
        self.attention_pooler = AttentionPooler(config)
        self.quantizer = FiniteScalarQuantizer(config.fsq_dim, config.fsq_input_levels)

    def forward(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, c = latents.shape
        if t % self.pool_window:
            raise ValueError(f"latent length {t} must be a multiple of {self.pool_window}; pad it with silence first")
        groups = self.audio_acoustic_proj(latents.reshape(b, t // self.pool_window, self.pool_window, c))
        return self.quantizer(self.attention_pooler(groups))


class AudioDetokenizer(EncoderStack):
    """Quantized 5 Hz features [B, N, Hc] -> 25 Hz hint latents [B, N*5, 64]."""

    def __init__(self, config: AceStepConfig):
        shape = config.encoder_view()
        super().__init__(shape, shape.hidden, config.num_attention_pooler_hidden_layers)
        self.pool_window = config.pool_window_size
        self.special_tokens = nn.Parameter(torch.randn(1, config.pool_window_size, shape.hidden) * 0.02)
        self.proj_out = nn.Linear(shape.hidden, config.audio_acoustic_hidden_dim)

    def forward(self, quantized: torch.Tensor) -> torch.Tensor:
        b, n, h = quantized.shape
        x = self.embed_tokens(quantized)[:, :, None, :] + self.special_tokens[:, None]
        x = self.run_layers(x.reshape(b * n, self.pool_window, h))
        return self.proj_out(x).reshape(b, n * self.pool_window, -1)
