"""Qwen3 text encoder (Qwen3-Embedding-0.6B body, keys `embed_tokens.*`, `layers.{i}.*`, `norm.*`).

ACE-Step 1.5 uses two outputs of it: the caption's hidden states after the final norm (all positions, no
pooling) and, for lyrics, nothing but the token-embedding lookup.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm, TransformerBlock, rope_cos_sin
from .presets import Qwen3Config


class Qwen3TextEncoder(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            TransformerBlock(
                config.hidden_size,
                config.intermediate_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.head_dim,
                config.rms_norm_eps,
            )
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings [B, L, H]: what ACE-Step feeds its lyric encoder."""
        return self.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal pass -> last hidden state after the final norm [B, L, H]; `attention_mask` [B, L] marks real tokens."""
        x = self.embed_tokens(input_ids)
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        rope = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            causal = positions[:, None] >= positions[None, :]
            mask = causal & attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, rope, mask, causal=True)
        return self.norm(x)
