"""Per-step flow-matching math as pure functions (x_t = t*noise + (1-t)*x0, velocity v = noise - x0).

Latents are [B, T, C]. A time `t` is a float or a [B] tensor (one per row). A curve argument is a float or a
tensor shaped scalar, [T], [B, T] or [B, T, 1] (see curves.as_curve); tensors are cast to the latent's dtype,
so results keep the dtype of the latent inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..params import DCW_MODES
from .curves import Curve, frame_view


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """The point on the straight path at time t: t*noise + (1-t)*x0 (t broadcast per row)."""
    t = _per_row(t, x0)
    return t * noise + (1.0 - t) * x0


def predict_x0(x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """Clean-latent estimate x0 = x_t - t*v."""
    return x_t - _per_row(t, x_t) * velocity


def euler_step(
    x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor | float, t_next: torch.Tensor | float
) -> torch.Tensor:
    """ODE step x_{t'} = x_t - v*(t - t'); with t' = 0 this is exactly the x0 prediction."""
    return x_t - velocity * (_per_row(t, x_t) - _per_row(t_next, x_t))


def scale_velocity(velocity: torch.Tensor, scale: Curve) -> torch.Tensor:
    """Velocity times a (per-frame) scale."""
    return velocity * _curve(scale, velocity)


def inject_ode_noise(
    x_next: torch.Tensor, noise: torch.Tensor, amount: Curve, t_next: torch.Tensor | float
) -> torch.Tensor:
    """ODE per-step noise injection x' + noise*amount*t'; it fades out as t' reaches 0."""
    return x_next + noise * _curve(amount, x_next) * _per_row(t_next, x_next)


def sde_curve_step(
    x0: torch.Tensor, source: torch.Tensor, noise: torch.Tensor, t_next: torch.Tensor | float, sde_curve: Curve
) -> torch.Tensor:
    """Re-noise x0 and the source with the same noise and mix per frame (curve 1 = generated, 0 = source).

    At t' = 0 this is sde_curve*x0 + (1-sde_curve)*source.
    """
    return _mix(noised(source, noise, t_next), noised(x0, noise, t_next), _curve(sde_curve, x0))


def cfg(v_pos: torch.Tensor, v_neg: torch.Tensor, scale: Curve) -> torch.Tensor:
    """Classifier-free guidance v_neg + scale*(v_pos - v_neg)."""
    return v_neg + _curve(scale, v_pos) * (v_pos - v_neg)


