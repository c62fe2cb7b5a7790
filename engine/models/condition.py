"""ACE-Step 1.5 condition encoder (`encoder.*` keys): text projector, lyric encoder, timbre encoder, packing.

Produces `encoder_hidden_states` [B, L_lyric + n_refs + L_text, Hc] with all valid tokens first, the form the
DiT cross-attends to; `null_condition_emb` (held by the full model) replaces it for unconditional rows.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm, TransformerBlock, band_mask, combine_masks, rope_cos_sin
from .presets import AceStepConfig, EncoderShape


class EncoderStack(nn.Module):
    """Linear embed -> bidirectional Qwen3 blocks (even layers banded, odd full) -> RMSNorm."""

    def __init__(self, shape: EncoderShape, in_dim: int, num_layers: int):
        super().__init__()
        self.shape = shape
        self.embed_tokens = nn.Linear(in_dim, shape.hidden)
        self.layers = nn.ModuleList(
            TransformerBlock(shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim, shape.eps)
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(shape.hidden, shape.eps)

    def run_layers(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Blocks + final norm over already-embedded tokens x [N, L, H]; key_mask [N, L] marks valid keys."""
        length = x.shape[1]
        rope = rope_cos_sin(torch.arange(length, device=x.device), self.shape.head_dim, self.shape.rope_theta, x.dtype)
        full = combine_masks(None, key_mask)
        banded = combine_masks(band_mask(length, self.shape.sliding_window, x.device), key_mask)
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, banded if index % 2 == 0 else full)
        return self.norm(x)

    def forward(self, inputs: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.run_layers(self.embed_tokens(inputs), key_mask)


class TimbreEncoder(EncoderStack):
    """Reference-audio latents [N_ref, T_ref, 64] -> one timbre vector per reference [N_ref, Hc]."""

    def __init__(self, shape: EncoderShape, in_dim: int, num_layers: int, cls_token: bool):
        super().__init__(shape, in_dim, num_layers)
        self.cls_token = cls_token
        self.special_token = nn.Parameter(torch.randn(1, 1, shape.hidden))

    def forward(self, refer_latents: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(refer_latents)
        if self.cls_token:
            x = torch.cat([self.special_token.expand(x.shape[0], 1, -1), x], dim=1)
            if key_mask is not None:
                key_mask = torch.cat([key_mask.new_ones(key_mask.shape[0], 1), key_mask], dim=1)
        return self.run_layers(x, key_mask)[:, 0]


def unpack_references(
    per_reference: torch.Tensor, order: torch.Tensor, batch: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group packed references [N, H] by their batch index `order` [N] -> ([B, max_refs, H], valid mask [B, max_refs])."""
    batch = int(order.max()) + 1 if batch is None else batch
    counts = torch.bincount(order, minlength=batch)
    max_refs = int(counts.max())
    slot_in_item = torch.zeros_like(order)
    for item in range(batch):
        rows = (order == item).nonzero().flatten()
        slot_in_item[rows] = torch.arange(rows.numel(), device=order.device)
    out = per_reference.new_zeros(batch, max_refs, per_reference.shape[-1])
    out[order, slot_in_item] = per_reference
    mask = torch.arange(max_refs, device=order.device)[None, :] < counts[:, None]
    return out, mask.long()


def pack_sequences(
    first: torch.Tensor, second: torch.Tensor, first_mask: torch.Tensor, second_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate two padded sequences and move every valid token to the front (stable), padding to the end."""
    hidden = torch.cat([first, second], dim=1)
    mask = torch.cat([first_mask.long(), second_mask.long()], dim=1)
    order = mask.argsort(dim=1, descending=True, stable=True)
    packed = torch.gather(hidden, 1, order.unsqueeze(-1).expand_as(hidden))
    lengths = mask.sum(dim=1)
    new_mask = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    return packed, new_mask


class ConditionEncoder(nn.Module):
    def __init__(self, config: AceStepConfig):
        super().__init__()
        shape = config.encoder_view()
        self.text_projector = nn.Linear(config.text_hidden_dim, shape.hidden, bias=False)
        self.lyric_encoder = EncoderStack(shape, config.text_hidden_dim, config.num_lyric_encoder_hidden_layers)
        self.timbre_encoder = TimbreEncoder(
            shape, config.timbre_hidden_dim, config.num_timbre_encoder_hidden_layers, config.timbre_cls_token
        )

    def forward(
        self,
        text_hidden_states: torch.Tensor,
        text_attention_mask: torch.Tensor,
        lyric_hidden_states: torch.Tensor,
        lyric_attention_mask: torch.Tensor,
        refer_audio_packed: torch.Tensor,
        refer_audio_order: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (encoder_hidden_states [B, L, Hc], boolean valid mask [B, L], valid tokens first)."""
        text = self.text_projector(text_hidden_states)
        lyrics = self.lyric_encoder(lyric_hidden_states, lyric_attention_mask)
        timbre, timbre_mask = unpack_references(
            self.timbre_encoder(refer_audio_packed), refer_audio_order, text.shape[0]
        )
        packed, mask = pack_sequences(lyrics, timbre, lyric_attention_mask, timbre_mask)
        return pack_sequences(packed, text, mask, text_attention_mask)
