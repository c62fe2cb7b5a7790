"""What other threads ask of the live runner (live/runner.py): messages applied between ticks, in order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.conditioning import Conditioning
from ..engine.session import Source


@dataclass(frozen=True)
class PromptConditioning:
    """An already encoded condition for a prompt slot (None for the negative: back to the null condition)."""

    slot: str
    conditioning: Conditioning | None


@dataclass(frozen=True)
class CurveOverride:
    """A per-frame shared curve for every in-flight slot; None falls back to the knob's value."""

    name: str
    curve: torch.Tensor | None


@dataclass(frozen=True)
class SourceSwap:
    source: Source | None


@dataclass(frozen=True)
class StructureSwap:
    context: torch.Tensor | None  # [1, frames, 128] context latents, or None for plain text2music


@dataclass(frozen=True)
class TargetCapture:
    """Make the loop as it sounds now the x0 target (`x0_target_strength` pulls toward it)."""


@dataclass(frozen=True)
class TargetClear:
    """Back to the default target: the source's latents, or none for a text-only loop."""


Message = PromptConditioning | CurveOverride | SourceSwap | StructureSwap | TargetCapture | TargetClear
