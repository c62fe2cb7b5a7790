"""Per-frame control curves: validation to broadcastable shapes, resampling and builders (1-D float32 tensors)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..params import CURVE_OPS, WAVE_KINDS

Curve = float | torch.Tensor

COMBINE_OPS = dict(zip(CURVE_OPS, (torch.add, torch.sub, torch.mul, torch.minimum, torch.maximum)))


def as_curve(value: Curve, frames: int, name: str) -> torch.Tensor:
    """Validate a curve and shape it [1,1,1] (scalar), [1,T,1] or [B,T,1] so it broadcasts over [B, T, C] latents.

    A time axis of length 1 is a constant and broadcasts over any length; any other length must equal `frames`.
    """
    _check_frames(frames)
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise ValueError(f"curve {name!r} must be a float or a tensor, got {type(value).__name__}")
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(float(value))
    if value.dtype == torch.bool or value.is_complex():
        raise ValueError(f"curve {name!r} must hold real numbers, got dtype {value.dtype}")
    curve = frame_view(value if value.is_floating_point() else value.float(), name)
    if curve.shape[1] not in (1, frames):
        raise ValueError(
            f"curve {name!r} has {curve.shape[1]} frames, expected {frames}; resample it with curves.resample(values, {frames})"
        )
    if not torch.isfinite(curve).all():
        raise ValueError(f"curve {name!r} contains NaN or inf values")
    return curve


def frame_view(curve: torch.Tensor, name: str = "curve") -> torch.Tensor:
    """Reshape a scalar, [T], [B,T] or [B,T,1] tensor to rank 3 without checking its values (cheap, no GPU sync)."""
    if curve.dim() == 0:
        return curve.reshape(1, 1, 1)
    if curve.dim() == 1:
        return curve.reshape(1, -1, 1)
    if curve.dim() == 2:
        return curve.unsqueeze(-1)
    if curve.dim() == 3 and curve.shape[-1] == 1:
        return curve
    raise ValueError(
        f"curve {name!r} must be a scalar, [T], [B, T] or [B, T, 1] tensor, got shape {tuple(curve.shape)}"
    )


def resample(values: Sequence[float] | torch.Tensor, frames: int) -> torch.Tensor:
    """Linearly resample a 1-D sequence of any length >= 1 to `frames` points; first and last values are kept exactly."""
    ys = _as_1d(values, "values")
    return _interpolate(torch.linspace(0.0, 1.0, len(ys)), ys, frames)


def constant(value: float, frames: int) -> torch.Tensor:
    """`frames` copies of `value`."""
    _check_frames(frames)
    return torch.full((frames,), float(value))


def ramp(start: float, end: float, frames: int) -> torch.Tensor:
    """Straight line from `start` at the first frame to `end` at the last."""
    _check_frames(frames)
    return torch.linspace(float(start), float(end), frames)


def wave(
    frames: int,
    kind: str = "sine",
    cycles: float = 1.0,
    low: float = 0.0,
    high: float = 1.0,
    phase: float = 0.0,
    duty: float = 0.5,
) -> torch.Tensor:
    """Periodic curve between `low` and `high`, `cycles` periods over the whole length (phase in cycles).

    Frame i sits at i/frames of the length, so the curve loops seamlessly (the last frame is not the first value).
    At phase 0: sine starts at the midpoint rising; triangle and saw start at `low`; square (half high) and
    pulse (high for `duty` of each cycle) start at `high`.
    """
    _check_frames(frames)
    if kind not in WAVE_KINDS:
        raise ValueError(f"unknown wave kind {kind!r}; use one of {WAVE_KINDS}")
    if not 0.0 <= duty <= 1.0:
        raise ValueError(f"duty must be in [0, 1], got {duty}")
    position = torch.arange(frames, dtype=torch.float64) * (cycles / frames) + phase
    cycle = position % 1.0
    if kind == "sine":
        unit = 0.5 + 0.5 * torch.sin(2.0 * math.pi * position)
    elif kind == "square":
        unit = (cycle < 0.5).double()
    elif kind == "pulse":
        unit = (cycle < duty).double()
    elif kind == "triangle":
        unit = 1.0 - (2.0 * cycle - 1.0).abs()
    else:
        unit = cycle
    return (low + (high - low) * unit).float()


def from_points(points: Sequence[float] | Sequence[tuple[float, float]], frames: int) -> torch.Tensor:
    """Curve through drawn points: plain y values (equally spaced) or (x, y) pairs with x in 0..1.

    Pairs are sorted by x and joined linearly; before the first and after the last x the curve holds that y.
    """
    table = torch.as_tensor(points, dtype=torch.float32)
    if table.dim() == 1:
        return resample(table, frames)
    if table.dim() != 2 or table.shape[1] != 2 or table.shape[0] == 0:
        raise ValueError(f"points must be a list of y values or of (x, y) pairs, got shape {tuple(table.shape)}")
    order = torch.argsort(table[:, 0], stable=True)
    return _interpolate(table[order, 0], table[order, 1], frames)


def combine(a: Curve, b: Curve, op: str) -> torch.Tensor:
    """Frame-wise add / subtract / multiply / min / max of two curves (floats broadcast)."""
    if op not in COMBINE_OPS:
        raise ValueError(f"unknown curve op {op!r}; use one of {tuple(COMBINE_OPS)} (or curves.lerp)")
    left, right = _broadcastable(a, b)
    return COMBINE_OPS[op](left, right)


def lerp(a: Curve, b: Curve, t: Curve) -> torch.Tensor:
    """(1-t)*a + t*b frame by frame; t may itself be a curve."""
    left, right = _broadcastable(a, b)
    return torch.lerp(left, right, torch.as_tensor(t, dtype=torch.float32))


def _interpolate(xs: torch.Tensor, ys: torch.Tensor, frames: int) -> torch.Tensor:
    """Piecewise-linear ys(xs) sampled at `frames` equally spaced points of 0..1, held flat outside xs."""
    _check_frames(frames)
    query = torch.linspace(0.0, 1.0, frames)
    if len(xs) == 1:
        return ys.expand(frames).clone()
    right = torch.searchsorted(xs.contiguous(), query, right=True).clamp(1, len(xs) - 1)
    x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
    span = x1 - x0
    weight = torch.where(span > 0, (query - x0) / span, torch.ones_like(query)).clamp(0.0, 1.0)
    return torch.lerp(y0, y1, weight)


def _as_1d(values: Sequence[float] | torch.Tensor, name: str) -> torch.Tensor:
    """A non-empty 1-D float32 tensor."""
    tensor = torch.as_tensor(values, dtype=torch.float32)
    if tensor.dim() != 1 or len(tensor) == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {tuple(tensor.shape)}")
    return tensor


def _broadcastable(a: Curve, b: Curve) -> tuple[torch.Tensor, torch.Tensor]:
    """Both curves as float32 tensors, or a ValueError when their lengths differ."""
    left, right = torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32)
    try:
        torch.broadcast_shapes(left.shape, right.shape)
    except RuntimeError:
        raise ValueError(
            f"curves of shapes {tuple(left.shape)} and {tuple(right.shape)} do not line up; resample one to the other's length"
        ) from None
    return left, right


def _check_frames(frames: int) -> None:
    """Raise ValueError unless frames is an integer >= 1."""
    if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
        raise ValueError(f"frames must be an integer >= 1, got {frames!r}")
