"""StreamPipeline: a ring of in-flight generations ("slots") at different denoise steps, advanced together by
one batched DiT forward per tick.

Each slot owns its request (seed, schedule, source, conditions, CFG mode, curves) and its state; every row of
the tick's batch (positive, negative, extra conditions, of every slot) goes through ONE decoder call. A request
submitted while a slot is free starts on the next tick and is delivered by the tick that takes its last step,
so its latency is exactly `steps` ticks. Shared curves override a step-time field for every in-flight slot from
the next tick on. Rows never depend on each other: a request's latent equals one-shot generation bit for bit.
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..conditioning import Conditioning
from ..lora.attached import LoraSet, lora_set, refresh_folds, structure_lock
from ..models.dit import CrossGroup, CrossKV, DiTDecoder
from ..params import CFG_MODES, DCW_MODES, GUIDANCE_METHODS, SHARED_FIELDS, SOLVERS
from ..sampling import solver
from ..sampling.curves import Curve, as_curve
from ..sampling.schedule import timestep_schedule
from .backends import decoder_forward, uses_graphs
from .pinned import PinnedStaging
from .tick_graph import DEVICE_WORK, GraphCounters, StaticTensors, TickGraphs

MAX_DEPTH = 8
MAX_LANES = 8  # sessions sharing one ring besides its main lane; each lane owns MAX_DEPTH slot indices
COST_SAMPLES = 64  # recent (rows, tick ms) pairs admission control predicts from
MAIN_LANE = "main"  # the lane a pipeline's own submit/set_depth/set_shared_curve reach
MODULATION_CACHE_SIZE = 512
FINITE_CHECKS_KEPT = 64


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
    steps: int = 8
    shift: float = 3.0
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
    tag: Any = None

    @property
    def frames(self) -> int:
        return self.context_latents.shape[1]


@dataclass(eq=False)
class Finished:
    latent: torch.Tensor  # [1, T, 64]
    request: SlotRequest
    ticks: int  # ticks the request spent in its slot
    lane: str = MAIN_LANE  # the session (lane of the ring) that submitted it


@dataclass(eq=False)
class _Prepared:
    """A validated request with its device tensors made at submit time, so a tick never waits on the host."""

    request: SlotRequest
    schedule: tuple[float, ...]
    source: torch.Tensor | None
    context: torch.Tensor
    x0_target: torch.Tensor | None
    curves: dict[str, torch.Tensor]
    extra_weights: tuple[torch.Tensor | None, ...]
    supersedes: bool = field(default=False, kw_only=True)  # new per-request values: may replace a stale slot


@dataclass(eq=False)
class _Slot(_Prepared):
    """One in-flight generation: a prepared request in its place in the ring, with the state its steps read and
    write (the request's own tensors, or static copies of them on the graph path)."""

    index: int  # place in the ring (lane.base + place in the lane)
    x: torch.Tensor
    noise: torch.Tensor  # the request's seeded noise, drawn when it entered the ring
    lane: _Lane
    step_noise: torch.Tensor | None = None  # graph path: this step's noise, drawn before the device work
    step: int = 0
    running: torch.Tensor | None = None
    cached_negative: torch.Tensor | None = None

    @property
    def steps(self) -> int:
        return len(self.schedule) - 1

    @property
    def t(self) -> float:
        return self.schedule[self.step]

    @property
    def t_next(self) -> float:
        return self.schedule[self.step + 1]


@dataclass(eq=False)
class _Row:
    slot: _Slot
    conditioning: Conditioning
    negative: bool
    weight: torch.Tensor | None = None


@dataclass(frozen=True)
class _StepResult:
    """What one slot's step produced: its next latent and the guidance state the next step reads."""

    x: torch.Tensor
    running: torch.Tensor | None
    cached_negative: torch.Tensor | None


@dataclass(frozen=True)
class _Layout:
    """The batch of a tick: rows reordered so each condition's rows are contiguous (conditions in order of first
    use); `batch[p]` is the index in `rows` of batch position p. A condition heard at a session's own LoRA
    strengths (on the cross K/V projections) is a condition of its own: `kv_strengths` says which."""

    batch: tuple[int, ...]
    conditions: tuple[Conditioning, ...]
    counts: tuple[int, ...]
    kv_strengths: tuple[tuple[float, ...] | None, ...]

    @staticmethod
    def of(rows: list[_Row], kv_strengths: dict[str, tuple[float, ...] | None]) -> _Layout:
        """`kv_strengths`: by lane, the LoRA strengths its conditions' K/V are built at (None: the decoder's)."""
        by_condition: dict[tuple, list[int]] = {}
        conditions: dict[tuple, Conditioning] = {}
        for index, row in enumerate(rows):
            key = (id(row.conditioning), kv_strengths.get(row.slot.lane.name))
            by_condition.setdefault(key, []).append(index)
            conditions.setdefault(key, row.conditioning)
        return _Layout(
            tuple(i for indices in by_condition.values() for i in indices),
            tuple(conditions.values()),
            tuple(len(indices) for indices in by_condition.values()),
            tuple(strengths for _, strengths in conditions),
        )

    def groups(self, kvs: list[CrossKV]) -> list[CrossGroup]:
        starts = [sum(self.counts[:g]) for g in range(len(self.counts))]
        return [CrossGroup(kv, start, count) for kv, start, count in zip(kvs, starts, self.counts)]


@dataclass(frozen=True)
class _OwnStrengths:
    """What a lane's LoRA strengths change in a tick: `rows`, its rows' strengths in the batched forward (None: the
    shared ones); `kv`, those its conditions' cross K/V are built at (None unless a live LoRA changes the K/V
    projections); `time`, the key of its timestep embeddings (None unless a LoRA changes the embedders)."""

    rows: tuple[float, ...] | None = None
    kv: tuple[float, ...] | None = None
    time: tuple | None = None


SHARED_STRENGTHS = _OwnStrengths()


@dataclass
class TickStats:
    ticks: int = 0
    rows: int = 0
    steady: bool = False  # the last tick was a steady one (no first run or capture): its cost is worth learning
    negative_rows: int = 0
    active_slots: int = 0
    last_tick_ms: float = 0.0
    finished: int = 0
    gpu_events: tuple[Any, Any] | None = None
    history_ms: list[float] = field(default_factory=list)
    cost_samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=COST_SAMPLES))  # (rows, ms)
    pending_cost: tuple[int, tuple[Any, Any]] | None = None  # a GPU tick's (rows, events) not yet complete


