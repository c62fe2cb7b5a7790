"""The ring's places and who holds them: a `Slot` is one in-flight generation, a `Lane` is one session's share of
the ring (its slots, its queue of one, its shared curves, its pacing), and `StreamLane` is a session's handle on
its lane. Admission control: a ring refuses a session (or a deeper lane) when the tick cost it has measured says it
could no longer keep every session's `RealtimeNeed`."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from ..lora.attached import lora_set
from ..params import REALTIME_LATENT_INTERVAL_MS
from ..sampling.curves import Curve
from ..sampling.schedule import SchedulePlace
from ..sampling.step import SlotState
from .requests import Prepared, SlotRequest

MAX_DEPTH = 8
MAX_LANES = 8  # sessions sharing one ring besides its main lane; each lane owns MAX_DEPTH slot indices


@dataclass(eq=False)
class Slot(Prepared, SchedulePlace):
    """One in-flight generation: a prepared request in its place in the ring, with the state its steps read and
    write (the request's own tensors, or static copies of them on the graph path)."""

    index: int  # place in the ring (lane.base + place in the lane)
    x: torch.Tensor
    noise: torch.Tensor  # the request's seeded noise, drawn when it entered the ring
    lane: Lane
    step_noise: torch.Tensor | None = None  # graph path: this step's noise, drawn before the device work
    home: int | None = None  # graph path: whose static tensors it reads (its lane's base + its rank by age)
    originals: dict[Any, torch.Tensor | None] | None = None  # graph path: the request's own tensors its home copies
    plan_options: tuple | None = None  # graph path: what its request fixes in a tick plan (`GraphStep._options`)
    step: int = 0
    running: torch.Tensor | None = None
    cached_negative: torch.Tensor | None = None

    def state(self) -> SlotState:
        """What this slot's next step reads (`engine/sampling/step.py`), its lane's shared curves included."""
        request = self.request
        return SlotState(
            x=self.x,
            noise=self.noise,
            source=self.source,
            x0_target=self.x0_target,
            curves=self.curves,
            shared=self.lane.shared,
            schedule=self.schedule,
            step=self.step,
            solver=request.solver,
            cfg_mode=request.cfg_mode,
            guidance_method=request.guidance_method,
            dcw=request.dcw,
            x0_target_gate=request.x0_target_gate,
            running=self.running,
            cached_negative=self.cached_negative,
        )


SlotStart = Callable[[Prepared, "Lane", int], Slot]
"""Makes the slot a prepared request becomes at a place of a lane (the pipeline's: it draws the seeded noise)."""


@dataclass(eq=False)
class Lane:
    """One session's share of the ring: its slots (indices base .. base + MAX_DEPTH - 1), its queue of one, its
    shared curves and pacing, and what it needs to play in real time (admission control)."""

    name: str
    base: int
    depth: int
    paced: bool
    need: RealtimeNeed | None = None
    slots: list[Slot | None] = field(default_factory=list)
    queued: Prepared | None = None
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    loras: dict[str, float] = field(default_factory=dict)  # the session's own LoRA strengths, by LoRA name

    @property
    def idle(self) -> bool:
        return self.queued is None and all(slot is None for slot in self.slots)

    def by_age(self) -> list[Slot]:
        """The slots in flight, the one closest to finishing first (ties: by place). In this order a ring in its
        steady rhythm looks the same every other tick, whichever places its slots hold: tick graphs keyed by it
        recur (`GraphStep` keeps each slot's tensors at its rank's static tensors)."""
        in_flight = [slot for slot in self.slots if slot is not None]
        return sorted(in_flight, key=lambda slot: (slot.steps - slot.step, slot.index))

    def trim(self) -> None:
        while len(self.slots) > self.depth and self.slots[-1] is None:
            self.slots.pop()

    def admit(self, start: SlotStart) -> None:
        """Start the queued request in a free slot; paced, only once every slot in flight is steps/depth steps in
        (or at once in the youngest slot's place, when the request supersedes)."""
        if self.queued is None:
            return
        if self.paced and self._too_soon(self.queued):
            if self.queued.supersedes:
                self._replace_youngest(start)
            return
        for place in range(min(self.depth, len(self.slots))):
            if self.slots[place] is None:
                self.slots[place] = start(self.queued, self, place)
                self.queued = None
                return

    def _replace_youngest(self, start: SlotStart) -> None:
        """Start the queued request in the youngest slot's place, dropping that slot's few steps, unless it
        superseded an older one itself."""
        in_ring = [slot for slot in self.slots[: self.depth] if slot is not None]
        youngest = min(in_ring, key=lambda slot: slot.step, default=None)
        if youngest is not None and not youngest.supersedes:
            place = youngest.index - self.base
            self.slots[place] = start(self.queued, self, place)
            self.queued = None

    def _too_soon(self, prepared: Prepared) -> bool:
        """Paced admission: some slot of the lane in flight is not yet steps/depth steps in."""
        spacing = max(1, (len(prepared.schedule) - 1) // self.depth)
        return any(slot is not None and slot.step < spacing for slot in self.slots)


class AdmissionRefused(ValueError):
    """A ring could not keep every session in real time with one more (the message has the numbers; the fields
    let a server word its own answer, naming no session but the caller's)."""

    def __init__(self, message: str, rows: int, predicted_ms: float, missed: Lane):
        super().__init__(message)
        self.rows = rows  # rows a tick would run
        self.predicted_ms = predicted_ms  # the tick those rows were measured to take
        self.missed = missed  # the lane whose need that tick would miss (at the depth it would play at)


@dataclass(frozen=True)
class RealtimeNeed:
    """What a session needs from a shared ring: a fresh latent at least every `latent_interval_ms`, from slots of
    `steps` steps with `rows_per_slot` rows each (2 with cfg full, else 1)."""

    steps: int
    rows_per_slot: int
    latent_interval_ms: float = REALTIME_LATENT_INTERVAL_MS

    def max_tick_ms(self, depth: int) -> float:
        """The slowest tick that still delivers in time: paced, a latent finishes every steps/depth ticks."""
        return self.latent_interval_ms / max(1, -(-self.steps // depth))


def check_depth(depth: int) -> None:
    """ValueError unless `depth` is a lane depth (an integer in 1..MAX_DEPTH)."""
    if not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth must be an integer in 1..{MAX_DEPTH}, got {depth!r}")


def predict_tick_ms(samples: Iterable[tuple[int, float]], rows: int) -> float | None:
    """A tick's time at `rows` rows from measured (rows, ms) samples: a line through the median ms of each row count
    seen, or ms per row (at the most rows seen) when one count has been seen or the line does not rise with the rows
    (noise); None without samples."""
    by_rows: dict[int, list[float]] = {}
    for count, ms in samples:
        by_rows.setdefault(count, []).append(ms)
    if not by_rows:
        return None
    points = [(count, statistics.median(times)) for count, times in by_rows.items()]
    most_rows, ms_at_most = max(points)
    if len(points) > 1:
        mean_r = sum(r for r, _ in points) / len(points)
        mean_ms = sum(ms for _, ms in points) / len(points)
        slope = sum((r - mean_r) * (ms - mean_ms) for r, ms in points) / sum((r - mean_r) ** 2 for r, _ in points)
        if slope > 0:
            return max(mean_ms + slope * (rows - mean_r), 0.0)
    return rows * ms_at_most / most_rows  # one count seen, or a flat or falling (noisy) line: ms per row


def check_admission(lanes: list[Lane], samples: Iterable[tuple[int, float]], refused: str) -> None:
    """Raise AdmissionRefused (starting with `refused`) if a ring, playing `lanes`, would miss a need, by the
    (rows, ms) tick costs in `samples`."""
    if not any(lane.need is not None for lane in lanes):
        return
    playing = [lane for lane in lanes if lane.need is not None or not lane.idle]  # an idle main lane adds no rows
    rows = sum(lane.depth * (lane.need.rows_per_slot if lane.need else 2) for lane in playing)
    predicted = predict_tick_ms(samples, rows)
    if predicted is None:
        return
    for lane in lanes:
        if lane.need is not None and predicted > lane.need.max_tick_ms(lane.depth):
            raise AdmissionRefused(
                f"{refused}: with it the ring would run {rows} rows a tick, measured to take "
                f"~{predicted:.0f} ms, but session {lane.name!r} (depth {lane.depth}, {lane.need.steps} steps) "
                f"needs a tick within {lane.need.max_tick_ms(lane.depth):.0f} ms to get a latent every "
                f"{lane.need.latent_interval_ms:.0f} ms; end a session, lower a depth or the steps, or start it "
                "on another GPU",
                rows,
                predicted,
                lane,
            )


def deepened(lanes: Iterable[Lane], lane: Lane, depth: int) -> list[Lane]:
    """The ring's lanes as they would be with `lane` at `depth` (for an admission check before the change)."""
    deeper = replace(lane, depth=depth)
    return [deeper if other is lane else other for other in lanes]


class LaneRing(Protocol):
    """What a StreamLane asks of the ring that holds its lane (StreamPipeline's lane calls)."""

    decoder: torch.nn.Module

    def submit_to(self, lane: Lane, request: SlotRequest, supersedes: bool = False) -> None: ...
    def set_lane_depth(self, lane: Lane, depth: int) -> None: ...
    def check_lane_depth(self, lane: Lane, depth: int) -> None: ...
    def set_lane_shared_curve(self, lane: Lane, name: str, value: Curve | None) -> None: ...
    def has_lane(self, lane: Lane) -> bool: ...
    def stats(self) -> dict[str, Any]: ...


class StreamLane:
    """A session's handle on its lane of a shared ring: the same calls as a StreamPipeline's own (submit, depth,
    shared curves), reaching only this lane; `StreamPipeline.tick` advances every lane at once."""

    def __init__(self, pipeline: LaneRing, lane: Lane):
        self.pipeline = pipeline
        self._lane = lane

    @property
    def name(self) -> str:
        return self._lane.name

    @property
    def depth(self) -> int:
        return self._lane.depth

    @property
    def idle(self) -> bool:
        return self._lane.idle

    def submit(self, request: SlotRequest, supersedes: bool = False) -> None:
        """Queue a request on this lane (see `StreamPipeline.submit`)."""
        self._check_open()
        self.pipeline.submit_to(self._lane, request, supersedes)

    def set_depth(self, depth: int) -> None:
        """Hot depth change; a deeper lane is refused (AdmissionRefused) if the ring could then no longer keep every
        session's need."""
        self.check_depth(depth)
        self.pipeline.set_lane_depth(self._lane, depth)

    def check_depth(self, depth: int) -> None:
        """Raise AdmissionRefused, with the numbers, if this lane at `depth` would make the ring miss a need."""
        self._check_open()
        self.pipeline.check_lane_depth(self._lane, depth)

    def set_shared_curve(self, name: str, value: Curve | None) -> None:
        """Override a step-time field for every slot of this lane from the next tick; None reverts."""
        self._check_open()
        self.pipeline.set_lane_shared_curve(self._lane, name, value)

    def shared_curves(self) -> dict[str, torch.Tensor]:
        return dict(self._lane.shared)

    def set_lora_strength(self, name: str, strength: float) -> None:
        """This session's own strength for a live LoRA of the decoder, heard from the next tick by its rows only
        (the other sessions keep theirs); ValueError for an unknown or folded LoRA or a strength out of range."""
        self._check_open()
        lora_set(self.pipeline.decoder).check_own_strength(name, strength)
        self._lane.loras[name] = float(strength)

    def lora_strength(self, name: str) -> float:
        """The strength this session hears a LoRA at: its own, else the decoder's shared one."""
        loras = lora_set(self.pipeline.decoder)
        shared = loras.strength(name)
        return shared if name in loras.folded_names else self._lane.loras.get(name, shared)

    def stats(self) -> dict[str, Any]:
        """The whole ring's tick stats (every lane shares its ticks)."""
        return self.pipeline.stats()

    def _check_open(self) -> None:
        if not self.pipeline.has_lane(self._lane):
            raise ValueError(f"session {self._lane.name!r} has ended: add a new lane to play again")
