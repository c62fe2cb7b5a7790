"""The graph backend's tick (`engine/stream/tick_graph.py` captures and replays it): the same device work as the
eager tick, through static tensors at fixed addresses. A slot's tensors live at the static tensors of its rank by
age in its lane (its home): copied there when it starts and moved up when an older slot finishes, so a ring in its
steady rhythm replays the same few plans whichever places its slots hold. Each tick copies in only what
changes (times, embeddings, LoRA strengths, a changed condition's K/V) and the plans (`GraphStep.shapes`,
`GraphStep.advance_plans`) say which captured graphs, if any, the tick replays.

A tick is a gather graph (each slot's model input and context into static row tensors, in batch order), a forward
graph (the DiT over those rows into a static velocity tensor) and one advance graph per lane (its slots' guidance and
solver steps). The forward, a thousand kernels and ~100 ms of host time to capture, is keyed by its kernels' shapes
alone (frames, rows, condition groups, K/V lengths, LoRA structure), so one graph serves every arrangement of slots in
their homes; what changes the arrangement (a session joining, a ring's rhythm after a per-request knob) makes new
gather plans, and a lane's own slots' steps and shared curves (a shared knob's first move, a slot's place in its
schedule) make new advance plans of that lane alone: one session's first touch captures a few dozen small kernels a
tick for its own lane, not the advance of every session in the ring."""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ..conditioning import Conditioning
from ..models.dit import CrossGroup, CrossKV, DiTDecoder
from ..sampling import solver
from ..sampling.step import SlotState, StepResult, needs_negative, uses_step_noise, x0_pull
from .batch import TickBatch
from .lanes import MAX_DEPTH, MAX_LANES, Lane, Slot
from .pinned import PinnedStaging
from .tick_graph import StaticTensors, TickGraphs

CLOCKS_KEPT = 64  # distinct sets of the slots' times kept on the device
HOMES = (MAX_LANES + 1) * MAX_DEPTH  # every slot's home: a lane's base (MAX_DEPTH apart) and its rank by age

Times = dict[int, tuple[Any, Any]]  # each slot's (t, t_next), by id of the slot


class TickWork(NamedTuple):
    """A tick's device work in three parts (`StreamPipeline`'s), each a graph of its own."""

    gather: Callable[[TickBatch, Times], tuple[torch.Tensor, torch.Tensor]]  # -> rows' model inputs, contexts
    forward: Callable[..., torch.Tensor]  # (x, context, temb, modulation, groups, LoRA rows) -> velocities
    advance: Callable[[TickBatch, torch.Tensor, Times, list[Slot]], list[StepResult]]  # (..., velocities, times, slots)


