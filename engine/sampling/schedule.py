"""Flow-matching timestep schedules (t = 1 is pure noise, t = 0 is data), as pure cached functions."""

from __future__ import annotations

from functools import lru_cache

import torch

from ..params import DEFAULT_SHIFT, MAX_STEPS

DENOISE_MIN = 1e-6


def shift_time(t: float, shift: float) -> float:
    """The ACE-Step shift map t -> s*t / (1 + (s-1)*t); s > 1 spends more steps at high noise."""
    return shift * t / (1.0 + (shift - 1.0) * t)


def validate_schedule_args(steps: int, shift: float, denoise: float) -> None:
    if not 1 <= int(steps) <= MAX_STEPS:
        raise ValueError(f"steps must be in 1..{MAX_STEPS}, got {steps}")
    if not 0.0 < shift <= 100.0:
        raise ValueError(f"shift must be in (0, 100], got {shift}")
    if not 0.0 <= denoise <= 1.0:
        raise ValueError(f"denoise must be in [0, 1], got {denoise}")


@lru_cache(maxsize=256)
def timestep_schedule(steps: int, shift: float = DEFAULT_SHIFT, denoise: float = 1.0) -> tuple[float, ...]:
    """The steps + 1 times a generation visits, ending at 0.

    denoise < 1 keeps the tail of a longer grid (linspace(steps/floor(steps/denoise), 0, steps+1), as ComfyUI
    slices it); the shift is applied after truncation. denoise ~ 0 gives the no-op schedule (0, 0).
    The cache is bounded, so a knob sweeping denoise cannot grow memory.
    """
    validate_schedule_args(steps, shift, denoise)
    if denoise <= DENOISE_MIN:
        return (0.0, 0.0)
    t_start = 1.0 if denoise >= 1.0 else steps / int(steps / denoise)
    grid = torch.linspace(t_start, 0.0, steps + 1, dtype=torch.float64).tolist()
    return tuple(shift_time(t, shift) for t in grid)


class SchedulePlace:
    """Where a generation stands in its schedule, for classes with `schedule` (its steps + 1 times) and `step` (the
    steps taken so far)."""

    __slots__ = ()
    schedule: tuple[float, ...]
    step: int

    @property
    def steps(self) -> int:
        return len(self.schedule) - 1

    @property
    def t(self) -> float:
        return self.schedule[self.step]

    @property
    def t_next(self) -> float:
        return self.schedule[self.step + 1]
