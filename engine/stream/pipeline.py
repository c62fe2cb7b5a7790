"""StreamPipeline: a ring of in-flight generations ("slots") at different denoise steps, advanced together by
one batched DiT forward per tick.

Each slot owns its request (seed, schedule, source, conditions, CFG mode, curves) and its state; every row of
the tick's batch (positive, negative, extra conditions, of every slot) goes through ONE decoder call. A request
submitted while a slot is free starts on the next tick and is delivered by the tick that takes its last step,
so its latency is exactly `steps` ticks. Shared curves override a step-time field for every in-flight slot from
the next tick on. Rows never depend on each other: a request's latent equals one-shot generation bit for bit.

Here: configuration, submitting (validation and device tensors at submit time), the tick (admit, rows, layout, the
batched forward, each slot's step from `engine/sampling/step.py`, delivery), the timestep-embedding cache and the
stats. Lanes and admission control live in `lanes.py`, the batch layout in `batch.py`, the graph path in
`graph_step.py`."""

from __future__ import annotations

import functools
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..lora.attached import lora_set, refresh_folds, structure_lock
from ..models.dit import CrossGroup, DiTDecoder
from ..params import SHARED_FIELDS
from ..sampling import solver
from ..sampling.curves import Curve, as_curve
from ..sampling.schedule import timestep_schedule
from ..sampling.step import RowVelocity, StepResult, advance, model_input
from .backends import decoder_forward, uses_graphs
from .batch import TickBatch, lane_strengths
from .graph_step import GraphStep, TickWork
from .lanes import (
    MAX_DEPTH,
    MAX_LANES,
    Lane,
    RealtimeNeed,
    Slot,
    StreamLane,
    check_admission,
    check_depth,
    deepened,
    predict_tick_ms,
)
from .pinned import PinnedStaging
from .requests import (
    CURVE_FIELDS,
    FINITE_CHECKS,
    MAIN_LANE,
    Finished,
    Prepared,
    SlotRequest,
    seeded_noise,
    step_seed,
    validate_request,
)
from .tick_graph import DEVICE_WORK, GraphCounters

COST_SAMPLES = 64  # recent (rows, tick ms) pairs admission control predicts from
MODULATION_CACHE_SIZE = 512
CONSTANT_CURVES_KEPT = 256  # constant curves kept on the device, by (name, value)
HOST_CURVES_KEPT = 64  # host tensor curves kept on the device, by the tensor (a window's mask: two per session)


@dataclass
class TickStats:
    """Counters of the last tick, and the measured tick costs admission control predicts from."""

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


