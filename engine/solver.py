"""Per-step flow-matching math as pure functions (x_t = t*noise + (1-t)*x0, velocity v = noise - x0)."""

from __future__ import annotations

import torch


def noised(x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """The point on the straight path at time t: t*noise + (1-t)*x0 (t broadcast per row)."""
    t = _per_row(t, x0)
    return t * noise + (1.0 - t) * x0


def predict_x0(x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor | float) -> torch.Tensor:
    """Clean-latent estimate x0 = x_t - t*v."""
    return x_t - _per_row(t, x_t) * velocity


def euler_step(x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor | float, t_next: torch.Tensor | float) -> torch.Tensor:
    """ODE step x_{t'} = x_t - v*(t - t'); with t' = 0 this is exactly the x0 prediction."""
    return x_t - velocity * (_per_row(t, x_t) - _per_row(t_next, x_t))


def sde_step(
    x_t: torch.Tensor, velocity: torch.Tensor, t: torch.Tensor | float, t_next: torch.Tensor | float, fresh_noise: torch.Tensor
) -> torch.Tensor:
    """SDE step: predict x0, then re-noise it to t' with fresh noise."""
    return noised(predict_x0(x_t, velocity, t), fresh_noise, t_next)


def _per_row(t: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """Scalars pass through; a [B] tensor becomes [B, 1, 1] to broadcast over [B, T, C]."""
    if isinstance(t, torch.Tensor) and t.dim() == 1:
        return t.to(like.dtype).view(-1, *([1] * (like.dim() - 1)))
    return t