class GraphStep:
    """Static tensors, tick graphs and the K/V each condition group's static tensors hold, for one pipeline."""

    def __init__(self, decoder: DiTDecoder, device: torch.device, staging: PinnedStaging):
        self.decoder = decoder
        self.graphs = TickGraphs(device)
        self.static = StaticTensors(device)
        self._staging = staging
        self._kv_owner: dict[int, tuple[CrossKV, CrossKV]] = {}  # each group's (K/V its static tensors hold, them)
        self._times: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # `_time_views`, by row
        self._holds: dict[int, tuple[tuple, tuple]] = {}  # `_stale`'s record, by id of a static tensor
        self._home_reads: dict[int, tuple[tuple, dict, dict]] = {}  # `_read_only`'s record, by home
        self._row_views: dict[int, tuple[torch.Tensor, ...]] = {}  # `_rows_into`'s, by id of a static tensor
        self._clocks: OrderedDict[tuple, torch.Tensor] = OrderedDict()  # `_clock_on_device`'s

    def run(
        self,
        batch: TickBatch,
        embeddings: list[tuple[torch.Tensor, torch.Tensor]],
        dtype: torch.dtype,
        lanes: Iterable[Lane],
        work: TickWork,
        draw_step_noise: Callable[[Slot], torch.Tensor],
    ) -> bool:
        """The same device work through static tensors: plain PyTorch the first time a plan comes, captured the
        second, one graph replay after that (a gather's, a forward's and an advance's). Host work here is copies:
        times, embeddings, strengths, changed K/V. `embeddings`: each batch row's (temb, modulation). Returns whether
        the tick was all replays (a steady tick, not a first run or a capture: a cost to learn from)."""
        static, active = self.static, batch.slots
        copies = self._home(active)
        hidden = embeddings[0][0].shape[-1]
        temb = static.get("temb", (len(batch.rows), hidden), dtype)
        modulation = static.get("modulation", (len(batch.rows), 6, hidden), dtype)
        self._rows_into(temb, [e[0] for e in embeddings], copies)
        self._rows_into(modulation, [e[1] for e in embeddings], copies)
        if copies:  # what the homes and the rows' embeddings need this tick, in one launch
            targets, sources = zip(*copies)
            torch._foreach_copy_(list(targets), list(sources))
        clock = tuple((slot.home, slot.t, slot.t_next) for slot in active)
        times_device = static.get("times", (HOMES, 2), torch.float32)
        if self._stale(times_device, *clock):
            times_device.copy_(self._clock_on_device(clock))
        times = {id(slot): self._time_views(times_device, slot.home) for slot in active}
        layout = batch.layout
        kvs = [self._static_kv(g, c, own) for g, (c, own) in enumerate(zip(layout.conditions, layout.kv_strengths))]
        groups = layout.groups(kvs)
        lora_rows = batch.host_lora_rows
        if lora_rows is not None:
            static_rows = static.get("lora_rows", tuple(lora_rows.shape), torch.float32)
            self._staging.copy(lora_rows, static_rows)
            lora_rows = static_rows
        states = [slot.state() for slot in active]
        for slot, state in zip(active, states):
            if uses_step_noise(state):
                slot.step_noise.copy_(draw_step_noise(slot))
        shapes = self.shapes(batch, lora_rows is not None)
        first = active[0]
        x_rows = static.get("x_rows", (len(batch.rows), *first.x.shape[1:]), first.x.dtype)
        context_rows = static.get("context_rows", (len(batch.rows), *first.context.shape[1:]), first.context.dtype)
        velocities = static.get("velocities", (len(batch.rows), *first.x.shape[1:]), dtype)

        def gather_step() -> None:
            x, context = work.gather(batch, times)
            x_rows.copy_(x)
            context_rows.copy_(context)

        def forward_step() -> None:
            velocities.copy_(work.forward(x_rows, context_rows, temb, modulation, groups, lora_rows))

        def advance_step(slots: list[Slot]) -> tuple[tuple[bool, bool], ...]:
            facts = []
            for slot, result in zip(slots, work.advance(batch, velocities, times, slots)):
                slot.x.copy_(result.x)
                facts.append(
                    (
                        self._keep(slot, "running", result.running),
                        self._keep(slot, "cached_negative", result.cached_negative),
                    )
                )
            return tuple(facts)

        replays = self.graphs.counters.replays
        kernels = self.forward_shapes(batch, shapes, groups)
        self.graphs.run(self.gather_plan(batch, shapes), gather_step, shapes=("gather", kernels))
        self.graphs.run(kernels, forward_step, shapes=kernels)
        plans = self.advance_plans(batch, states, lanes)
        for slots, plan, plan_shapes in plans:
            advanced = self.graphs.run(plan, functools.partial(advance_step, slots), shapes=plan_shapes)
            for slot, (has_running, has_cached) in zip(slots, advanced):
                slot.running = self._static_state(slot, "running") if has_running else None
                slot.cached_negative = self._static_state(slot, "cached_negative") if has_cached else None
        return self.graphs.counters.replays == replays + 2 + len(plans)

    def _stale(self, static: torch.Tensor, *sources: Any) -> bool:
        """Whether `static` does not hold `sources` (tensors, by identity and version: one edited in place is new;
        or plain values) already; records that it will, once the caller has copied them in. The static tensors are
        written by nothing else."""
        key = tuple((id(s), s._version) if isinstance(s, torch.Tensor) else s for s in sources)
        held = self._holds.get(id(static))
        if held is not None and held[0] == key:
            return False
        self._holds[id(static)] = (key, sources)  # the sources kept alive, so no other tensor takes their ids
        return True

    def _rows_into(
        self, static: torch.Tensor, rows: list[torch.Tensor], copies: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Add the copies of `rows` (each [1, ...]) into the rows of `static`, unless it holds them already."""
        if self._stale(static, *rows):
            views = self._row_views.get(id(static))
            if views is None:
                views = self._row_views[id(static)] = static.split(1)
            copies.extend(zip(views, rows))

    def _clock_on_device(self, clock: tuple[tuple[int, float, float], ...]) -> torch.Tensor:
        """The slots' (t, t_next) in the rows of their homes (`clock`: each slot's (home, t, t_next)) as a device
        tensor, kept by value: a steady ring's clocks repeat every few ticks, and a copy from the device costs less
        host time than one from the host. By home, not by place in the batch: a lane's advance graph reads its own
        slots' rows whatever the lanes before it hold."""
        tensor = self._clocks.get(clock)
        if tensor is None:
            rows = [(0.0, 0.0)] * HOMES
            for home, t, t_next in clock:
                rows[home] = (t, t_next)
            tensor = self._clocks[clock] = self._staging.to_device(torch.tensor(rows, dtype=torch.float32))
            if len(self._clocks) > CLOCKS_KEPT:
                self._clocks.popitem(last=False)
        self._clocks.move_to_end(clock)
        return tensor

    def _time_views(self, times_device: torch.Tensor, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(t, t_next) of the static times' `row` (a home's), as [1, 1, 1] views made once per row (the times tensor
        is one static tensor for the pipeline's life)."""
        views = self._times.get(row)
        if views is None:
            views = self._times[row] = (times_device[row, 0].view(1, 1, 1), times_device[row, 1].view(1, 1, 1))
        return views

    def _home(self, slots: list[Slot]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Give every slot in flight the home of its rank by age in its lane (`slots` come lane by lane, each
        `Lane.by_age`): a new slot is placed there, one whose rank changed moves. The moving slots' state (x and
        guidance states) is copied into a scratch copy by new home here, in one launch; returns the copies that
        fill the homes (from the scratch and the requests' tensors), for the caller's one launch: no launch reads
        a home that it writes, whatever the depth."""
        target, ranks = {}, {}
        for slot in slots:
            rank = ranks[slot.lane.base] = ranks.get(slot.lane.base, -1) + 1
            target[id(slot)] = slot.lane.base + rank
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        placed: list[tuple[torch.Tensor, torch.Tensor]] = []
        for slot in slots:
            if slot.home != target[id(slot)]:
                self._place(slot, target[id(slot)], staged, placed)
        if staged:
            targets, sources = zip(*staged)
            torch._foreach_copy_(list(targets), list(sources))
        return placed

    def _place(
        self,
        slot: Slot,
        home: int,
        staged: list[tuple[torch.Tensor, torch.Tensor]],
        placed: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Point the slot at `home`'s static tensors (curves at full length) and add the copies that fill them; give
        it that home's tensor for its per-step noise: a captured tick finds everything at fixed addresses. What a
        slot only reads (its noise, context, source, target, curves) is copied from the request's own tensors, and
        not at all where the home holds them already (a live stream's requests share them); what it writes (x, the
        guidance states) comes from its old home through `staged`'s scratch copy."""
        frames_shape = (1, slot.x.shape[1], 1)
        moved = slot.home is not None
        if not moved:
            slot.originals = {
                "noise": slot.noise,
                "context": slot.context,
                "source": slot.source,
                "x0_target": slot.x0_target,
                **{("curve", name): c for name, c in slot.curves.items()},
                **{("extra", e): w for e, w in enumerate(slot.extra_weights)},
            }

        def state(name: str, value: torch.Tensor | None) -> torch.Tensor | None:
            if value is None:
                return None
            static = self.static.get((home, name), tuple(value.shape), value.dtype)
            if moved:
                scratch = self.static.get(("scratch", home, name), tuple(value.shape), value.dtype)
                staged.append((scratch, value))
                value = scratch
            placed.append((static, value))
            return static

        slot.x = state("x", slot.x)
        slot.running = state("running", slot.running)
        slot.cached_negative = state("cached_negative", slot.cached_negative)
        reads = self._read_only(home, slot.originals, frames_shape, placed)
        slot.noise, slot.context, slot.source, slot.x0_target = (
            reads[n] for n in ("noise", "context", "source", "x0_target")
        )
        slot.curves = {name: reads[("curve", name)] for name in slot.curves}
        slot.extra_weights = tuple(reads[("extra", e)] for e in range(len(slot.extra_weights)))
        slot.step_noise = self.static.get((home, "step_noise"), tuple(slot.x.shape), slot.x.dtype)
        slot.home = home

    def _read_only(
        self,
        home: int,
        originals: dict[Any, torch.Tensor | None],
        frames_shape: tuple[int, ...],
        placed: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> dict[Any, torch.Tensor | None]:
        """`home`'s static tensors for a slot's read-only tensors (`Slot.originals`; curves at full length), adding
        the copies of those it does not hold already to `placed`. A home that holds every one of them (a steady
        ring's slot moving into the place of one with the same request tensors) is answered at once."""
        signature = (tuple(originals), tuple(None if v is None else (id(v), v._version) for v in originals.values()))
        held = self._home_reads.get(home)
        if held is not None and held[0] == signature:
            return held[1]
        reads: dict[Any, torch.Tensor | None] = {}
        for name, value in originals.items():
            if value is None:
                reads[name] = None
                continue
            shape = tuple(value.shape) if isinstance(name, str) else frames_shape
            static = reads[name] = self.static.get((home, name), shape, value.dtype)
            if self._stale(static, value):
                placed.append((static, value if value.shape == shape else value.expand(shape)))
        self._home_reads[home] = (signature, reads, originals)  # the originals kept alive: their ids stay theirs
        return reads

    def shared_curve(self, lane: Lane, name: str, curve: torch.Tensor, frames: int) -> torch.Tensor:
        """A lane's shared curve copied into its static tensor (at full length), where a captured tick reads it."""
        return self.static.put(("shared", lane.base, name), curve, (1, frames, 1))

    def shapes(self, batch: TickBatch, per_row_loras: bool) -> tuple:
        """What decides the gather's and the forward's kernels and sizes: frames, rows (their homes, negatives and
        weights), condition groups and K/V lengths, the decoder's LoRA structure, per-row LoRA strengths or not."""
        row_kinds = tuple((row.slot.home, row.negative, row.weight is not None) for row in batch.rows)
        layout = batch.layout
        kv_lengths = tuple(c.length for c in layout.conditions)
        frames = batch.slots[0].x.shape[1]
        structure = self.decoder.structure_version  # LoRAs attached or detached: the layers themselves changed
        return frames, row_kinds, layout.order, layout.counts, kv_lengths, structure, per_row_loras

    def advance_plans(
        self, batch: TickBatch, states: list[SlotState], lanes: Iterable[Lane]
    ) -> list[tuple[list[Slot], tuple, tuple]]:
        """Each lane's advance this tick: (its slots, the graph's key, the key's shapes). The key is everything that
        shapes the lane's advance besides tensor values: the velocity rows its slots read (where they sit among the
        batch's rows, and how many rows there are: each row count has a velocity tensor of its own), each slot's home
        and facts, the lane's shared curves; its shapes, the same without the homes, rows and shared curves (a plan
        at shapes that ran before is captured at once). `states`: each slot's (`Slot.state`), in `batch.slots`
        order."""
        position = batch.layout.positions
        rows_of: dict[int, list[tuple[int, bool, bool]]] = {}
        for i, row in enumerate(batch.rows):
            rows_of.setdefault(id(row.slot), []).append((position[i], row.negative, row.weight is not None))
        by_lane: dict[int, list[tuple[Slot, tuple]]] = {}
        for slot, state in zip(batch.slots, states):
            facts = (
                self._step_facts(slot, state),
                slot.t > 0,
                slot.t_next > 0,
                self._options(slot),
                slot.running is not None,
                slot.cached_negative is not None,
                len(rows_of[id(slot)]),
            )
            by_lane.setdefault(slot.lane.base, []).append((slot, facts))
        frames = batch.slots[0].x.shape[1]
        plans = []
        for lane in lanes:
            held = by_lane.get(lane.base)
            if not held:
                continue
            slots = [slot for slot, _ in held]
            facts = tuple(f for _, f in held)
            places = tuple((slot.home, tuple(rows_of[id(slot)])) for slot in slots)
            shared = tuple(sorted((name, tuple(curve.shape)) for name, curve in lane.shared.items()))
            plan_shapes = ("advance", frames, facts)
            plans.append((slots, (*plan_shapes, len(batch.rows), places, shared), plan_shapes))
        return plans

    @staticmethod
    def gather_plan(batch: TickBatch, shapes: tuple) -> tuple:
        """The gather graph's key: the plan's shapes (the rows' homes and order among them), and which slots' model
        inputs blend kept frames in (a latent mask)."""
        return "gather", shapes, tuple((slot.home, "latent_mask" in slot.curves) for slot in batch.slots)

    @staticmethod
    def forward_shapes(batch: TickBatch, shapes: tuple, groups: list[CrossGroup]) -> tuple:
        """The forward graph's key, the shapes its kernels run at and nothing else: frames, rows, the condition groups'
        row counts and K/V shapes, the decoder's structure (LoRAs attached), per-row LoRA strengths or not."""
        frames, _, _, counts, _, structure, per_row_loras = shapes
        kv_shapes = tuple(tuple(group.kv.keys[0].shape) for group in groups)
        return "forward", frames, len(batch.rows), counts, kv_shapes, structure, per_row_loras

    @staticmethod
    def _options(slot: Slot) -> tuple:
        """What in a slot's device work its request fixes for the slot's life (solver, guidance, which optional
        tensors and curves it has), made once per slot."""
        if slot.plan_options is None:
            request = slot.request
            slot.plan_options = (
                request.solver,
                request.cfg_mode,
                request.guidance_method,
                request.dcw,
                request.x0_target_gate,
                slot.source is not None,
                slot.x0_target is not None,
                tuple(sorted(slot.curves)),
                tuple(weight is not None for weight in slot.extra_weights),
            )
        return slot.plan_options

    @staticmethod
    def _step_facts(slot: Slot, state: SlotState) -> tuple:
        """What a slot's place in its schedule changes in the device work: the conditions whose step range is
        active, the negative row, and the x0 target's pull. Not the step itself: every step of a schedule (of any
        length) with the same facts shares one plan, so knob changes do not multiply plans."""
        request = slot.request
        ranges = (request.primary_step_range, *(extra.step_range for extra in request.extra_conditions))
        active = tuple(solver.step_range_active(r, slot.step, slot.steps) for r in ranges)
        return active, needs_negative(request.cfg_mode, slot.step), x0_pull(state)

    def _keep(self, slot: Slot, name: str, value: torch.Tensor | None) -> bool:
        """Copy a guidance state into the slot's static tensor (graph path); whether there is one."""
        if value is None:
            return False
        target = self._static_state(slot, name)
        if value is not target:
            target.copy_(value)
        return True

    def _static_state(self, slot: Slot, name: str) -> torch.Tensor:
        return self.static.get((slot.home, name), tuple(slot.x.shape), slot.x.dtype)

    def _static_kv(self, group: int, conditioning: Conditioning, strengths: tuple[float, ...] | None) -> CrossKV:
        """The group's static K/V, refreshed (one fused copy) when a different condition takes the group or its
        K/V were rebuilt (a LoRA strength on the cross K/V projections changed). Every prompt length of a group
        shares one buffer per layer and side (`StaticTensors.prefix`), so new prompts add no memory."""
        kv = conditioning.cross_kv(self.decoder, strengths)
        owner = self._kv_owner.get(group)
        if owner is not None and owner[0] is kv:  # the steady case: nothing to look up or copy
            return owner[1]
        names = [("kv", group, side, layer) for side in "kv" for layer in range(len(kv.keys))]
        growths = self.static.growths
        static = [self.static.prefix(name, tuple(t.shape), t.dtype) for name, t in zip(names, kv.keys + kv.values)]
        if self.static.growths != growths:  # a longer prompt than the group held: new buffers, which no graph reads
            self.graphs.clear()
        torch._foreach_copy_(static, kv.keys + kv.values)
        layers = len(kv.keys)
        static_kv = CrossKV(static[:layers], static[layers:])
        self._kv_owner[group] = (kv, static_kv)
        return static_kv