def apg(
    v_pos: torch.Tensor,
    v_neg: torch.Tensor,
    scale: Curve,
    running: torch.Tensor | None,
    momentum: Curve = -0.75,
    norm_threshold: float = 2.5,
    eta: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ACE-Step adaptive projected guidance; returns (guided velocity, running buffer to pass to the next step).

    d = v_pos - v_neg accumulates as running = d + momentum*running (None starts it at d); the returned buffer
    is this sum BEFORE clipping. The sum is clipped to L2 norm `norm_threshold` (0 disables) over time
    (dim 1, per row and channel), then split along v_pos normalised over time, in float64; the result is
    v_pos + (scale - 1)*(orthogonal + eta*parallel).
    """
    difference = v_pos - v_neg
    running = difference if running is None else difference + _curve(momentum, v_pos) * running
    clipped = running
    if norm_threshold > 0:
        clipped = running * torch.clamp(norm_threshold / running.norm(p=2, dim=1, keepdim=True), max=1.0)
    direction = torch.nn.functional.normalize(v_pos.double(), dim=1)
    parallel = (clipped.double() * direction).sum(dim=1, keepdim=True) * direction
    orthogonal = clipped.double() - parallel
    guidance = (orthogonal + eta * parallel).to(v_pos.dtype)
    return v_pos + (_curve(scale, v_pos) - 1.0) * guidance, running


def cfg_rescale(velocity: torch.Tensor, v_pos: torch.Tensor, amount: Curve) -> torch.Tensor:
    """Pull each frame's velocity norm toward v_pos's: amount*(v*|v_pos|/|v|) + (1-amount)*v.

    Norms are per frame, i.e. over the channel axis (dim -1), in float32.
    """
    v32 = velocity.float()
    ratio = v_pos.float().norm(p=2, dim=-1, keepdim=True) / v32.norm(p=2, dim=-1, keepdim=True).clamp_min(1e-12)
    return _mix(v32, v32 * ratio, _curve(amount, v32)).to(velocity.dtype)


def blend_x0_target(
    x0: torch.Tensor, target: torch.Tensor, strength: Curve, progress: float, gate: float
) -> torch.Tensor:
    """Gated morph toward a target: weight strength*g with g = max(0, progress - gate)/(1 - gate).

    `progress` is k/max(S-1, 1) for step k of S; before the gate opens x0 comes back unchanged.
    """
    if not gate < 1.0:
        raise ValueError(f"gate must be below 1 (the gate opens after that fraction of steps), got {gate}")
    opened = max(0.0, progress - gate) / (1.0 - gate)
    if opened <= 0.0:
        return x0
    return blend_x0_target_scalar(x0, target, _curve(strength, x0) * opened)


def blend_x0_target_scalar(x0: torch.Tensor, target: torch.Tensor, strength: Curve) -> torch.Tensor:
    """(1-strength)*x0 + strength*target; the caller decides at which steps it applies."""
    return _mix(x0, target, _curve(strength, x0))


def mask_pre_blend(
    x: torch.Tensor, mask: Curve, original: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | float
) -> torch.Tensor:
    """Model input: x where mask is 1 (generate), the original noised to t where it is 0 (keep)."""
    return _mix(noised(original, noise, t), x, _curve(mask, x))


def mask_post_blend(x0: torch.Tensor, mask: Curve, original: torch.Tensor) -> torch.Tensor:
    """x0 prediction: generated where mask is 1, the clean original where it is 0."""
    return _mix(original, x0, _curve(mask, x0))


def blend_velocities(velocities: Sequence[torch.Tensor], weights: Sequence[Curve | None]) -> torch.Tensor:
    """Per-frame weighted mean sum(w_i*v_i)/sum(w_i); None weighs 1.

    Where the weights sum to 0 at a frame (e.g. all are 0 there) the plain mean is used, so no frame is NaN.
    """
    if not velocities or len(velocities) != len(weights):
        raise ValueError(
            f"need one weight per velocity and at least one velocity, got {len(velocities)} and {len(weights)}"
        )
    like = velocities[0]
    factors = [_curve(1.0 if w is None else w, like) for w in weights]
    factors = [f if isinstance(f, torch.Tensor) else like.new_full((1, 1, 1), f) for f in factors]  # no host copy
    total = sum(factors)
    weighted = sum(w * v for w, v in zip(factors, velocities))
    unweighted = sum(velocities) / len(velocities)
    empty = total == 0
    return torch.where(empty, unweighted, weighted / torch.where(empty, torch.ones_like(total), total))


def step_range_active(step_range: tuple[float, float] | None, step: int, steps: int) -> bool:
    """Whether step/steps lies in [start, end); None means every step."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if step_range is None:
        return True
    start, end = step_range
    return start <= step / steps < end


def haar_dwt(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Single-level orthonormal Haar transform along time (dim 1): (low, high), each ceil(T/2) frames.

    An odd T gets one zero frame appended first.
    """
    if x.shape[1] % 2:
        x = torch.nn.functional.pad(x, (0, 0, 0, 1))
    even, odd = x[:, 0::2], x[:, 1::2]
    return (even + odd) / math.sqrt(2.0), (even - odd) / math.sqrt(2.0)


def haar_idwt(low: torch.Tensor, high: torch.Tensor, frames: int) -> torch.Tensor:
    """Inverse of haar_dwt, cropped back to `frames`."""
    even, odd = (low + high) / math.sqrt(2.0), (low - high) / math.sqrt(2.0)
    interleaved = torch.stack((even, odd), dim=2).flatten(1, 2)
    return interleaved[:, :frames]


def dcw_correct(
    x_next: torch.Tensor,
    x0_hat: torch.Tensor,
    t: torch.Tensor | float,
    mode: str,
    low_scale: Curve,
    high_scale: Curve,
) -> torch.Tensor:
    """DCW: push x_next away from the x0 estimate in Haar bands of time, in float32, after a step.

    low: xL += t*low_scale*(xL - yL); high: xH += (1-t)*high_scale*(xH - yH); double: both; pix: no transform,
    x += low_scale*(x - y) with no t factor (as ACE-Step v0.1.7 / DEMON). Per-frame scales act on a band
    coefficient as the mean of the two frames it covers (the last frame alone for odd T).
    """
    if mode not in DCW_MODES:
        raise ValueError(f"unknown DCW mode {mode!r}; use one of {DCW_MODES}")
    x, y = x_next.float(), x0_hat.float()
    if mode == "pix":
        return (x + _curve(low_scale, x) * (x - y)).to(x_next.dtype)
    t = _per_row(t, x)
    x_low, x_high = haar_dwt(x)
    y_low, y_high = haar_dwt(y)
    if mode in ("low", "double"):
        x_low = x_low + t * _band_curve(low_scale, x) * (x_low - y_low)
    if mode in ("high", "double"):
        x_high = x_high + (1.0 - t) * _band_curve(high_scale, x) * (x_high - y_high)
    return haar_idwt(x_low, x_high, x.shape[1]).to(x_next.dtype)


def _per_row(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """Scalars pass through; a [B] tensor becomes [B, 1, 1] to broadcast over [B, T, C]."""
    if isinstance(t, torch.Tensor) and t.dim() == 1:
        return t.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))
    return t


def _curve(curve: Curve, like: torch.Tensor) -> torch.Tensor | float:
    """Python numbers pass through (no rounding to a low dtype); tensors become rank 3 on like's dtype and device."""
    if isinstance(curve, torch.Tensor):
        return frame_view(curve).to(dtype=like.dtype, device=like.device)
    return curve


def _band_curve(curve: Curve, like: torch.Tensor) -> torch.Tensor | float:
    """A per-frame curve brought to Haar band length: the mean of each pair of frames."""
    curve = _curve(curve, like)
    if not isinstance(curve, torch.Tensor) or curve.shape[1] == 1:
        return curve
    if curve.shape[1] % 2:
        curve = torch.cat((curve, curve[:, -1:]), dim=1)
    return (curve[:, 0::2] + curve[:, 1::2]) / 2.0


def _mix(start: torch.Tensor, end: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
    """(1-weight)*start + weight*end; weight 0 and 1 return start and end exactly."""
    return (1.0 - weight) * start + weight * end
