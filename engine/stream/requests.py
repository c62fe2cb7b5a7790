"""What a stream is asked for and what it delivers: `SlotRequest` (everything one generation needs), its options
(`DCW`, `ExtraCondition`), `Finished` (a delivered latent), the seeded noise a request starts from and draws at each
step, and the checks a request passes before it is queued (`validate_request`)."""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..conditioning import Conditioning
from ..params import CFG_MODES, DCW_MODES, DEFAULT_SHIFT, DEFAULT_STEPS, GUIDANCE_METHODS, SOLVERS
from ..sampling.curves import Curve
from .windows import WindowPlace

MAIN_LANE = "main"  # the lane a pipeline's own submit/set_depth/set_shared_curve reach
FINITE_CHECKS_KEPT = 256  # tensors remembered as checked (or derived), the newest

CURVE_FIELDS = frozenset(
    (
        "guidance",
        "apg_momentum",
        "cfg_rescale",
        "velocity_scale",
        "ode_noise",
        "sde_denoise",
        "initial_noise",
        "x0_target_strength",
        "x0_target_curve",
        "latent_mask",
        "primary_weight",
    )
)


@dataclass(frozen=True)
class DCW:
    """Wavelet correction after each step (spec §4.3): mode low/high/double/pix and the band strengths."""

    mode: str = "double"
    low: float = 0.05
    high: float = 0.02


@dataclass(frozen=True)
class ExtraCondition:
    """A further positive condition whose velocity is blended per frame (`weight`) over a part of the schedule."""

    conditioning: Conditioning
    weight: Curve | None = None
    step_range: tuple[float, float] | None = None


@dataclass(eq=False)
class SlotRequest:
    """Everything one generation needs; captured when it enters a slot. Curves are a float or a [T] tensor."""

    conditioning: Conditioning
    context_latents: torch.Tensor  # [1, T, 128]: source context || chunk mask
    seed: int = 0
    steps: int = DEFAULT_STEPS
    shift: float = DEFAULT_SHIFT
    denoise: float = 1.0
    source_latents: torch.Tensor | None = None  # [1, T, 64] clean latents to start from (denoise < 1)
    solver: str = "ode"
    cfg_mode: str = "off"
    negative: Conditioning | None = None
    guidance: Curve = 1.0
    guidance_method: str = "apg"
    apg_momentum: Curve = -0.75
    cfg_rescale: Curve | None = None
    velocity_scale: Curve | None = None
    ode_noise: Curve | None = None
    sde_denoise: Curve | None = None
    initial_noise: Curve | None = None
    x0_target: torch.Tensor | None = None
    x0_target_strength: Curve | None = None
    x0_target_curve: Curve | None = None
    x0_target_gate: float = 0.5
    latent_mask: Curve | None = None  # 1 = generate, 0 = keep source_latents
    primary_weight: Curve | None = None
    primary_step_range: tuple[float, float] | None = None
    extra_conditions: tuple[ExtraCondition, ...] = ()
    dcw: DCW | None = None
    window: WindowPlace | None = None  # where the request's frames lie on a windowed stream's timeline
    tag: Any = None

    @property
    def frames(self) -> int:
        return self.context_latents.shape[1]


@dataclass(eq=False)
class Finished:
    """A delivered generation, in the tick that took its last step."""

    latent: torch.Tensor  # [1, T, 64]
    request: SlotRequest
    ticks: int  # ticks the request spent in its slot
    lane: str = MAIN_LANE  # the session (lane of the ring) that submitted it


@dataclass(eq=False)
class Prepared:
    """A validated request with its device tensors made at submit time, so a tick never waits on the host."""

    request: SlotRequest
    schedule: tuple[float, ...]
    source: torch.Tensor | None
    context: torch.Tensor
    x0_target: torch.Tensor | None
    curves: dict[str, torch.Tensor]
    extra_weights: tuple[torch.Tensor | None, ...]
    supersedes: bool = field(default=False, kw_only=True)  # new per-request values: may replace a stale slot


def seeded_noise(seed: int, frames: int, channels: int) -> torch.Tensor:
    """Gaussian noise [1, T, C] from a CPU generator: the same seed gives the same noise on every device."""
    generator = torch.Generator("cpu").manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return torch.randn(1, frames, channels, generator=generator)


def step_seed(seed: int, step: int) -> int:
    """A distinct, reproducible seed for the noise drawn at `step` of a generation seeded `seed`."""
    return (int(seed) * 1_000_003 + 7_919 * (step + 1)) & 0x7FFF_FFFF_FFFF_FFFF