class StreamPipeline:
    def __init__(self, decoder: DiTDecoder, depth: int = 4, backend: str = "eager", paced: bool = False):
        """`paced`: admit a request only once the youngest slot is steps/depth steps in, so slots stay evenly
        staggered and a latent finishes every steps/depth ticks (a live stream's shared knobs are heard that
        soon); unpaced, a free slot is filled on the next tick and finishes bunch together after a ramp-up."""
        self.decoder = decoder
        check_depth(depth)
        self._lanes: dict[str, Lane] = {}
        self._main = self._new_lane(MAIN_LANE, depth, paced, None)
        self._modulation: OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._stats = TickStats()
        self.backend = backend
        self.decoder_forward = decoder_forward(decoder, backend)
        device = self._device_dtype()[0]
        self._staging = PinnedStaging(device)
        self._graph = GraphStep(decoder, device, self._staging) if uses_graphs(backend) else None
        self._last_noise: tuple[tuple, torch.Tensor] | None = None
        self._event_pairs: list[tuple[Any, Any]] = []  # reused: at most three, two of them possibly still read
        self._constant_curves: OrderedDict[tuple[str, float], torch.Tensor] = OrderedDict()
        self._host_curves: OrderedDict[int, tuple[torch.Tensor, int, torch.Tensor]] = OrderedDict()
        self.cycle_costs = False  # True: whoever drives the ticks reports what a whole cycle costs (record_cycle)

    # ---- configuration ---------------------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        return self._main.depth

    @property
    def paced(self) -> bool:
        return self._main.paced

    @property
    def graph_counters(self) -> GraphCounters | None:
        """A copy of the tick graphs' counters (new plans, captures, replays...); None on a backend without graphs."""
        return None if self._graph is None else replace(self._graph.graphs.counters)

    def set_depth(self, depth: int) -> None:
        """Hot depth change: growing adds free slots; shrinking stops admitting to the removed slots, whose
        in-flight work finishes and is delivered before they disappear."""
        self.set_lane_depth(self._main, depth)

    def set_lane_depth(self, lane: Lane, depth: int) -> None:
        """`set_depth` for one lane of the ring, with no admission check (see `check_lane_depth`)."""
        check_depth(depth)
        lane.depth = depth
        if len(lane.slots) < depth:
            lane.slots.extend([None] * (depth - len(lane.slots)))
        lane.trim()

    def _slots_in_flight(self) -> list[Slot]:
        return [slot for lane in self._lanes.values() for slot in lane.by_age()]

    @property
    def frames(self) -> int | None:
        """T of the in-flight work, every lane's (one batch; None when idle)."""
        for slot in self._slots_in_flight():
            return slot.request.frames
        return None

    def set_shared_curve(self, name: str, value: Curve | None) -> None:
        """Override a step-time field for every in-flight slot from the next tick; None reverts to per-slot values."""
        self.set_lane_shared_curve(self._main, name, value)

    def set_lane_shared_curve(self, lane: Lane, name: str, value: Curve | None) -> None:
        """`set_shared_curve` for the slots of one lane of the ring."""
        if name not in SHARED_FIELDS:
            raise ValueError(f"unknown shared curve {name!r}: choose one of {', '.join(SHARED_FIELDS)}")
        if value is None:
            lane.shared.pop(name, None)
            return
        frames = self.frames or (lane.queued.request.frames if lane.queued else None)
        curve = self._to_device(as_curve(value, frames if frames is not None else _length_of(value), name))
        if self._graph is not None and frames is not None:
            curve = self._graph.shared_curve(lane, name, curve, frames)
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
        check_depth(depth)
        lanes = [*self._lanes.values(), Lane(name, -1, depth, paced, need)]
        check_admission(lanes, self._stats.cost_samples, f"session {name!r} refused")
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

    def has_lane(self, lane: Lane) -> bool:
        """Whether `lane` still plays in this ring (not ended by `remove_lane`)."""
        return self._lanes.get(lane.name) is lane

    def check_lane_depth(self, lane: Lane, depth: int) -> None:
        """ValueError for a depth out of range; AdmissionRefused, with the numbers, if `lane` at a greater `depth`
        would make the ring miss a need."""
        check_depth(depth)
        if depth > lane.depth:
            lanes = deepened(self._lanes.values(), lane, depth)
            check_admission(lanes, self._stats.cost_samples, f"depth {depth} for session {lane.name!r} refused")

    def _new_lane(self, name: str, depth: int, paced: bool, need: RealtimeNeed | None) -> Lane:
        used = {lane.base for lane in self._lanes.values()}
        base = next(MAX_DEPTH * i for i in range(MAX_LANES + 1) if MAX_DEPTH * i not in used)
        lane = Lane(name, base, depth, paced, need, [None] * depth)
        self._lanes[name] = lane
        return lane

    def predicted_tick_ms(self, rows: int) -> float | None:
        """A tick's time at `rows` rows from the steady ticks measured so far (no first runs or captures): device
        time on a GPU, or the driver's whole cycle with `cycle_costs` (see `lanes.predict_tick_ms`); None before
        any tick."""
        return predict_tick_ms(self._stats.cost_samples, rows)

    def record_cycle(self, ms: float) -> None:
        """The time from one tick's start to the next of a driver that does more than tick (a shared ring: every
        session's knobs and requests, the handing out of latents); learnt in place of the device time when
        `cycle_costs` is set, for steady ticks only."""
        stats = self._stats
        if self.cycle_costs and stats.steady:
            stats.cost_samples.append((stats.rows, ms))

    # ---- requests --------------------------------------------------------------------------------------------

    def submit(self, request: SlotRequest, supersedes: bool = False) -> None:
        """Queue a request (a queue of one: a newer submission replaces one that has not started).

        `supersedes`: the request carries new per-request values (a knob, a prompt), so what is in flight is stale.
        Paced, where it would wait for the youngest slot to get steps/depth steps in, it takes that slot's place at
        once, unless that slot superseded too (so a knob swept every tick cannot starve the ring). A queued request
        that supersedes passes that on to the one replacing it. Validation, cross-attention K/V of its conditions
        and curves are all made here; its seeded noise when it enters the ring (most queued requests of a live
        stream are replaced before they do)."""
        self.submit_to(self._main, request, supersedes)

    def submit_to(self, lane: Lane, request: SlotRequest, supersedes: bool = False) -> None:
        """`submit` to one lane of the ring (its queue of one, its shared curves, its LoRA strengths)."""
        config = self.decoder.config
        validate_request(
            request,
            config.in_channels - config.audio_acoustic_hidden_dim,
            config.audio_acoustic_hidden_dim,
            self.frames,
            lane.shared,
            FINITE_CHECKS,
        )
        supersedes = supersedes or (lane.queued is not None and lane.queued.supersedes)
        lane.queued = self._prepare(request, lane_strengths(self.decoder, lane).kv)
        lane.queued.supersedes = supersedes

    def _prepare(self, request: SlotRequest, kv_strengths: tuple[float, ...] | None = None) -> Prepared:
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
            name: self._curve(getattr(request, name), frames, name)
            for name in CURVE_FIELDS
            if getattr(request, name) is not None
        }
        extra_weights = tuple(
            None if e.weight is None else self._to_device(as_curve(e.weight, frames, "extra condition weight"))
            for e in request.extra_conditions
        )
        return Prepared(
            request=request,
            schedule=timestep_schedule(int(request.steps), float(request.shift), float(request.denoise)),
            source=None if request.source_latents is None else request.source_latents.to(device, dtype),
            context=request.context_latents.to(device, dtype),
            x0_target=None if request.x0_target is None else request.x0_target.to(device, dtype),
            curves=curves,
            extra_weights=extra_weights,
        )

    def _curve(self, value: Curve, frames: int, name: str) -> torch.Tensor:
        """A request's curve on the device. A constant is made once per value and kept (a stream resubmits the same
        knob values every tick: each would be a small synchronous copy); no slot writes into its curves."""
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return self._host_curve(value, frames, name)
        if isinstance(value, (torch.Tensor, bool)):
            return self._to_device(as_curve(value, frames, name))
        key = (name, float(value))
        constant = self._constant_curves.get(key)
        if constant is None:
            constant = self._constant_curves[key] = self._to_device(as_curve(value, frames, name))
            if len(self._constant_curves) > CONSTANT_CURVES_KEPT:
                self._constant_curves.popitem(last=False)
        return constant

    def _host_curve(self, value: torch.Tensor, frames: int, name: str) -> torch.Tensor:
        """A host tensor curve on the device, copied once while that very tensor is unchanged (its in-place version):
        a window walker hands the same mask and noise curves over every tick while their values repeat, and the
        tick graph then finds them already home."""
        kept = self._host_curves.get(id(value))
        if kept is not None and kept[0] is value and kept[1] == value._version:
            self._host_curves.move_to_end(id(value))
            return kept[2]
        on_device = self._to_device(as_curve(value, frames, name))
        self._host_curves[id(value)] = (value, value._version, on_device)
        self._host_curves.move_to_end(id(value))
        if len(self._host_curves) > HOST_CURVES_KEPT:
            self._host_curves.popitem(last=False)
        return on_device

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
            lane.admit(self._start)
        active = self._slots_in_flight()
        if not active:
            return []
        batch = TickBatch.of(self.decoder, active)
        if self._graph is None:
            with DEVICE_WORK:  # a compiled layer's first run autotunes with a device sync
                self._eager_step(batch)
            steady = True
        else:
            embeddings = self._row_embeddings(batch)
            dtype = self._device_dtype()[1]
            lanes = self._lanes.values()
            steady = self._graph.run(
                batch,
                embeddings,
                dtype,
                lanes,
                TickWork(self._gather, self._forward, self._advance),
                self._draw_step_noise,
            )
        finished: list[Finished] = []
        for slot in active:
            slot.step += 1
            if slot.step == slot.steps:
                slot.lane.slots[slot.index - slot.lane.base] = None
                latent = slot.x if self._graph is None else slot.x.clone()
                finished.append(Finished(latent, slot.request, slot.steps, slot.lane.name))
        for lane in self._lanes.values():
            lane.trim()
        if events is not None:
            events[1].record()
            self._stats.gpu_events = events
        self._record(started, batch, finished, steady)
        return finished

    def _row_embeddings(self, batch: TickBatch) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each batch row's (temb, modulation) at its slot's t, in batch order."""
        rows, strengths = batch.rows, batch.strengths
        return [
            self._timestep_embedding(rows[i].slot.t, strengths[rows[i].slot.lane.name].time) for i in batch.layout.order
        ]

    def _eager_step(self, batch: TickBatch) -> None:
        embeddings = self._row_embeddings(batch)
        temb = torch.cat([e[0] for e in embeddings])
        modulation = torch.cat([e[1] for e in embeddings])
        layout = batch.layout
        kvs = [c.cross_kv(self.decoder, own) for c, own in zip(layout.conditions, layout.kv_strengths)]
        groups = layout.groups(kvs)
        times = {id(slot): (slot.t, slot.t_next) for slot in batch.slots}
        lora_rows = batch.host_lora_rows
        if lora_rows is not None:
            lora_rows = lora_rows.to(self._device_dtype()[0])
        velocities = self._forward(*self._gather(batch, times), temb, modulation, groups, lora_rows)
        for slot, result in zip(batch.slots, self._advance(batch, velocities, times, batch.slots)):
            slot.x, slot.running, slot.cached_negative = result.x, result.running, result.cached_negative

    def _gather(self, batch: TickBatch, times: dict[int, tuple[Any, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's model input and context latents, in `batch.layout.order`: what the batched forward reads."""
        rows, order = batch.rows, batch.layout.order
        inputs = {id(slot): model_input(slot.state(), times[id(slot)][0]) for slot in batch.slots}
        x = torch.cat([inputs[id(rows[i].slot)] for i in order])
        return x, torch.cat([rows[i].slot.context for i in order])

    def _forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        temb: torch.Tensor,
        modulation: torch.Tensor,
        groups: list[CrossGroup],
        lora_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """One decoder call over every row (at each row's session's LoRA strengths when `lora_rows` [rows,
        MAX_LORAS] is given) -> the rows' velocities."""
        if lora_rows is None:
            return self.decoder_forward(x, temb, modulation, context, groups)
        with lora_set(self.decoder).rows_at(lora_rows):
            return self.decoder_forward(x, temb, modulation, context, groups)

    def _advance(
        self, batch: TickBatch, velocities: torch.Tensor, times: dict[int, tuple[Any, Any]], slots: list[Slot]
    ) -> list[StepResult]:
        """The guidance and solver step of each of `slots` (the batch's, or one lane's) from the rows' `velocities`
        (in `batch.layout.order`)."""
        rows = batch.rows
        position = batch.layout.positions
        results = []
        for slot in slots:
            own = [
                RowVelocity(velocities[position[i]], row.negative, row.weight)
                for i, row in enumerate(rows)
                if row.slot is slot
            ]
            noise = functools.partial(self._step_noise, slot)
            results.append(advance(slot.state(), own, *times[id(slot)], noise))
        return results

    def _gpu_events(self) -> tuple[Any, Any] | None:
        """A (start, end) CUDA event pair with the start recorded now; None on the CPU. A pair is reused once neither
        the last tick's stats nor a pending cost sample reads it (creating events every tick costs host time)."""
        device = self._device_dtype()[0]
        if device.type != "cuda":
            return None
        pending = self._stats.pending_cost
        read = (self._stats.gpu_events, None if pending is None else pending[1])
        pair = next((p for p in self._event_pairs if not any(p is r for r in read)), None)
        if pair is None:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._event_pairs.append(pair)
        pair[0].record()
        return pair

    def _start(self, prepared: Prepared, lane: Lane, place: int) -> Slot:
        """The slot a prepared request becomes at `place` of `lane`: its seeded noise drawn, its starting latent."""
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
        return Slot(**vars(prepared), index=lane.base + place, x=x, noise=noise, lane=lane)

    def _seeded_noise(self, seed: int, frames: int, channels: int, dtype: torch.dtype) -> torch.Tensor:
        """A request's starting noise on the device. The last one is kept: a live stream's requests share the seed
        knob's value, and drawing 60 s of noise costs ~1 ms of host time (no slot writes into it)."""
        key = (int(seed), frames, channels, dtype)
        if self._last_noise is None or self._last_noise[0] != key:
            self._last_noise = (key, self._staging.to_device(seeded_noise(seed, frames, channels), dtype))
        return self._last_noise[1]

    def _draw_step_noise(self, slot: Slot) -> torch.Tensor:
        """Noise for the slot's current step, seeded by (seed, step) and drawn on the device: reproducible,
        independent of the slot's place in the ring, and no host round trip."""
        device, dtype = self._device_dtype()
        generator = torch.Generator(device).manual_seed(step_seed(slot.request.seed, slot.step))
        return torch.randn(slot.x.shape, generator=generator, device=device, dtype=dtype)

    def _step_noise(self, slot: Slot) -> torch.Tensor:
        """This step's noise: drawn now (eager), or the static tensor it was drawn into before the device work."""
        return self._draw_step_noise(slot) if slot.step_noise is None else slot.step_noise

    def _timestep_embedding(self, t: float, strengths: tuple | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb [1, H], modulation [1, 6, H]) for one t, computed alone (batch 1) and cached: every row at the
        same t gets identical embeddings whatever else is in the batch. `strengths`: (version, own strengths) of
        the LoRAs on the timestep embedders, if any (see `OwnStrengths.time`)."""
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

    # ---- bookkeeping -----------------------------------------------------------------------------------------

    def _device_dtype(self) -> tuple[torch.device, torch.dtype]:
        weight = self.decoder.proj_in[1].weight
        return weight.device, weight.dtype

    def _to_device(self, curve: torch.Tensor) -> torch.Tensor:
        """A curve on the decoder's device; one made on the host (a window's latent mask, every tick) is copied
        through pinned staging, without waiting for the GPU work queued."""
        device, dtype = self._device_dtype()
        if curve.device.type == "cpu" and device.type == "cuda":
            return self._staging.to_device(curve, dtype)
        return curve.to(device=device, dtype=dtype)

    def _record(self, started: float, batch: TickBatch, finished: list[Finished], steady: bool) -> None:
        stats = self._stats
        if stats.pending_cost is not None and stats.pending_cost[1][1].query():  # the last GPU tick has ended
            count, (start, end) = stats.pending_cost
            stats.cost_samples.append((count, start.elapsed_time(end)))
            stats.pending_cost = None
        stats.ticks += 1
        stats.rows = len(batch.rows)
        stats.negative_rows = sum(row.negative for row in batch.rows)
        stats.active_slots = len(batch.slots)
        stats.finished += len(finished)
        stats.last_tick_ms = (time.perf_counter() - started) * 1000.0
        stats.steady = steady
        if steady and not self.cycle_costs:  # a cycle's driver reports its own costs (`record_cycle`)
            if stats.gpu_events is None:
                stats.cost_samples.append((len(batch.rows), stats.last_tick_ms))
            elif stats.pending_cost is None:
                stats.pending_cost = (len(batch.rows), stats.gpu_events)
        stats.history_ms.append(stats.last_tick_ms)
        del stats.history_ms[:-256]

    def stats(self) -> dict[str, Any]:
        """Counters of the last tick: host-side ms, and on a GPU the device ms of the last tick whose CUDA events
        have completed (read without waiting; None until one has)."""
        s = self._stats
        gpu_ms, events = None, s.gpu_events  # read once: a tick on the runner's thread may replace them
        if events is not None and events[1].query():
            gpu_ms = events[0].elapsed_time(events[1])
        graphs = None if self._graph is None else self._graph.graphs
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
            if graphs is None
            else {
                **vars(graphs.counters),
                "captured": graphs.captured,
                "static_mb": round(self._graph.static.megabytes, 3),
            },
        }


def _length_of(value: Curve) -> int:
    """Frames of a curve given before any request sets T (1 for a number or a scalar tensor)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.shape[-2] if value.dim() == 3 else value.shape[-1]
    return 1
