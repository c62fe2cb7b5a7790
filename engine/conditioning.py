"""Encoded conditions as the DiT consumes them, with their cross-attention K/V built once and reused."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from .lora.attached import lora_set
from .models.dit import CrossKV, DiTDecoder

KV_PER_STRENGTHS = 4  # K/V kept per condition for sessions with their own LoRA strengths (LRU)


@dataclass(eq=False)
class Conditioning:
    """One condition: packed encoder states [1, L, Hc]. Compared by identity: each encode is its own condition."""

    encoder_hidden_states: torch.Tensor
    task: str = "text2music"
    caption: str = ""
    _cross_kv: CrossKV | None = field(default=None, repr=False)
    _built_by: weakref.ref[DiTDecoder] | None = field(default=None, repr=False)
    _built_at: int = field(default=-1, repr=False)  # the decoder's cross_kv_version they were built at
    _kv_by_strengths: OrderedDict[tuple, CrossKV] = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        states = self.encoder_hidden_states
        if states.dim() != 3 or states.shape[0] != 1:
            raise ValueError(f"encoder_hidden_states must be [1, L, H], got {tuple(states.shape)}")
        if not torch.isfinite(states).all():
            raise ValueError("conditioning contains NaN or infinite values")

    def cross_kv(self, decoder: DiTDecoder, strengths: tuple[float, ...] | None = None) -> CrossKV:
        """Cross-attention K/V for every decoder layer, computed on first use per decoder and again when the
        decoder's K/V projections change (a LoRA on them: `cross_kv_version`). `strengths`: a session's own LoRA
        strengths (one per LoRA slot) in place of the decoder's, for a session of a shared ring.

        The decoder that built them is held by a weak reference and compared by identity, so a new decoder is
        never served the K/V of a freed one, even at the same address (`id` would collide there)."""
        built_by = None if self._built_by is None else self._built_by()
        if built_by is not decoder or self._built_at != decoder.cross_kv_version:
            self._cross_kv = None
            self._kv_by_strengths.clear()
            self._built_by, self._built_at = weakref.ref(decoder), decoder.cross_kv_version
        if strengths is None:
            if self._cross_kv is None:
                with torch.no_grad():
                    self._cross_kv = decoder.build_cross_kv(self.encoder_hidden_states)
            return self._cross_kv
        kv = self._kv_by_strengths.get(strengths)
        if kv is None:
            rows = torch.tensor([strengths], device=self.encoder_hidden_states.device)
            with torch.no_grad(), lora_set(decoder).rows_at(rows):
                kv = decoder.build_cross_kv(self.encoder_hidden_states)
            self._kv_by_strengths[strengths] = kv
            if len(self._kv_by_strengths) > KV_PER_STRENGTHS:
                self._kv_by_strengths.popitem(last=False)
        self._kv_by_strengths.move_to_end(strengths)
        return kv

    @property
    def length(self) -> int:
        return self.encoder_hidden_states.shape[1]


def pad_condition(states: torch.Tensor, length: int, filler: torch.Tensor) -> torch.Tensor:
    """Extend [1, L, H] to `length` tokens with the `filler` vector [1, 1, H] (the learned null condition)."""
    missing = length - states.shape[1]
    if missing <= 0:
        return states
    return torch.cat([states, filler.to(states).expand(1, missing, -1)], dim=1)


def blend_conditionings(a: Conditioning, b: Conditioning, alpha: float, filler: torch.Tensor) -> Conditioning:
    """Embedding-space prompt blend (1 - alpha)*a + alpha*b; the shorter one is padded with the null embedding."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"blend amount must be in [0, 1], got {alpha}")
    length = max(a.length, b.length)
    mixed = torch.lerp(
        pad_condition(a.encoder_hidden_states, length, filler),
        pad_condition(b.encoder_hidden_states, length, filler),
        alpha,
    )
    return Conditioning(mixed, a.task, f"{a.caption} <{alpha:.2f}> {b.caption}")