class FiniteChecks:
    """NaN/inf checks, each a host-device sync on a GPU, so each tensor is checked once while it is unchanged (its
    in-place version counter keys the check): a stream resubmits the same context and target every tick. A tensor
    copied out of others (a window's crop of the song's context) is `derived` from them: checking it checks them,
    once each, instead of a new tensor every tick. One instance, `FINITE_CHECKS`, serves every stream and walker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # a live runner's thread and a ComfyUI worker may submit at once
        self._checked: OrderedDict[int, tuple[weakref.ref, int]] = OrderedDict()  # (tensor, version checked)
        self._sources: OrderedDict[int, tuple[weakref.ref, tuple[int, tuple[weakref.ref, ...]]]] = OrderedDict()

    def derived(self, tensor: torch.Tensor, *sources: torch.Tensor) -> None:
        """`tensor` holds only values copied from `sources` (as they are now): it is finite where they are. No
        sources: made by the engine from inputs it checked (a window of the timeline)."""
        with self._lock:
            _remember(self._sources, tensor, (tensor._version, tuple(weakref.ref(s) for s in sources)))

    def __call__(self, name: str, tensor: torch.Tensor) -> None:
        """Raise ValueError naming `name` if `tensor` (or what it was derived from) holds NaN or inf."""
        with self._lock:
            if _recalled(self._checked, tensor) == tensor._version:
                return
            recorded = _recalled(self._sources, tensor)
        sources = None
        if recorded is not None and recorded[0] == tensor._version:
            sources = [ref() for ref in recorded[1]]
        if sources is None or any(source is None for source in sources):
            if not torch.isfinite(tensor).all():
                raise ValueError(f"{name} contains NaN or infinite values")
        else:
            for source in sources:
                self(name, source)
        with self._lock:
            _remember(self._checked, tensor, tensor._version)


def _remember(table: OrderedDict, tensor: torch.Tensor, value: Any) -> None:
    table[id(tensor)] = (weakref.ref(tensor), value)
    table.move_to_end(id(tensor))
    if len(table) > FINITE_CHECKS_KEPT:
        table.popitem(last=False)


def _recalled(table: OrderedDict, tensor: torch.Tensor) -> Any:
    """What `_remember` kept for this very tensor (an id can be reused once a tensor is gone), else None."""
    entry = table.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None


FINITE_CHECKS = FiniteChecks()


def validate_request(
    request: SlotRequest,
    context_channels: int,
    latent_channels: int,
    in_flight_frames: int | None,
    shared: Mapping[str, torch.Tensor],
    check_finite: Callable[[str, torch.Tensor], None],
) -> None:
    """Raise ValueError, with the fix, for a request a ring cannot run: tensor shapes (against the decoder's
    `context_channels` and `latent_channels` and the T of the work in flight), unknown options, missing inputs an
    option needs, and `shared` curves of the lane whose length does not fit."""
    context = request.context_latents
    if context.dim() != 3 or context.shape[0] != 1 or context.shape[2] != context_channels:
        raise ValueError(f"context_latents must be [1, T, 128], got {tuple(context.shape)}")
    frames = request.frames
    if in_flight_frames is not None and in_flight_frames != frames:
        raise ValueError(
            f"request has T={frames} frames but the in-flight slots have T={in_flight_frames}; drain() first to "
            "change length (sessions sharing a ring play one length: another length needs its own ring)"
        )
    for name, tensor in (
        ("context_latents", context),
        ("source_latents", request.source_latents),
        ("x0_target", request.x0_target),
    ):
        if tensor is None:
            continue
        if tensor.shape[:2] != (1, frames) or (name != "context_latents" and tensor.shape[2] != latent_channels):
            raise ValueError(f"{name} must be [1, {frames}, C], got {tuple(tensor.shape)}")
        check_finite(name, tensor)
    if request.solver not in SOLVERS:
        raise ValueError(f"unknown solver {request.solver!r}: choose one of {', '.join(SOLVERS)}")
    if request.cfg_mode not in CFG_MODES:
        raise ValueError(f"unknown cfg_mode {request.cfg_mode!r}: choose one of {', '.join(CFG_MODES)}")
    if request.guidance_method not in GUIDANCE_METHODS:
        raise ValueError(
            f"unknown guidance_method {request.guidance_method!r}: choose one of {', '.join(GUIDANCE_METHODS)}"
        )
    if request.cfg_mode in ("full", "initialize") and request.negative is None:
        raise ValueError(f"cfg_mode {request.cfg_mode!r} needs a negative conditioning")
    if request.dcw is not None and request.dcw.mode not in DCW_MODES:
        raise ValueError(f"unknown DCW mode {request.dcw.mode!r}: choose one of {', '.join(DCW_MODES)}")
    if request.denoise < 1.0 and request.source_latents is None:
        raise ValueError("denoise < 1 needs source_latents to start from")
    if request.latent_mask is not None and request.source_latents is None:
        raise ValueError("latent_mask needs source_latents (the frames it keeps)")
    if not 0.0 <= request.x0_target_gate < 1.0:
        raise ValueError(f"x0_target_gate must be in [0, 1), got {request.x0_target_gate}")
    for name, curve in shared.items():
        if curve.shape[1] not in (1, frames):
            raise ValueError(f"shared curve {name!r} has {curve.shape[1]} frames but the request has T={frames}")
