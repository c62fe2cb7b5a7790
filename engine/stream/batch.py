"""The batch of one tick: each slot's rows (positive, negative, extra conditions), their order in the batched
forward (`Layout`: each condition's rows contiguous) and the LoRA strengths each lane's rows are heard at."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..conditioning import Conditioning
from ..lora.attached import LoraSet, lora_set
from ..models.dit import CrossGroup, CrossKV, DiTDecoder
from ..sampling import solver
from ..sampling.step import needs_negative
from .lanes import Lane, Slot


@dataclass(eq=False)
class Row:
    """One row of the batched forward: a slot's condition (positive or negative) and its blend weight."""

    slot: Slot
    conditioning: Conditioning
    negative: bool
    weight: torch.Tensor | None = None


def rows_for(slot: Slot) -> list[Row]:
    """The slot's rows this step: the primary and extra conditions whose step range is active (the primary when
    none is), and the negative when its CFG mode needs one."""
    request = slot.request
    rows = []
    if solver.step_range_active(request.primary_step_range, slot.step, slot.steps) or not request.extra_conditions:
        rows.append(Row(slot, request.conditioning, False, slot.curves.get("primary_weight")))
    for extra, weight in zip(request.extra_conditions, slot.extra_weights):
        if solver.step_range_active(extra.step_range, slot.step, slot.steps):
            rows.append(Row(slot, extra.conditioning, False, weight))
    if not rows:
        rows.append(Row(slot, request.conditioning, False, None))
    if needs_negative(request.cfg_mode, slot.step):
        rows.append(Row(slot, request.negative, True))
    return rows


@dataclass(frozen=True)
class Layout:
    """The batch of a tick: rows reordered so each condition's rows are contiguous (conditions in order of first
    use); `order[p]` is the index in `rows` of batch position p. A condition heard at a session's own LoRA
    strengths (on the cross K/V projections) is a condition of its own: `kv_strengths` says which."""

    order: tuple[int, ...]
    conditions: tuple[Conditioning, ...]
    counts: tuple[int, ...]
    kv_strengths: tuple[tuple[float, ...] | None, ...]

    @staticmethod
    def of(rows: list[Row], kv_strengths: dict[str, tuple[float, ...] | None]) -> Layout:
        """`kv_strengths`: by lane, the LoRA strengths its conditions' K/V are built at (None: the decoder's)."""
        by_condition: dict[tuple, list[int]] = {}
        conditions: dict[tuple, Conditioning] = {}
        for index, row in enumerate(rows):
            key = (id(row.conditioning), kv_strengths.get(row.slot.lane.name))
            by_condition.setdefault(key, []).append(index)
            conditions.setdefault(key, row.conditioning)
        return Layout(
            tuple(i for indices in by_condition.values() for i in indices),
            tuple(conditions.values()),
            tuple(len(indices) for indices in by_condition.values()),
            tuple(strengths for _, strengths in conditions),
        )

    @functools.cached_property
    def positions(self) -> tuple[int, ...]:
        """The inverse of `order`: `positions[i]` is the batch position of row i (made once per tick's layout)."""
        positions = [0] * len(self.order)
        for p, index in enumerate(self.order):
            positions[index] = p
        return tuple(positions)

    def groups(self, kvs: list[CrossKV]) -> list[CrossGroup]:
        """Each condition's cross K/V with the batch positions of its rows."""
        starts = [sum(self.counts[:g]) for g in range(len(self.counts))]
        return [CrossGroup(kv, start, count) for kv, start, count in zip(kvs, starts, self.counts)]


@dataclass(frozen=True)
class OwnStrengths:
    """What a lane's LoRA strengths change in a tick: `rows`, its rows' strengths in the batched forward (None: the
    shared ones); `kv`, those its conditions' cross K/V are built at (None unless a live LoRA changes the K/V
    projections); `time`, the key of its timestep embeddings (None unless a LoRA changes the embedders)."""

    rows: tuple[float, ...] | None = None
    kv: tuple[float, ...] | None = None
    time: tuple | None = None


SHARED_STRENGTHS = OwnStrengths()


def lane_strengths(decoder: DiTDecoder, lane: Lane) -> OwnStrengths:
    """The lane's LoRA strengths for this tick (its own where it set any, else the decoder's shared ones)."""
    loras: LoraSet | None = decoder.__dict__.get("_lora_set")
    if loras is None or not loras.attached:
        return SHARED_STRENGTHS
    live = loras.live_adapters()
    own = loras.strengths_with(lane.loras) if lane.loras and live else None
    on_time = any(adapter.touches_time_embedding() for _, adapter in loras.attached.values())
    return OwnStrengths(
        own,
        own if any(adapter.touches_cross_kv() for adapter in live) else None,
        (loras.version, own) if on_time else None,
    )


def host_lora_rows(
    decoder: DiTDecoder, rows: list[Row], layout: Layout, strengths: dict[str, OwnStrengths]
) -> torch.Tensor | None:
    """[rows, MAX_LORAS] host tensor of every batch row's LoRA strengths, or None when every lane in the tick
    plays the shared ones (the forward then reads the decoder's strengths tensor)."""
    if all(own.rows is None for own in strengths.values()):
        return None
    shared = tuple(lora_set(decoder).host_strengths)
    return torch.tensor([strengths[rows[i].slot.lane.name].rows or shared for i in layout.order], dtype=torch.float32)


@dataclass(frozen=True)
class TickBatch:
    """Everything that shapes one tick's batched forward: the slots in flight, their rows in `layout`'s order, each
    lane's LoRA strengths (by lane name) and the rows' own strengths on the host (None: the shared ones)."""

    slots: list[Slot]
    rows: list[Row]
    layout: Layout
    strengths: dict[str, OwnStrengths]
    host_lora_rows: torch.Tensor | None

    @staticmethod
    def of(decoder: DiTDecoder, active: list[Slot]) -> TickBatch:
        rows = [row for slot in active for row in rows_for(slot)]
        lanes = {id(slot.lane): slot.lane for slot in active}.values()
        strengths = {lane.name: lane_strengths(decoder, lane) for lane in lanes}
        layout = Layout.of(rows, {name: own.kv for name, own in strengths.items()})
        return TickBatch(active, rows, layout, strengths, host_lora_rows(decoder, rows, layout, strengths))
