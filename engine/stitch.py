"""Joining decoded audio windows without clicks: equal-power crossfades (pure functions on [C, N] tensors)."""

from __future__ import annotations

import math

import torch


def equal_power_ramps(length: int, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(fade_out, fade_in) of `length` samples with fade_out² + fade_in² = 1 (constant power for uncorrelated audio)."""
    phase = (torch.arange(length, device=device, dtype=torch.float64) + 0.5) / length * (math.pi / 2)
    return phase.cos().to(dtype), phase.sin().to(dtype)


def crossfade_into(old: torch.Tensor, new: torch.Tensor, fade_samples: int) -> torch.Tensor:
    """`new` [C, N] written over `old` [C, N]: equal-power fades over `fade_samples` at both edges, `new` between."""
    if old.shape != new.shape:
        raise ValueError(f"crossfade needs equal shapes, got {tuple(old.shape)} and {tuple(new.shape)}")
    length = new.shape[-1]
    fade = min(fade_samples, length // 2)
    if fade <= 0:
        return new.clone()
    fade_out, fade_in = equal_power_ramps(fade, new.device, new.dtype)
    out = new.clone()
    out[..., :fade] = old[..., :fade] * fade_out + new[..., :fade] * fade_in
    out[..., length - fade :] = old[..., length - fade :] * fade_in + new[..., length - fade :] * fade_out
    return out


def append_with_overlap(buffer: torch.Tensor, window: torch.Tensor, overlap: int) -> torch.Tensor:
    """Append `window` [C, N] to `buffer` [C, M], crossfading the first `overlap` samples with the buffer's tail."""
    if buffer.shape[-1] == 0 or overlap <= 0:
        return torch.cat([buffer, window], dim=-1)
    overlap = min(overlap, buffer.shape[-1], window.shape[-1])
    fade_out, fade_in = equal_power_ramps(overlap, window.device, window.dtype)
    joined = buffer[..., -overlap:] * fade_out + window[..., :overlap] * fade_in
    return torch.cat([buffer[..., :-overlap], joined, window[..., overlap:]], dim=-1)