@dataclass(eq=False)
class _Lane:
    """One session's share of the ring: its slots (indices base .. base + MAX_DEPTH - 1), its queue of one, its
    shared curves and pacing, and what it needs to play in real time (admission control)."""

    name: str
    base: int
    depth: int
    paced: bool
    need: RealtimeNeed | None = None
    slots: list[_Slot | None] = field(default_factory=list)
    queued: _Prepared | None = None
    shared: dict[str, torch.Tensor] = field(default_factory=dict)
    loras: dict[str, float] = field(default_factory=dict)  # the session's own LoRA strengths, by LoRA name

    @property
    def idle(self) -> bool:
        return self.queued is None and all(slot is None for slot in self.slots)

    def trim(self) -> None:
        while len(self.slots) > self.depth and self.slots[-1] is None:
            self.slots.pop()


class AdmissionRefused(ValueError):
    """A ring could not keep every session in real time with one more (the message has the numbers)."""


@dataclass(frozen=True)
class RealtimeNeed:
    """What a session needs from a shared ring: a fresh latent at least every `latent_interval_ms`, from slots of
    `steps` steps with `rows_per_slot` rows each (2 with cfg full, else 1)."""

    steps: int
    rows_per_slot: int
    latent_interval_ms: float = 250.0

    def max_tick_ms(self, depth: int) -> float:
        """The slowest tick that still delivers in time: paced, a latent finishes every steps/depth ticks."""
        return self.latent_interval_ms / max(1, -(-self.steps // depth))


class StreamPipeline:
    def __init__(self, decoder: DiTDecoder, depth: int = 4, backend: str = "eager", paced: bool = False):
        """`paced`: admit a request only once the youngest slot is steps/depth steps in, so slots stay evenly
        staggered and a latent finishes every steps/depth ticks (a live stream's shared knobs are heard that
        soon); unpaced, a free slot is filled on the next tick and finishes bunch together after a ramp-up."""
        self.decoder = decoder
        self._check_depth(depth)
        self._lanes: dict[str, _Lane] = {}
        self._main = self._new_lane(MAIN_LANE, depth, paced, None)
        self._modulation: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._stats = TickStats()
        self.backend = backend
        self.decoder_forward = decoder_forward(decoder, backend)
        device = self._device_dtype()[0]
        self._graphs = TickGraphs(device) if uses_graphs(backend) else None
        self._static = StaticTensors(device)
        self._staging = PinnedStaging(device)
        self._last_noise: tuple[tuple, torch.Tensor] | None = None
        self._kv_owner: dict[int, CrossKV] = {}  # the K/V each group's static tensors hold
        self._finite_checked: OrderedDict[int, weakref.ref[torch.Tensor]] = OrderedDict()
        self.cycle_costs = False  # True: whoever drives the ticks reports what a whole cycle costs (record_cycle)

    # ---- configuration ---------------------------------------------------------------------------------------

    @staticmethod
    def _check_depth(depth: int) -> None:
        if not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
            raise ValueError(f"depth must be an integer in 1..{MAX_DEPTH}, got {depth!r}")

    @property
    def depth(self) -> int:
        return self._main.depth

    @property
    def paced(self) -> bool:
        return self._main.paced

    @property
    def graph_counters(self) -> GraphCounters | None:
        """A copy of the tick graphs' counters (new plans, captures, replays...); None on a backend without graphs."""
        return None if self._graphs is None else replace(self._graphs.counters)

    def set_depth(self, depth: int) -> None:
        """Hot depth change: growing adds free slots; shrinking stops admitting to the removed slots, whose
        in-flight work finishes and is delivered before they disappear."""
        self._set_depth(self._main, depth)

    def _set_depth(self, lane: _Lane, depth: int) -> None:
        self._check_depth(depth)
        lane.depth = depth
        if len(lane.slots) < depth:
            lane.slots.extend([None] * (depth - len(lane.slots)))
        lane.trim()

    def _slots_in_flight(self) -> list[_Slot]:
        return [slot for lane in self._lanes.values() for slot in lane.slots if slot is not None]

    @property
    def frames(self) -> int | None:
        """T of the in-flight work, every lane's (one batch; None when idle)."""
        for slot in self._slots_in_flight():
            return slot.request.frames
        return None

    def set_shared_curve(self, name: str, value: Curve | None) -> None:
        """Override a step-time field for every in-flight slot from the next tick; None reverts to per-slot values."""
        self._set_shared_curve(self._main, name, value)

    def _set_shared_curve(self, lane: _Lane, name: str, value: Curve | None) -> None:
        if name not in SHARED_FIELDS:
            raise ValueError(f"unknown shared curve {name!r}: choose one of {', '.join(SHARED_FIELDS)}")
        if value is None:
            lane.shared.pop(name, None)
            return
        frames = self.frames or (lane.queued.request.frames if lane.queued else None)
        curve = self._to_device(as_curve(value, frames if frames is not None else _length_of(value), name))
        if self._graphs is not None and frames is not None:
            curve = self._static.put(("shared", lane.base, name), curve, (1, frames, 1))
        lane.shared[name] = curve

    def shared_curves(self) -> dict[str, torch.Tensor]:
        return dict(self._main.shared)

    # ---- lanes: several sessions in one ring ----------------------------------------------------------------

    def add_lane(self, name: str, depth: int = 4, paced: bool = True, need: RealtimeNeed | None = None) -> StreamLane:
        """A new session's share of the ring: its own slots, queue, shared curves and pacing, its rows in the same
        batched forward as every other lane's. With a `need`, refused (ValueError, with the reason) when the
        measured tick cost says the ring could no longer keep this or another lane in real time."""
        if name in self._lanes:
            raise ValueError(f"the ring has a session named {name!r} already: end it first or pick another name")
        if len(self._lanes) > MAX_LANES:  # the main lane does not count
            raise ValueError(f"the ring holds {MAX_LANES} sessions already: end one, or start another ring/GPU")
        self._check_depth(depth)
        self._admission_check([*self._lanes.values(), _Lane(name, -1, depth, paced, need)], f"session {name!r} refused")
        return StreamLane(self, self._new_lane(name, depth, paced, need))

    def remove_lane(self, name: str) -> None:
        """End a session: its slots and queued request are dropped at once (the other lanes play on)."""
        if name == MAIN_LANE or name not in self._lanes:
            raise ValueError(f"no session {name!r} to end in this ring (sessions: {', '.join(self._lanes)})")
        del self._lanes[name]

    @property
    def lane_names(self) -> list[str]:
        """Every lane's name, the main lane's first."""
        return list(self._lanes)

    def lane(self, name: str) -> StreamLane:
        if name not in self._lanes:
            raise ValueError(f"no session {name!r} in this ring (sessions: {', '.join(self._lanes)})")
        return StreamLane(self, self._lanes[name])

    def _new_lane(self, name: str, depth: int, paced: bool, need: RealtimeNeed | None) -> _Lane:
        used = {lane.base for lane in self._lanes.values()}
        base = next(MAX_DEPTH * i for i in range(MAX_LANES + 1) if MAX_DEPTH * i not in used)
        lane = _Lane(name, base, depth, paced, need, [None] * depth)
        self._lanes[name] = lane
        return lane

    def predicted_tick_ms(self, rows: int) -> float | None:
        """A tick's time at `rows` rows from the steady ticks measured so far (no first runs or captures): device
        time on a GPU, or the driver's whole cycle with `cycle_costs`. A line through the median ms of each row
        count seen, or ms per row (at the most rows seen) when one count has been seen or the line does not rise
        with the rows (noise); None before any tick."""
        by_rows: dict[int, list[float]] = {}
        for count, ms in self._stats.cost_samples:
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

    def record_cycle(self, ms: float) -> None:
        """The time from one tick's start to the next of a driver that does more than tick (a shared ring: every
        session's knobs and requests, the handing out of latents); learnt in place of the device time when
        `cycle_costs` is set, for steady ticks only."""
        stats = self._stats
        if self.cycle_costs and stats.steady:
            stats.cost_samples.append((stats.rows, ms))

    def _admission_check(self, lanes: list[_Lane], refused: str) -> None:
        """Raise AdmissionRefused (starting with `refused`) if the ring, playing `lanes`, would miss a need."""
        if not any(lane.need is not None for lane in lanes):
            return
        playing = [lane for lane in lanes if lane.need is not None or not lane.idle]  # an idle main lane adds no rows
        rows = sum(lane.depth * (lane.need.rows_per_slot if lane.need else 2) for lane in playing)
        predicted = self.predicted_tick_ms(rows)
        if predicted is None:
            return
        for lane in lanes:
            if lane.need is not None and predicted > lane.need.max_tick_ms(lane.depth):
                raise AdmissionRefused(
                    f"{refused}: with it the ring would run {rows} rows a tick, measured to take "
                    f"~{predicted:.0f} ms, but session {lane.name!r} (depth {lane.depth}, {lane.need.steps} steps) "
                    f"needs a tick within {lane.need.max_tick_ms(lane.depth):.0f} ms to get a latent every "
                    f"{lane.need.latent_interval_ms:.0f} ms; end a session, lower a depth or the steps, or start it "
                    "on another GPU"
                )

    # ---- requests --------------------------------------------------------------------------------------------

    def submit(self, request: SlotRequest, supersedes: bool = False) -> None:
        """Queue a request (a queue of one: a newer submission replaces one that has not started).

        `supersedes`: the request carries new per-request values (a knob, a prompt), so what is in flight is stale.
        Paced, where it would wait for the youngest slot to get steps/depth steps in, it takes that slot's place at
        once, unless that slot superseded too (so a knob swept every tick cannot starve the ring). A queued request
        that supersedes passes that on to the one replacing it. Validation, cross-attention K/V of its conditions
        and curves are all made here; its seeded noise when it enters the ring (most queued requests of a live
        stream are replaced before they do)."""
        self._submit(self._main, request, supersedes)

    def _submit(self, lane: _Lane, request: SlotRequest, supersedes: bool) -> None:
        self._validate(request, lane)
        supersedes = supersedes or (lane.queued is not None and lane.queued.supersedes)
        lane.queued = self._prepare(request, self._lora_strengths(lane).kv)
        lane.queued.supersedes = supersedes

    def _prepare(self, request: SlotRequest, kv_strengths: tuple[float, ...] | None = None) -> _Prepared:
        device, dtype = self._device_dtype()
        for conditioning in (
            request.conditioning,
            request.negative,
            *(e.conditioning for e in request.extra_conditions),
        ):
            if conditioning is not None:
                conditioning.cross_kv(self.decoder, kv_strengths)
        frames = request.frames
        curves = {
            name: self._to_device(as_curve(getattr(request, name), frames, name))
            for name in CURVE_FIELDS
            if getattr(request, name) is not None
        }
        extra_weights = tuple(
            None if e.weight is None else self._to_device(as_curve(e.weight, frames, "extra condition weight"))
            for e in request.extra_conditions
        )
        return _Prepared(
            request=request,
            schedule=timestep_schedule(int(request.steps), float(request.shift), float(request.denoise)),
            source=None if request.source_latents is None else request.source_latents.to(device, dtype),
            context=request.context_latents.to(device, dtype),
            x0_target=None if request.x0_target is None else request.x0_target.to(device, dtype),
            curves=curves,
            extra_weights=extra_weights,
        )

    def _validate(self, request: SlotRequest, lane: _Lane) -> None:
        context = request.context_latents
        if (
            context.dim() != 3
            or context.shape[0] != 1
            or context.shape[2] != self.decoder.config.in_channels - self.decoder.config.audio_acoustic_hidden_dim
        ):
            raise ValueError(f"context_latents must be [1, T, 128], got {tuple(context.shape)}")
        frames = request.frames
        in_flight = self.frames
        if in_flight is not None and in_flight != frames:
            raise ValueError(
                f"request has T={frames} frames but the in-flight slots have T={in_flight}; drain() first to change "
                "length (sessions sharing a ring play one length: another length needs its own ring)"
            )
        for name, tensor in (
            ("context_latents", context),
            ("source_latents", request.source_latents),
            ("x0_target", request.x0_target),
        ):
            if tensor is None:
                continue
            if tensor.shape[:2] != (1, frames) or (
                name != "context_latents" and tensor.shape[2] != self.decoder.config.audio_acoustic_hidden_dim
            ):
                raise ValueError(f"{name} must be [1, {frames}, C], got {tuple(tensor.shape)}")
            self._check_finite(name, tensor)
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
        for name, curve in lane.shared.items():
            if curve.shape[1] not in (1, frames):
                raise ValueError(f"shared curve {name!r} has {curve.shape[1]} frames but the request has T={frames}")

    def _check_finite(self, name: str, tensor: torch.Tensor) -> None:
        """NaN/inf check (a host-device sync on a GPU), done once per tensor: a stream resubmits the same context
        and target tensors every tick."""
        seen = self._finite_checked.get(id(tensor))
        if seen is not None and seen() is tensor:
            return
        if not torch.isfinite(tensor).all():
            raise ValueError(f"{name} contains NaN or infinite values")
        self._finite_checked[id(tensor)] = weakref.ref(tensor)
        if len(self._finite_checked) > FINITE_CHECKS_KEPT:
            self._finite_checked.popitem(last=False)

    def drain(self, max_ticks: int = 1000) -> list[Finished]:
        """Tick until every slot and the queue are empty; returns everything delivered on the way."""
        delivered: list[Finished] = []
        for _ in range(max_ticks):
            if self.idle:
                break
            delivered.extend(self.tick())
        return delivered

    @property
    def idle(self) -> bool:
        return all(lane.idle for lane in self._lanes.values())

    # ---- the tick --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def tick(self) -> list[Finished]:
        """Admit a queued request, advance every active slot one step in one batched forward, deliver finished ones."""
        with structure_lock(self.decoder):  # LoRAs are attached, detached or merged between ticks, never in one
            refresh_folds(self.decoder)
            return self._tick()

    def _tick(self) -> list[Finished]:
        started = time.perf_counter()
        events = self._gpu_events()
        for lane in self._lanes.values():
            self._admit(lane)
        active = self._slots_in_flight()
        if not active:
            return []
        rows = [row for slot in active for row in self._rows_for(slot)]
        strengths = {lane.name: self._lora_strengths(lane) for lane in {id(s.lane): s.lane for s in active}.values()}
        layout = _Layout.of(rows, {name: own.kv for name, own in strengths.items()})
        lora_rows = self._lora_rows(rows, layout, strengths)
        if self._graphs is None:
            with DEVICE_WORK:  # a compiled layer's first run autotunes with a device sync
                self._eager_step(active, rows, layout, strengths, lora_rows)
            steady = True
        else:
            replays = self._graphs.counters.replays
            self._graph_step(active, rows, layout, strengths, lora_rows)
            steady = self._graphs.counters.replays > replays  # not a first run or a capture: a cost to learn from
        finished: list[Finished] = []
        for slot in active:
            slot.step += 1
            if slot.step == slot.steps:
                slot.lane.slots[slot.index - slot.lane.base] = None
                latent = slot.x if self._graphs is None else slot.x.clone()
                finished.append(Finished(latent, slot.request, slot.steps, slot.lane.name))
        for lane in self._lanes.values():
            lane.trim()
        if events is not None:
            events[1].record()
            self._stats.gpu_events = events
        self._record(started, rows, active, finished, steady)
        return finished

    def _lora_strengths(self, lane: _Lane) -> _OwnStrengths:
        """The lane's LoRA strengths for this tick (its own where it set any, else the decoder's shared ones)."""
        loras: LoraSet | None = self.decoder.__dict__.get("_lora_set")
        if loras is None or not loras.attached:
            return SHARED_STRENGTHS
        live = loras.live_adapters()
        own = loras.strengths_with(lane.loras) if lane.loras and live else None
        on_time = any(adapter.touches_time_embedding() for _, adapter in loras.attached.values())
        return _OwnStrengths(
            own,
            own if any(adapter.touches_cross_kv() for adapter in live) else None,
            (loras.version, own) if on_time else None,
        )

    def _lora_rows(self, rows: list[_Row], layout: _Layout, strengths: dict[str, _OwnStrengths]) -> torch.Tensor | None:
        """[rows, MAX_LORAS] host tensor of every batch row's LoRA strengths, or None when every lane in the tick
        plays the shared ones (the forward then reads the decoder's strengths tensor)."""
        if all(own.rows is None for own in strengths.values()):
            return None
        shared = tuple(lora_set(self.decoder).host_strengths)
        return torch.tensor(
            [strengths[rows[i].slot.lane.name].rows or shared for i in layout.batch], dtype=torch.float32
        )

    def _row_embeddings(
        self, rows: list[_Row], layout: _Layout, strengths: dict[str, _OwnStrengths]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each batch row's (temb, modulation) at its slot's t, in batch order."""
        return [self._timestep_embedding(rows[i].slot.t, strengths[rows[i].slot.lane.name].time) for i in layout.batch]

    def _eager_step(
        self,
        active: list[_Slot],
        rows: list[_Row],
        layout: _Layout,
        strengths: dict[str, _OwnStrengths],
        lora_rows: torch.Tensor | None,
    ) -> None:
        embeddings = self._row_embeddings(rows, layout, strengths)
        temb = torch.cat([e[0] for e in embeddings])
        modulation = torch.cat([e[1] for e in embeddings])
        kvs = [c.cross_kv(self.decoder, own) for c, own in zip(layout.conditions, layout.kv_strengths)]
        groups = layout.groups(kvs)
        times = {id(slot): (slot.t, slot.t_next) for slot in active}
        if lora_rows is not None:
            lora_rows = lora_rows.to(self._device_dtype()[0])
        results = self._device_step(active, rows, layout, groups, temb, modulation, times, lora_rows)
        for slot, result in zip(active, results):
            slot.x, slot.running, slot.cached_negative = result.x, result.running, result.cached_negative

    def _graph_step(
        self,
        active: list[_Slot],
        rows: list[_Row],
        layout: _Layout,
        strengths: dict[str, _OwnStrengths],
        lora_rows: torch.Tensor | None,
    ) -> None:
        """The same device work through static tensors: plain PyTorch the first time a plan comes, captured the
        second, one graph replay after that. Host work here is copies: times, embeddings, strengths, changed K/V."""
        static = self._static
        dtype = self._device_dtype()[1]
        embeddings = self._row_embeddings(rows, layout, strengths)
        hidden = embeddings[0][0].shape[-1]
        temb = static.get("temb", (len(rows), hidden), dtype)
        modulation = static.get("modulation", (len(rows), 6, hidden), dtype)
        torch.cat([e[0] for e in embeddings], out=temb)
        torch.cat([e[1] for e in embeddings], out=modulation)
        clock = torch.tensor([[slot.t, slot.t_next] for slot in active], dtype=torch.float32)
        times_device = static.get("times", ((MAX_LANES + 1) * MAX_DEPTH, 2), torch.float32)
        self._staging.copy(clock, times_device[: len(active)])
        times = {
            id(slot): (times_device[i, 0].view(1, 1, 1), times_device[i, 1].view(1, 1, 1))
            for i, slot in enumerate(active)
        }
        kvs = [self._static_kv(g, c, own) for g, (c, own) in enumerate(zip(layout.conditions, layout.kv_strengths))]
        groups = layout.groups(kvs)
        if lora_rows is not None:
            static_rows = static.get("lora_rows", tuple(lora_rows.shape), torch.float32)
            self._staging.copy(lora_rows, static_rows)
            lora_rows = static_rows
        for slot in active:
            if self._uses_step_noise(slot):
                slot.step_noise.copy_(self._draw_step_noise(slot, slot.step))
        plan = self._plan(active, rows, layout, lora_rows is not None)

        def step() -> tuple[tuple[bool, bool], ...]:
            results = self._device_step(active, rows, layout, groups, temb, modulation, times, lora_rows)
            facts = []
            for slot, result in zip(active, results):
                slot.x.copy_(result.x)
                facts.append(
                    (
                        self._keep(slot, "running", result.running),
                        self._keep(slot, "cached_negative", result.cached_negative),
                    )
                )
            return tuple(facts)

        for slot, (has_running, has_cached) in zip(active, self._graphs.run(plan, step)):
            slot.running = self._static_state(slot, "running") if has_running else None
            slot.cached_negative = self._static_state(slot, "cached_negative") if has_cached else None

    def _keep(self, slot: _Slot, name: str, value: torch.Tensor | None) -> bool:
        """Copy a guidance state into the slot's static tensor (graph path); whether there is one."""
        if value is None:
            return False
        target = self._static_state(slot, name)
        if value is not target:
            target.copy_(value)
        return True

    def _static_state(self, slot: _Slot, name: str) -> torch.Tensor:
        return self._static.get((slot.index, name), tuple(slot.x.shape), slot.x.dtype)

    def _static_kv(self, group: int, conditioning: Conditioning, strengths: tuple[float, ...] | None) -> CrossKV:
        """The group's static K/V, refreshed (one fused copy) when a different condition takes the group or its
        K/V were rebuilt (a LoRA strength on the cross K/V projections changed)."""
        kv = conditioning.cross_kv(self.decoder, strengths)
        names = [("kv", group, side, layer) for side in "kv" for layer in range(len(kv.keys))]
        static = [self._static.get(name, tuple(t.shape), t.dtype) for name, t in zip(names, kv.keys + kv.values)]
        if self._kv_owner.get(group) is not kv:
            torch._foreach_copy_(static, kv.keys + kv.values)
            self._kv_owner[group] = kv
        layers = len(kv.keys)
        return CrossKV(static[:layers], static[layers:])

    def _plan(self, active: list[_Slot], rows: list[_Row], layout: _Layout, per_row_loras: bool) -> tuple:
        """Everything that shapes a tick's device work besides tensor values: the graph's key."""
        slots = tuple(
            (
                slot.index,
                self._step_facts(slot),
                slot.t > 0,
                slot.t_next > 0,
                slot.request.solver,
                slot.request.cfg_mode,
                slot.request.guidance_method,
                slot.request.dcw,
                slot.request.x0_target_gate,
                slot.source is not None,
                slot.x0_target is not None,
                tuple(sorted(slot.curves)),
                tuple(weight is not None for weight in slot.extra_weights),
                slot.running is not None,
                slot.cached_negative is not None,
            )
            for slot in active
        )
        row_kinds = tuple((row.slot.index, row.negative, row.weight is not None) for row in rows)
        kv_lengths = tuple(c.length for c in layout.conditions)
        frames = active[0].x.shape[1]
        shared = tuple(
            (lane.base, tuple(sorted((name, tuple(curve.shape)) for name, curve in lane.shared.items())))
            for lane in self._lanes.values()
        )
        structure = self.decoder.structure_version  # LoRAs attached or detached: the layers themselves changed
        return frames, slots, row_kinds, layout.batch, layout.counts, kv_lengths, shared, structure, per_row_loras

    def _step_facts(self, slot: _Slot) -> tuple:
        """What a slot's place in its schedule changes in the device work: the conditions whose step range is
        active, the negative row, and the x0 target's pull. Not the step itself: every step of a schedule (of any
        length) with the same facts shares one plan, so knob changes do not multiply plans."""
        request = slot.request
        ranges = (request.primary_step_range, *(extra.step_range for extra in request.extra_conditions))
        active = tuple(solver.step_range_active(r, slot.step, slot.steps) for r in ranges)
        return active, self._needs_negative(slot), self._x0_pull(slot)

    def _device_step(
        self,
        active: list[_Slot],
        rows: list[_Row],
        layout: _Layout,
        groups: list[CrossGroup],
        temb: torch.Tensor,
        modulation: torch.Tensor,
        times: dict[int, tuple[Any, Any]],
        lora_rows: torch.Tensor | None,
    ) -> list[_StepResult]:
        """The device work of a tick: one decoder call over every row (at each row's session's LoRA strengths when
        `lora_rows` [rows, MAX_LORAS] is given), then each slot's guidance and step."""
        inputs = {id(slot): self._model_input(slot, times[id(slot)][0]) for slot in active}
        x = torch.cat([inputs[id(rows[i].slot)] for i in layout.batch])
        context = torch.cat([rows[i].slot.context for i in layout.batch])
        if lora_rows is None:
            velocities = self.decoder_forward(x, temb, modulation, context, groups)
        else:
            with lora_set(self.decoder).rows_at(lora_rows):
                velocities = self.decoder_forward(x, temb, modulation, context, groups)
        position = {index: p for p, index in enumerate(layout.batch)}
        return [
            self._advance(
                slot,
                [(row, velocities[position[i]]) for i, row in enumerate(rows) if row.slot is slot],
                *times[id(slot)],
            )
            for slot in active
        ]

    def _gpu_events(self) -> tuple[Any, Any] | None:
        """A (start, end) CUDA event pair with the start recorded now; None on the CPU."""
        device = self._device_dtype()[0]
        if device.type != "cuda":
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def _admit(self, lane: _Lane) -> None:
        if lane.queued is None:
            return
        if lane.paced and self._too_soon(lane, lane.queued):
            if lane.queued.supersedes:
                self._replace_youngest(lane)
            return
        for place in range(min(lane.depth, len(lane.slots))):
            if lane.slots[place] is None:
                lane.slots[place] = self._start(lane.queued, lane, place)
                lane.queued = None
                return

    def _replace_youngest(self, lane: _Lane) -> None:
        """Start the queued request in the youngest slot's place, dropping that slot's few steps, unless it
        superseded an older one itself."""
        in_ring = [slot for slot in lane.slots[: lane.depth] if slot is not None]
        youngest = min(in_ring, key=lambda slot: slot.step, default=None)
        if youngest is not None and not youngest.supersedes:
            place = youngest.index - lane.base
            lane.slots[place] = self._start(lane.queued, lane, place)
            lane.queued = None

    @staticmethod
    def _too_soon(lane: _Lane, prepared: _Prepared) -> bool:
        """Paced admission: some slot of the lane in flight is not yet steps/depth steps in."""
        spacing = max(1, (len(prepared.schedule) - 1) // lane.depth)
        return any(slot is not None and slot.step < spacing for slot in lane.slots)

    def _start(self, prepared: _Prepared, lane: _Lane, place: int) -> _Slot:
        request, source, curves = prepared.request, prepared.source, prepared.curves
        dtype = self._device_dtype()[1]
        channels = self.decoder.config.audio_acoustic_hidden_dim
        noise = self._seeded_noise(request.seed, request.frames, channels, dtype)
        if source is not None and "initial_noise" in curves:
            x = solver.noised(source, noise, curves["initial_noise"])
        elif source is not None and request.denoise < 1.0:
            x = solver.noised(source, noise, prepared.schedule[0])
        else:
            x = noise
        slot = _Slot(**vars(prepared), index=lane.base + place, x=x, noise=noise, lane=lane)
        return slot if self._graphs is None else self._to_static(slot)

    def _seeded_noise(self, seed: int, frames: int, channels: int, dtype: torch.dtype) -> torch.Tensor:
        """A request's starting noise on the device. The last one is kept: a live stream's requests share the seed
        knob's value, and drawing 60 s of noise costs ~1 ms of host time (no slot writes into it)."""
        key = (int(seed), frames, channels, dtype)
        if self._last_noise is None or self._last_noise[0] != key:
            self._last_noise = (key, self._staging.to_device(seeded_noise(seed, frames, channels), dtype))
        return self._last_noise[1]

    def _to_static(self, slot: _Slot) -> _Slot:
        """Copy a new slot's tensors into its place's static tensors (curves at full length) and give it a static
        tensor for its per-step noise, so a captured tick finds everything at fixed addresses."""
        put, index = self._static.put, slot.index
        frames_shape = (1, slot.x.shape[1], 1)
        slot.x = put((index, "x"), slot.x)
        slot.noise = put((index, "noise"), slot.noise)
        slot.context = put((index, "context"), slot.context)
        slot.source = None if slot.source is None else put((index, "source"), slot.source)
        slot.x0_target = None if slot.x0_target is None else put((index, "x0_target"), slot.x0_target)
        slot.curves = {name: put((index, "curve", name), c, frames_shape) for name, c in slot.curves.items()}
        slot.extra_weights = tuple(
            None if w is None else put((index, "extra", e), w, frames_shape) for e, w in enumerate(slot.extra_weights)
        )
        slot.step_noise = self._static.get((index, "step_noise"), tuple(slot.x.shape), slot.x.dtype)
        return slot

    def _curve(self, slot: _Slot, name: str) -> torch.Tensor | None:
        """The effective value of a step-time field: the shared override if set, else the slot's own."""
        shared = slot.lane.shared.get(name)
        return shared if shared is not None else slot.curves.get(name)

    def _needs_negative(self, slot: _Slot) -> bool:
        mode = slot.request.cfg_mode
        return mode == "full" or (mode == "initialize" and slot.step == 0)

    def _rows_for(self, slot: _Slot) -> list[_Row]:
        request = slot.request
        rows = []
        if solver.step_range_active(request.primary_step_range, slot.step, slot.steps) or not request.extra_conditions:
            rows.append(_Row(slot, request.conditioning, False, slot.curves.get("primary_weight")))
        for extra, weight in zip(request.extra_conditions, slot.extra_weights):
            if solver.step_range_active(extra.step_range, slot.step, slot.steps):
                rows.append(_Row(slot, extra.conditioning, False, weight))
        if not rows:
            rows.append(_Row(slot, request.conditioning, False, None))
        if self._needs_negative(slot):
            rows.append(_Row(slot, request.negative, True))
        return rows

    def _model_input(self, slot: _Slot, t: Any) -> torch.Tensor:
        mask = slot.curves.get("latent_mask")
        if mask is None:
            return slot.x
        return solver.mask_pre_blend(slot.x, mask, slot.source, slot.noise, t).to(slot.x.dtype)

    def _timestep_embedding(self, t: float, strengths: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb [1, H], modulation [1, 6, H]) for one t, computed alone (batch 1) and cached: every row at the
        same t gets identical embeddings whatever else is in the batch. `strengths`: (version, own strengths) of
        the LoRAs on the timestep embedders, if any (see `_OwnStrengths.time`)."""
        key = (t, strengths)
        cached = self._modulation.get(key)
        if cached is None:
            device, dtype = self._device_dtype()
            t_tensor = torch.tensor([t], device=device, dtype=dtype)
            own = None if strengths is None else strengths[1]
            if own is None:
                cached = self.decoder.timestep_modulation(t_tensor)
            else:  # r = t computed here, at these strengths, not the decoder's kept constant
                with lora_set(self.decoder).rows_at(torch.tensor([own], device=device)):
                    cached = self.decoder.timestep_modulation(t_tensor, t_tensor)
            self._modulation[key] = cached
            if len(self._modulation) > MODULATION_CACHE_SIZE:
                self._modulation.popitem(last=False)
        return cached

    def _advance(self, slot: _Slot, rows: list[tuple[_Row, torch.Tensor]], t: Any, t_next: Any) -> _StepResult:
        """Guidance and one solver step for a slot; t and t_next are floats, or fp32 tensors on the graph path."""
        request = slot.request
        positive = [(row, v[None]) for row, v in rows if not row.negative]
        negative = [v[None] for row, v in rows if row.negative]
        if len(positive) == 1:
            v_pos = positive[0][1]
        else:
            v_pos = solver.blend_velocities([v for _, v in positive], [row.weight for row, _ in positive])
        v_neg, running, cached_negative = None, slot.running, slot.cached_negative
        if request.cfg_mode == "self":
            v_neg = slot.noise
        elif negative:
            v_neg = negative[0]
            if request.cfg_mode == "initialize":
                cached_negative = v_neg
        elif request.cfg_mode == "initialize":
            v_neg = slot.cached_negative
        velocity = v_pos
        if v_neg is not None:
            scale = self._curve(slot, "guidance")
            if request.guidance_method == "apg":
                velocity, running = solver.apg(v_pos, v_neg, scale, running, self._curve(slot, "apg_momentum"))
            else:
                velocity = solver.cfg(v_pos, v_neg, scale)
            rescale = self._curve(slot, "cfg_rescale")
            if rescale is not None:
                velocity = solver.cfg_rescale(velocity, v_pos, rescale)
        return _StepResult(self._integrate(slot, velocity, t, t_next).to(slot.x.dtype), running, cached_negative)

    def _draw_step_noise(self, slot: _Slot, step: int) -> torch.Tensor:
        """Noise for `step` of a slot, seeded by (seed, step) and drawn on the device: reproducible, independent
        of the slot's place in the ring, and no host round trip."""
        device, dtype = self._device_dtype()
        generator = torch.Generator(device).manual_seed(step_seed(slot.request.seed, step))
        return torch.randn(slot.x.shape, generator=generator, device=device, dtype=dtype)

    def _step_noise(self, slot: _Slot) -> torch.Tensor:
        return self._draw_step_noise(slot, slot.step) if slot.step_noise is None else slot.step_noise

    def _uses_step_noise(self, slot: _Slot) -> bool:
        """Whether this step of the slot draws fresh noise (SDE, ODE noise injection, an SDE curve)."""
        return (
            slot.request.solver == "sde"
            or self._curve(slot, "ode_noise") is not None
            or (self._curve(slot, "sde_denoise") is not None and slot.source is not None)
        )

    def _integrate(self, slot: _Slot, velocity: torch.Tensor, t: Any, t_next: Any) -> torch.Tensor:
        """One solver step; branches are decided on the slot's float times, the math uses `t`, `t_next`."""
        request, x = slot.request, slot.x
        scale = self._curve(slot, "velocity_scale")
        ode_noise = self._curve(slot, "ode_noise")
        sde_curve = self._curve(slot, "sde_denoise")
        scaled = velocity if scale is None else solver.scale_velocity(velocity, scale)
        source = slot.source
        needs_x0 = (
            request.solver == "sde"
            or slot.curves.get("latent_mask") is not None
            or self._pulls_to_target(slot)
            or (sde_curve is not None and source is not None)
        )
        if not needs_x0:
            x_next = solver.euler_step(x, scaled, t, t_next)
            if ode_noise is not None and slot.t_next > 0:
                x_next = solver.inject_ode_noise(x_next, self._step_noise(slot), ode_noise, t_next)
        else:
            x0 = solver.predict_x0(x, scaled, t)
            mask = slot.curves.get("latent_mask")
            if mask is not None:
                x0 = solver.mask_post_blend(x0, mask, source)
            x0 = self._x0_target(slot, x0)
            if sde_curve is not None and source is not None:
                noise = self._step_noise(slot) if slot.t_next > 0 else torch.zeros_like(x)
                x_next = solver.sde_curve_step(x0, source, noise, t_next, sde_curve)
            elif slot.t_next <= 0:
                x_next = x0
            elif request.solver == "sde":
                x_next = solver.noised(x0, slot.noise if mask is not None else self._step_noise(slot), t_next)
            else:
                x_next = solver.euler_step(x, (x - x0) / t, t, t_next)
                if ode_noise is not None:
                    x_next = solver.inject_ode_noise(x_next, self._step_noise(slot), ode_noise, t_next)
        if request.dcw is not None and slot.t_next > 0:
            x_next = solver.dcw_correct(
                x_next, solver.predict_x0(x, velocity, t), t, request.dcw.mode, request.dcw.low, request.dcw.high
            )
        return x_next

    def _pulls_to_target(self, slot: _Slot) -> bool:
        """Whether this slot has an x0 target and a strength (its own or shared) to pull toward it with; without a
        strength the step takes the plain Euler path, exactly as if there were no target."""
        if slot.x0_target is None:
            return False
        return "x0_target_curve" in slot.curves or self._curve(slot, "x0_target_strength") is not None

    def _x0_pull(self, slot: _Slot) -> float | bool | None:
        """How this step pulls x0 toward the slot's target: its progress through the schedule (per-frame curve),
        whether the scalar strength applies (second half of the schedule), None without a target."""
        if not self._pulls_to_target(slot):
            return None
        if "x0_target_curve" in slot.curves:
            return slot.step / max(slot.steps - 1, 1)
        return slot.step >= slot.steps // 2 and slot.t > 0

    def _x0_target(self, slot: _Slot, x0: torch.Tensor) -> torch.Tensor:
        pull = self._x0_pull(slot)
        if pull is None or pull is False:  # a progress of 0.0 still pulls
            return x0
        curve = slot.curves.get("x0_target_curve")
        if curve is not None:
            return solver.blend_x0_target(x0, slot.x0_target, curve, pull, slot.request.x0_target_gate)
        return solver.blend_x0_target_scalar(x0, slot.x0_target, self._curve(slot, "x0_target_strength"))

    # ---- bookkeeping -----------------------------------------------------------------------------------------

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        weight = self.decoder.proj_in[1].weight
        return weight.device, weight.dtype

    def _to_device(self, curve: torch.Tensor) -> torch.Tensor:
        device, dtype = self._device_dtype()
        return curve.to(device=device, dtype=dtype)

    def _record(
        self, started: float, rows: list[_Row], active: list[_Slot], finished: list[Finished], steady: bool
    ) -> None:
        stats = self._stats
        if stats.pending_cost is not None and stats.pending_cost[1][1].query():  # the last GPU tick has ended
            count, (start, end) = stats.pending_cost
            stats.cost_samples.append((count, start.elapsed_time(end)))
            stats.pending_cost = None
        stats.ticks += 1
        stats.rows = len(rows)
        stats.negative_rows = sum(row.negative for row in rows)
        stats.active_slots = len(active)
        stats.finished += len(finished)
        stats.last_tick_ms = (time.perf_counter() - started) * 1000.0
        stats.steady = steady
        if self.cycle_costs:
            pass
        elif steady and stats.gpu_events is None:
            stats.cost_samples.append((len(rows), stats.last_tick_ms))
        elif steady and stats.pending_cost is None:
            stats.pending_cost = (len(rows), stats.gpu_events)
        stats.history_ms.append(stats.last_tick_ms)
        del stats.history_ms[:-256]

    def stats(self) -> dict[str, Any]:
        """Counters of the last tick: host-side ms, and on a GPU the device ms of the last tick whose CUDA events
        have completed (read without waiting; None until one has)."""
        s = self._stats
        gpu_ms = None
        if s.gpu_events is not None and s.gpu_events[1].query():
            gpu_ms = s.gpu_events[0].elapsed_time(s.gpu_events[1])
        return {
            "gpu_tick_ms": gpu_ms,
            "ticks": s.ticks,
            "depth": self.depth,
            "lanes": {
                lane.name: {"depth": lane.depth, "active_slots": sum(s is not None for s in lane.slots)}
                for lane in self._lanes.values()
            },
            "active_slots": s.active_slots,
            "rows": s.rows,
            "negative_rows": s.negative_rows,
            "queued": self._main.queued is not None,
            "finished": s.finished,
            "last_tick_ms": s.last_tick_ms,
            "slot_steps": [None if slot is None else slot.step for slot in self._main.slots],
            "backend": self.backend,
            "graphs": None
            if self._graphs is None
            else {**vars(self._graphs.counters), "captured": self._graphs.captured},
        }


class StreamLane:
    """A session's handle on its lane of a shared ring: the same calls as a StreamPipeline's own (submit, depth,
    shared curves), reaching only this lane; `StreamPipeline.tick` advances every lane at once."""

    def __init__(self, pipeline: StreamPipeline, lane: _Lane):
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
        self._check_open()
        self.pipeline._submit(self._lane, request, supersedes)

    def set_depth(self, depth: int) -> None:
        """Hot depth change; a deeper lane is refused (AdmissionRefused) if the ring could then no longer keep every
        session's need."""
        self.check_depth(depth)
        self.pipeline._set_depth(self._lane, depth)

    def check_depth(self, depth: int) -> None:
        """Raise AdmissionRefused, with the numbers, if this lane at `depth` would make the ring miss a need."""
        self._check_open()
        self.pipeline._check_depth(depth)
        lane = self._lane
        if depth > lane.depth:
            deeper = replace(lane, depth=depth)
            lanes = [deeper if other is lane else other for other in self.pipeline._lanes.values()]
            self.pipeline._admission_check(lanes, f"depth {depth} for session {lane.name!r} refused")

    def set_shared_curve(self, name: str, value: Curve | None) -> None:
        self._check_open()
        self.pipeline._set_shared_curve(self._lane, name, value)

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
        if self.pipeline._lanes.get(self._lane.name) is not self._lane:
            raise ValueError(f"session {self._lane.name!r} has ended: add a new lane to play again")


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


def seeded_noise(seed: int, frames: int, channels: int) -> torch.Tensor:
    """Gaussian noise [1, T, C] from a CPU generator: the same seed gives the same noise on every device."""
    generator = torch.Generator("cpu").manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return torch.randn(1, frames, channels, generator=generator)


def step_seed(seed: int, step: int) -> int:
    """A distinct, reproducible seed for the noise drawn at `step` of a generation seeded `seed`."""
    return (int(seed) * 1_000_003 + 7_919 * (step + 1)) & 0x7FFF_FFFF_FFFF_FFFF


def _length_of(value: Curve) -> int:
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.shape[-2] if value.dim() == 3 else value.shape[-1]
    return 1
