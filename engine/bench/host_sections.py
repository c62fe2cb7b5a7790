"""Where a tick's host time goes: the stream's main host steps timed by wrapping them for a few ticks (medians per
tick), what `bench tick --profile` prints under the kernel table."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator

import torch

from ..stream.batch import TickBatch
from ..stream.graph_step import GraphStep
from ..stream.pipeline import StreamPipeline
from ..stream.tick_graph import TickGraphs

SECTIONS: tuple[tuple[type, str], ...] = (
    (StreamPipeline, "submit"),
    (StreamPipeline, "_start"),
    (TickBatch, "of"),
    (GraphStep, "run"),
    (GraphStep, "_home"),
    (GraphStep, "shapes"),
    (GraphStep, "advance_plans"),
    (TickGraphs, "run"),
    (torch.cuda.CUDAGraph, "replay"),
    (StreamPipeline, "_gpu_events"),
    (StreamPipeline, "_record"),
)
"""The host steps timed (nested ones are inside their callers' times: `GraphStep.run` holds `_home`, `shapes`,
`advance_plans` and `TickGraphs.run`, which holds the replay)."""


@contextlib.contextmanager
def timed_sections(sections: tuple[tuple[type, str], ...] = SECTIONS) -> Iterator[dict[str, list[float]]]:
    """Wrap each (owner, method) with a timer for the duration; yields the seconds of every call by section."""
    calls: dict[str, list[float]] = {}
    originals = [(owner, name, owner.__dict__[name]) for owner, name in sections]
    for owner, name, method in originals:
        setattr(owner, name, _timer(method, calls.setdefault(f"{owner.__name__}.{name}", [])))
    try:
        yield calls
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)


def _timer(method: Callable | staticmethod, seconds: list[float]) -> Callable | staticmethod:
    """`method` (a function or a staticmethod, as found in its class) timing each call into `seconds`."""
    static = isinstance(method, staticmethod)
    call = method.__func__ if static else method

    @functools.wraps(call)
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    return staticmethod(timed) if static else timed


def host_sections(tick: Callable[[], object], sync: Callable[[], None], ticks: int = 40) -> str:
    """Each section's median ms per call and calls per tick over `ticks` ticks, each started on an idle device."""
    with timed_sections() as calls:
        for _ in range(ticks):
            sync()
            tick()
        sync()
    lines = ["host by section (median ms per call x calls per tick):"]
    for section, seconds in calls.items():
        if seconds:
            lines.append(f"  {section:30s} {statistics.median(seconds) * 1e3:7.3f} x {len(seconds) / ticks:.2f}")
    return "\n".join(lines)
