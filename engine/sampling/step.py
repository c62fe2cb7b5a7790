"""One slot's step as pure functions (k-diffusion style): guidance over its rows' velocities, then one solver step
(`engine/sampling/solver.py`), as a function of the slot's state (`SlotState`), its velocities and its times.

Model-free: the stream (`engine/stream/`) runs the batched forward, hands each slot its rows' velocities and a way
to draw this step's noise, and keeps the `StepResult`. Times `t`, `t_next` are floats, or fp32 tensors on the
CUDA-graph path; branches are decided on the state's float times, the math uses `t`, `t_next`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from . import solver
from .schedule import SchedulePlace


class WaveletCorrection(Protocol):
    """The wavelet correction after a step (a request's DCW): its mode and band strengths."""

    @property
    def mode(self) -> str: ...

    @property
    def low(self) -> float: ...

    @property
    def high(self) -> float: ...


@dataclass(eq=False, slots=True)
class SlotState(SchedulePlace):
    """What one slot's step reads (and never writes): its latent, its request's tensors and options, its place in the
    schedule and the guidance state its last step left. Built for every slot every tick: plain slots, no freezing,
    so it costs the host next to nothing."""

    x: torch.Tensor  # the latent at this step's t
    noise: torch.Tensor  # the request's seeded noise, drawn when it entered the ring
    source: torch.Tensor | None  # clean latents the request starts from or keeps
    x0_target: torch.Tensor | None
    curves: Mapping[str, torch.Tensor]  # the request's own step-time curves, by field name
    shared: Mapping[str, torch.Tensor]  # shared curves, overriding the request's own
    schedule: tuple[float, ...]
    step: int
    solver: str
    cfg_mode: str
    guidance_method: str
    dcw: WaveletCorrection | None
    x0_target_gate: float
    running: torch.Tensor | None  # APG's running average
    cached_negative: torch.Tensor | None  # cfg_mode initialize: the first step's negative velocity

    def curve(self, name: str) -> torch.Tensor | None:
        """The effective value of a step-time field: the shared override if set, else the slot's own."""
        shared = self.shared.get(name)
        return shared if shared is not None else self.curves.get(name)


class RowVelocity(NamedTuple):
    """One batch row's velocity for its slot, with what the guidance reads of the row."""

    velocity: torch.Tensor  # [T, C]
    negative: bool
    weight: torch.Tensor | None  # per-frame blend weight of a positive row


@dataclass(frozen=True)
class StepResult:
    """What one slot's step produced: its next latent and the guidance state the next step reads."""

    x: torch.Tensor
    running: torch.Tensor | None
    cached_negative: torch.Tensor | None


def needs_negative(cfg_mode: str, step: int) -> bool:
    """Whether this step runs a negative row: every step with cfg full, the first with cfg initialize."""
    return cfg_mode == "full" or (cfg_mode == "initialize" and step == 0)


def model_input(state: SlotState, t: torch.Tensor | float) -> torch.Tensor:
    """The latent the model sees at `t`: with a latent mask, the kept frames re-noised from the source."""
    mask = state.curves.get("latent_mask")
    if mask is None:
        return state.x
    return solver.mask_pre_blend(state.x, mask, state.source, state.noise, t).to(state.x.dtype)


def advance(
    state: SlotState,
    rows: Sequence[RowVelocity],
    t: torch.Tensor | float,
    t_next: torch.Tensor | float,
    step_noise: Callable[[], torch.Tensor],
) -> StepResult:
    """Guidance and one solver step for a slot; `step_noise` draws this step's noise (called only if the step
    needs it)."""
    positive = [(row.velocity[None], row.weight) for row in rows if not row.negative]
    negative = [row.velocity[None] for row in rows if row.negative]
    if len(positive) == 1:
        v_pos = positive[0][0]
    else:
        v_pos = solver.blend_velocities([v for v, _ in positive], [weight for _, weight in positive])
    v_neg, running, cached_negative = None, state.running, state.cached_negative
    if state.cfg_mode == "self":
        v_neg = state.noise
    elif negative:
        v_neg = negative[0]
        if state.cfg_mode == "initialize":
            cached_negative = v_neg
    elif state.cfg_mode == "initialize":
        v_neg = state.cached_negative
    velocity = v_pos
    if v_neg is not None:
        scale = state.curve("guidance")
        if state.guidance_method == "apg":
            velocity, running = solver.apg(v_pos, v_neg, scale, running, state.curve("apg_momentum"))
        else:
            velocity = solver.cfg(v_pos, v_neg, scale)
        rescale = state.curve("cfg_rescale")
        if rescale is not None:
            velocity = solver.cfg_rescale(velocity, v_pos, rescale)
    x_next = integrate(state, velocity, t, t_next, step_noise)
    return StepResult(x_next.to(state.x.dtype), running, cached_negative)


def integrate(
    state: SlotState,
    velocity: torch.Tensor,
    t: torch.Tensor | float,
    t_next: torch.Tensor | float,
    step_noise: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """One solver step; branches are decided on the state's float times, the math uses `t`, `t_next`."""
    x = state.x
    scale = state.curve("velocity_scale")
    ode_noise = state.curve("ode_noise")
    sde_curve = state.curve("sde_denoise")
    scaled = velocity if scale is None else solver.scale_velocity(velocity, scale)
    source = state.source
    needs_x0 = (
        state.solver == "sde"
        or state.curves.get("latent_mask") is not None
        or pulls_to_target(state)
        or (sde_curve is not None and source is not None)
    )
    if not needs_x0:
        x_next = solver.euler_step(x, scaled, t, t_next)
        if ode_noise is not None and state.t_next > 0:
            x_next = solver.inject_ode_noise(x_next, step_noise(), ode_noise, t_next)
    else:
        x0 = solver.predict_x0(x, scaled, t)
        mask = state.curves.get("latent_mask")
        if mask is not None:
            x0 = solver.mask_post_blend(x0, mask, source)
        x0 = pull_to_target(state, x0)
        if sde_curve is not None and source is not None:
            noise = step_noise() if state.t_next > 0 else torch.zeros_like(x)
            x_next = solver.sde_curve_step(x0, source, noise, t_next, sde_curve)
        elif state.t_next <= 0:
            x_next = x0
        elif state.solver == "sde":
            x_next = solver.noised(x0, state.noise if mask is not None else step_noise(), t_next)
        else:
            x_next = solver.euler_step(x, (x - x0) / t, t, t_next)
            if ode_noise is not None:
                x_next = solver.inject_ode_noise(x_next, step_noise(), ode_noise, t_next)
    dcw = state.dcw
    if dcw is not None and state.t_next > 0:
        x_next = solver.dcw_correct(x_next, solver.predict_x0(x, velocity, t), t, dcw.mode, dcw.low, dcw.high)
    return x_next


def uses_step_noise(state: SlotState) -> bool:
    """Whether this step of the slot draws fresh noise (SDE, ODE noise injection, an SDE curve)."""
    return (
        state.solver == "sde"
        or state.curve("ode_noise") is not None
        or (state.curve("sde_denoise") is not None and state.source is not None)
    )


def pulls_to_target(state: SlotState) -> bool:
    """Whether this slot has an x0 target and a strength (its own or shared) to pull toward it with; without a
    strength the step takes the plain Euler path, exactly as if there were no target."""
    if state.x0_target is None:
        return False
    return "x0_target_curve" in state.curves or state.curve("x0_target_strength") is not None


def x0_pull(state: SlotState) -> float | bool | None:
    """How this step pulls x0 toward the slot's target: its progress through the schedule (per-frame curve),
    whether the scalar strength applies (second half of the schedule), None without a target."""
    if not pulls_to_target(state):
        return None
    if "x0_target_curve" in state.curves:
        return state.step / max(state.steps - 1, 1)
    return state.step >= state.steps // 2 and state.t > 0


def pull_to_target(state: SlotState, x0: torch.Tensor) -> torch.Tensor:
    """x0 pulled toward the slot's x0 target as far as this step's `x0_pull` says (unchanged without one)."""
    pull = x0_pull(state)
    if pull is None or pull is False:  # a progress of 0.0 still pulls
        return x0
    curve = state.curves.get("x0_target_curve")
    if curve is not None:
        return solver.blend_x0_target(x0, state.x0_target, curve, pull, state.x0_target_gate)
    return solver.blend_x0_target_scalar(x0, state.x0_target, state.curve("x0_target_strength"))
