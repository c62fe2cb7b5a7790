"""CUDA-graph ticks: a tick reads and writes only static tensors (`StaticTensors`), so its whole device work (the
DiT forward over every row, CFG/APG and each slot's integration) can be captured once per tick plan and replayed.

A plan (`TickGraphs.run`'s key) is everything that shapes the tick's control flow: rows, conditions' lengths,
each slot's place, step and options. The first time a plan comes the tick runs as plain PyTorch (the warm-up that
a capture needs; skipped when its shapes have run before), the next time it is captured, from then on it is one
`CUDAGraph.replay()`. New values (requests, knobs, curves, prompts) are copies into the static tensors, never
re-captures. Graphs share one memory pool: they run one at a time and keep nothing but the static tensors between
ticks. The pool's life is owned by a keeper: a one-kernel graph captured into the pool first and never dropped. The
device and the pinned-host allocators each count a pool's graphs, and a pool whose last graph went (evicted, or every
graph cleared when a K/V buffer grows) has a count of 0 that the next capture into it trips over (`use_count > 0`
INTERNAL ASSERT in CUDACachingAllocator.cpp or CachingHostAllocator.h); the keeper holds both counts above 0."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("flowjam.graphs")

GRAPH_CAPACITY = 192  # captured plans kept, a tick's three kinds together (least recently used dropped first)
CAPTURE_TRIES = 2  # failed captures of one plan before it always runs uncaptured
DEVICE_WORK = threading.RLock()
"""Held by every capture and by device work that may synchronise the whole device (a compiled kernel's first run
autotunes with a device sync; a graph's first run loads kernels): a capture on one thread must never see it from
another, or the capture breaks. Replays and steady ticks do not need it."""


@dataclass
class GraphCounters:
    new_plans: int = 0  # ticks whose plan had not been seen (recently)
    uncaptured: int = 0  # ticks run as plain PyTorch: a new plan's warm-up, or every tick when not capturing
    captures: int = 0
    replays: int = 0
    evictions: int = 0
    capture_failures: int = 0  # failed captures (the tick then runs uncaptured)
    capture_ms: float = 0.0  # host time of every capture (recording and instantiation), summed
    capture_ms_max: float = 0.0  # the slowest capture's
    last_failure: str = ""  # the newest failed capture's cause (its error's first line)


class StaticTensors:
    """Persistent device tensors by name: the same name and shape always give the same tensor (same address)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._tensors: dict[Hashable, torch.Tensor] = {}
        self._buffers: dict[Hashable, torch.Tensor] = {}  # `prefix`'s, by name and dtype
        self.growths = 0  # `prefix` buffers replaced by larger ones (graphs captured before read the old ones)

    def prefix(self, name: Hashable, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` at the start of one buffer per name, whatever the shape: a condition's K/V
        at a new prompt length reuse the memory of the others (and their address). The buffer grows to the next
        power of two of elements when a larger shape comes, counted in `growths`."""
        numel = math.prod(shape)
        key = (name, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.zeros(1 << (numel - 1).bit_length(), device=self.device, dtype=dtype)
            self.growths += 1
        return buffer[:numel].view(shape)

    def get(self, name: Hashable, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        key = (name, tuple(shape), dtype)
        tensor = self._tensors.get(key)
        if tensor is None:
            tensor = self._tensors[key] = torch.zeros(shape, device=self.device, dtype=dtype)
        return tensor

    @property
    def megabytes(self) -> float:
        """Device memory the static tensors hold."""
        tensors = (*self._tensors.values(), *self._buffers.values())
        return sum(t.numel() * t.element_size() for t in tensors) / 2**20

    def put(self, name: Hashable, value: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """Copy `value` (broadcast to `shape` if given) into the static tensor of that name; returns it."""
        tensor = self.get(name, tuple(value.shape) if shape is None else shape, value.dtype)
        tensor.copy_(value)
        return tensor


class TickGraphs:
    """Warm-up, capture and replay of tick plans. `capture=False` (or a CPU device) runs every tick as is, through
    the same static tensors: the path CI can test without a GPU."""

    def __init__(self, device: torch.device, capture: bool = True, capacity: int = GRAPH_CAPACITY):
        self.capture = capture and device.type == "cuda"
        self.capacity = capacity
        self.counters = GraphCounters()
        self._graphs: OrderedDict[Hashable, tuple[torch.cuda.CUDAGraph, Any]] = OrderedDict()
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self._failures: dict[Hashable, int] = {}  # failed captures per plan
        self._warm_shapes: OrderedDict[Hashable, None] = OrderedDict()  # shapes some plan has run plain at
        self._pool: tuple[int, int] | None = None  # the graphs' memory pool, made with its keeper
        self._keeper: torch.cuda.CUDAGraph | None = None
        self._stream: torch.cuda.Stream | None = None

    def run(self, plan: Hashable, step: Callable[[], Any], capture: bool = True, shapes: Hashable = None) -> Any:
        """Run one tick of this plan; `step` does the device work and returns host-side facts (no tensors).
        `capture=False`: always run it plain (a rare plan not worth a graph's memory). `shapes`: the part of the
        plan that decides which kernels run at which sizes; a new plan whose shapes have run plain before is
        captured at once, without a plain warm-up (a shared knob's first move makes a few new plans, one per place
        of the slots in their schedules: each then costs one capture, not a plain tick and a capture)."""
        entry = self._graphs.get(plan)
        if entry is not None:
            self._graphs.move_to_end(plan)
            entry[0].replay()
            self.counters.replays += 1
            return entry[1]
        with DEVICE_WORK:
            capturing = self.capture and capture and self._failures.get(plan, 0) < CAPTURE_TRIES
            if plan not in self._seen:
                self._remember(plan)
                self.counters.new_plans += 1
                capturing = capturing and shapes is not None and shapes in self._warm_shapes
            if not capturing:
                self._seen.move_to_end(plan)
                self.counters.uncaptured += 1
                facts = step()
                self._warmed(shapes)
                return facts
            started = time.perf_counter()
            try:
                facts, graph = self._capture(step)
            except RuntimeError as error:  # nothing ran on the device: run the tick plain (a fresh warm-up)
                self._failed(plan, error)
                self.counters.uncaptured += 1
                return step()
            capture_ms = 1e3 * (time.perf_counter() - started)
        graph.replay()
        self._graphs[plan] = (graph, facts)
        self.counters.captures += 1
        self.counters.capture_ms += capture_ms
        self.counters.capture_ms_max = max(self.counters.capture_ms_max, capture_ms)
        if len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)
            self.counters.evictions += 1
        return facts

    def clear(self) -> None:
        """Drop every captured graph (they read static tensors that are gone); each plan is captured again the next
        time it comes, at once, its shapes being warm."""
        self._graphs.clear()

    def _warmed(self, shapes: Hashable) -> None:
        if shapes is not None:
            _keep_newest(self._warm_shapes, shapes, self.capacity)

    def _capture(self, step: Callable[[], Any]) -> tuple[Any, torch.cuda.CUDAGraph]:
        """Record `step` on a side stream into a graph of the shared pool. Unlike `torch.cuda.graph`, no device
        synchronisation, garbage collection or cache emptying first: a capture in a live stream must not stall it
        for longer than the tick it records. Thread-local capture: another thread's CUDA calls (the writer's decode
        and copies, say) neither fail nor spoil it."""
        graph = torch.cuda.CUDAGraph()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            if self._keeper is None:
                self._keep_pool()
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                facts = step()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # ending an invalidated capture raises too
                    self._end_capture(graph)
                raise
            self._end_capture(graph)
        torch.cuda.current_stream().wait_stream(self._stream)
        return facts, graph

    def _keep_pool(self) -> None:
        """Open a new pool with its keeper graph (one add into a one-element tensor, never replayed), on the capture
        stream."""
        self._pool = torch.cuda.graph_pool_handle()
        keeper, counter = torch.cuda.CUDAGraph(), torch.zeros(1, device=torch.cuda.current_device())
        keeper.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        counter.add_(1)
        self._end_capture(keeper)
        self._keeper = keeper

    def _end_capture(self, graph: torch.cuda.CUDAGraph) -> None:
        """End the capture; one that ends in error leaves the pool marked as being recorded into (every later
        capture into it would fail), so the pool is let go of before the error goes on."""
        try:
            graph.capture_end()
        except RuntimeError:
            self._release_pool()
            raise

    def _release_pool(self) -> None:
        """Stop the allocator routing this device's allocations to the pool of a capture that ended in error."""
        with contextlib.suppress(RuntimeError):  # raises if the failed capture_end let go of it already
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), self._pool)

    def _failed(self, plan: Hashable, error: RuntimeError) -> None:
        """A capture failed (an operation a capture forbids, or a kernel first loaded inside it because compiled code
        changed since the plan's warm-up): the tick runs plain, which warms the plan again; after CAPTURE_TRIES
        failures the plan always runs plain. Later captures use a fresh pool and keeper (a failed capture can leave
        its pool marked busy); the graphs of the old pool replay on, holding it."""
        self.counters.capture_failures += 1
        self.counters.last_failure = str(error).strip().splitlines()[0][:300] if str(error).strip() else repr(error)
        self._failures[plan] = self._failures.get(plan, 0) + 1
        self._keeper = None
        self._stream = None
        log.warning(
            "a CUDA-graph capture failed (%d so far), the tick runs uncaptured: %s",
            self.counters.capture_failures,
            error,
            exc_info=self.counters.capture_failures == 1,
        )

    def _remember(self, plan: Hashable) -> None:
        _keep_newest(self._seen, plan, 4 * self.capacity)

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def recent_plans(self, kind: str) -> int:
        """How many of the plans seen lately (a bounded memory) are of `kind`: those whose key starts with it."""
        return sum(1 for plan in self._seen if isinstance(plan, tuple) and plan[:1] == (kind,))


def _keep_newest(keys: OrderedDict[Hashable, None], key: Hashable, bound: int) -> None:
    """Mark `key` as just used in a set of at most `bound` keys (the least recently used one dropped)."""
    keys[key] = None
    keys.move_to_end(key)
    if len(keys) > bound:
        keys.popitem(last=False)
