"""Joining decoded audio windows without clicks: equal-power crossfades (pure functions on [C, N] tensors)."""

from __future__ import annotations

import math

import torch


def equal_power_ramps(length: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(fade_out, fade_in) of `length` samples with fade_out² + fade_in² = 1 (constant power for uncorrelated audio)."""
    phase = (torch.arange(length, device=device, dtype=torch.float64) + 0.5) / length * (math.pi / 2)
    return phase.cos().to(dtype), phase.sin().to(dtype)


def append_with_overlap(buffer: torch.Tensor, window: torch.Tensor, overlap: int) -> torch.Tensor:
    """Append `window` [C, N] to `buffer` [C, M], crossfading the first `overlap` samples with the buffer's tail."""
    if buffer.shape[-1] == 0 or overlap <= 0:
        return torch.cat([buffer, window], dim=-1)
    overlap = min(overlap, buffer.shape[-1], window.shape[-1])
    fade_out, fade_in = equal_power_ramps(overlap, window.device, window.dtype)
    joined = buffer[..., -overlap:] * fade_out + window[..., :overlap] * fade_in
    return torch.cat([buffer[..., :-overlap], joined, window[..., overlap:]], dim=-1)
