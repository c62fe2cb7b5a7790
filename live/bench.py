"""Live benchmarks: knob-to-tick / knob-to-ear latency and a soak run (knob storm + prompt swaps)."""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.params import DEFAULT_WINDOW_SECONDS
from ..engine.session import Session
from .app import LiveApp, LiveConfig
from .knobs import KnobRegistry
from .runner import RunnerConfig


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def _underruns(app: LiveApp) -> tuple[int, int, int]:
    """The output's (underruns, gaps, late blocks) so far."""
    stats = app.playback.stats()
    return tuple(int(stats.get(key) or 0) for key in ("underruns", "gaps", "late_blocks"))


def _wait(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def settle_plans(runner, quiet_ticks: int, timeout_s: float = 30.0) -> int:
    """Wait until `quiet_ticks` ticks in a row made no new tick plan; -> the ticks it took (0 without CUDA graphs).
    A shared knob's first move off its default makes a new plan for each place the slots take in their schedules,
    each captured once; trials after it measure the steady stream, and this count says what the first move cost."""
    start = runner.stats.ticks
    graphs = runner.stream.stats()["graphs"]
    if graphs is None:
        return 0
    plans, quiet_from = graphs["new_plans"], start
    deadline = time.monotonic() + timeout_s
    while runner.stats.ticks - quiet_from < quiet_ticks and time.monotonic() < deadline:
        time.sleep(0.002)
        now = runner.stream.stats()["graphs"]["new_plans"]
        if now != plans:
            plans, quiet_from = now, runner.stats.ticks
    return quiet_from - start


@dataclass(frozen=True)
class LatencySummary:
    knob: str
    kind: str
    trials: int
    tick_ms_median: float
    tick_ms_p95: float
    written_ms_median: float  # knob -> its first audio patched into the loop
    ear_ms_median: float
    ear_ms_p95: float
    first_touch_ear_ms: float  # the knob's first move off its default, before the trials (see measure_latency)
    first_touch_plan_ticks: int  # ticks after the first move that still made new tick plans (settle_plans)
    later_touch_ear_ms: float | None = None  # what the first touch is held against, where not `ear_ms_median`

    @property
    def first_touch_ratio(self) -> float:
        """The first touch's knob -> ear over its later touches' (their median, or `later_touch_ear_ms`): how much
        slower a knob's first move is heard."""
        later = self.ear_ms_median if self.later_touch_ear_ms is None else self.later_touch_ear_ms
        return self.first_touch_ear_ms / later


FIRST_TOUCH_BOUND = 1.5  # a knob's first move is heard within this many times its later moves' median


def p95(values: list[float]) -> float:
    """The 95th percentile of sorted `values` (the nearest rank at or below)."""
    return values[min(len(values) - 1, int(0.95 * len(values)))]


def summarize_latency(
    knob: str, kind: str, records, first_touch, plan_ticks: int = 0, later_touch_ear_ms: float | None = None
) -> LatencySummary:
    ticks = sorted(r.knob_to_tick_ms for r in records)
    ears = sorted(r.knob_to_ear_ms for r in records)
    written = statistics.median(r.knob_to_written_ms for r in records)
    return LatencySummary(
        knob,
        kind,
        len(records),
        statistics.median(ticks),
        p95(ticks),
        written,
        statistics.median(ears),
        p95(ears),
        first_touch.knob_to_ear_ms,
        plan_ticks,
        later_touch_ear_ms,
    )


def _registry(depth: int, cfg_mode: str) -> KnobRegistry:
    registry = KnobRegistry()
    registry.set("depth", depth, origin="bench")
    registry.set("cfg_mode", cfg_mode, origin="bench")
    return registry


def measure_latency(
    session: Session,
    trials: int = 12,
    song_seconds: float = 10.0,
    depth: int = 4,
    playback_mode: str = "null-process",
    cfg_mode: str = "off",
    window_s: float = DEFAULT_WINDOW_SECONDS,
    endless: bool = False,
) -> tuple[list[LatencySummary], dict]:
    """Turn a shared-curve knob (velocity_scale) and a per-request knob (denoise) `trials` times each; follow every
    change to the first tick that used it and to the moment the playhead reaches audio made with it. Returns the
    summaries and the runner's status at the end (tick, decode, interval between writes, lead).

    Each knob is moved once off its default before its trials and that first touch is reported on its own: a
    shared knob off its default makes new tick plans (one per place of the slots in their schedules, each captured
    once), a one-off cost of a knob's first move that the steady trials would otherwise average in; the trials
    start once the plans have settled (`settle_plans`), and the ticks that took are reported."""
    registry = _registry(depth, cfg_mode)
    app = LiveApp(
        session,
        LiveConfig(
            prompt="latency probe",
            song_seconds=song_seconds,
            playback_mode=playback_mode,
            osc_port=None,
            runner=RunnerConfig(window_s=window_s, endless=endless),
        ),
        registry,
    )
    app.start()
    try:
        # trials start once the loop is filled and written ahead of (the first latent's whole-loop decode is done)
        if not _wait(lambda: app.runner.stats.writes > 1, 120):
            raise RuntimeError("the stream produced nothing within 120 s")

        def follow(knob: str, value: float):
            change = registry.set(knob, value, origin="bench")
            if not _wait(lambda: any(r.change.seq == change.seq for r in app.runner.stats.latencies), 60):
                raise RuntimeError(f"a {knob} change never reached the ear")
            time.sleep(0.05)
            return next(r for r in app.runner.stats.latencies if r.change.seq == change.seq)

        summaries = []
        quiet = 2 * int(registry.get("steps"))  # every place of every slot in its schedule, twice
        for knob, values in (("velocity_scale", (1.3, 0.7)), ("denoise", (0.5, 0.8))):
            first_touch = follow(knob, values[1])
            plan_ticks = settle_plans(app.runner, quiet)
            records = [follow(knob, values[trial % 2]) for trial in range(trials)]
            summaries.append(summarize_latency(knob, registry.specs[knob].kind.value, records, first_touch, plan_ticks))
        return summaries, app.runner.status()
    finally:
        app.stop()


@dataclass(frozen=True)
class SoakReport:
    minutes: float
    ticks: int
    knob_sets: int
    prompt_swaps: int
    rss_start_mb: float
    rss_end_mb: float
    underruns: int  # while soaking: gaps + late blocks
    gaps: int  # of them, silence because the engine fell behind the playhead
    late_blocks: int  # of them, the output itself came late (a device's underflow, the null clock's late wake-up)
    start_underruns: int  # while starting (first compiles and captures), before the storm
    tick_ms_first: float
    tick_ms_last: float
    errors: int
    gpu_mb: tuple[float, float, float] | None  # allocated at the start and the end, peak (None off a GPU)
    status: dict
    rss_minute1_mb: float | None = None  # after the first minute of the storm (None in a shorter soak)
    gpu_minute1_mb: float | None = None
    gap_times_s: tuple[float, ...] = ()  # when gaps were counted (to the half second), from the storm's start

    @property
    def capture_failures(self) -> int:
        """Failed CUDA-graph captures of the ticks and the window decodes, the start included."""
        graphs = (self.status.get(which) or {} for which in ("tick_graphs", "window_graphs"))
        return sum(int(counters.get("capture_failures", 0)) for counters in graphs)


def soak(
    session: Session,
    minutes: float,
    song_seconds: float = 10.0,
    depth: int = 4,
    playback_mode: str = "null-process",
    seed: int = 0,
    cfg_mode: str = "off",
    report: Callable[[str], None] | None = None,
    window_s: float = DEFAULT_WINDOW_SECONDS,
    endless: bool = False,
) -> SoakReport:
    """Play for `minutes` under a knob storm (~200 sets/s over every knob but steps, depth and cfg_mode) with a
    prompt swap every 5 s; `report` gets a progress line every 30 s."""
    rng = random.Random(seed)
    registry = _registry(depth, cfg_mode)
    app = LiveApp(
        session,
        LiveConfig(
            prompt="soak a",
            prompt_b="soak b",
            song_seconds=song_seconds,
            playback_mode=playback_mode,
            osc_port=None,
            runner=RunnerConfig(window_s=window_s, endless=endless),
        ),
        registry,
    )
    stop = threading.Event()
    counts = {"knobs": 0, "prompts": 0}
    names = [name for name in registry.specs if name not in ("steps", "depth", "cfg_mode")]

    def storm() -> None:
        last_prompt = time.monotonic()
        while not stop.is_set():
            name = rng.choice(names)
            registry.set_normalized(name, rng.random(), origin="soak")
            counts["knobs"] += 1
            if time.monotonic() - last_prompt > 5:
                app.runner.set_prompt(rng.choice("ab"), f"soak prompt {counts['prompts']}")
                counts["prompts"] += 1
                last_prompt = time.monotonic()
            time.sleep(0.005)

    app.start()
    worker = threading.Thread(target=storm, daemon=True)
    tick_samples: list[tuple[float, float]] = []
    try:
        _wait(lambda: app.runner.stats.writes > 1, 120)
        rss_start = _rss_mb()
        cuda = session.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(session.device)
            gpu_start = torch.cuda.memory_allocated(session.device) / 2**20
        at_start = _underruns(app)
        started = time.monotonic()
        worker.start()
        rss_minute1 = gpu_minute1 = None
        gap_times, gaps_seen = [], at_start[1]
        while time.monotonic() - started < minutes * 60:
            time.sleep(0.5)
            elapsed = time.monotonic() - started
            tick_samples.append((elapsed, app.runner.stats.tick_ms))
            gaps_now = _underruns(app)[1]
            gap_times += [round(elapsed * 2) / 2] * (gaps_now - gaps_seen)
            gaps_seen = gaps_now
            if rss_minute1 is None and elapsed >= 60:
                rss_minute1 = _rss_mb()
                gpu_minute1 = torch.cuda.memory_allocated(session.device) / 2**20 if cuda else None
            if report is not None and len(tick_samples) % 60 == 0:
                stats = app.runner.stats
                graphs = app.runner.stream.stats()["graphs"]
                kept = (
                    ""
                    if graphs is None
                    else f", {graphs['captured']} tick graphs kept ({graphs['static_mb']} MB static)"
                )
                if cuda:
                    kept += f", GPU {torch.cuda.memory_allocated(session.device) / 2**20:.0f} MB"
                total, gaps, late = (now - start for now, start in zip(_underruns(app), at_start))
                report(
                    f"{tick_samples[-1][0]:.0f} s: {stats.ticks} ticks, {stats.errors} runner errors, "
                    f"{total} underruns ({gaps} gaps, {late} late blocks), "
                    f"tick {stats.tick_ms:.1f} ms, RSS {_rss_mb():.0f} MB{kept}"
                )
        rss_end = _rss_mb()
        gpu_mb = None
        if cuda:
            allocated = torch.cuda.memory_allocated(session.device) / 2**20
            gpu_mb = (gpu_start, allocated, torch.cuda.max_memory_allocated(session.device) / 2**20)
        status = app.runner.status()
    finally:
        stop.set()
        worker.join(timeout=5)
        at_end = _underruns(app)
        app.stop()
    span = minutes * 60
    first = [ms for t, ms in tick_samples if t <= max(10.0, span * 0.2)]
    last = [ms for t, ms in tick_samples if t >= span - max(10.0, span * 0.2)]
    return SoakReport(
        minutes=minutes,
        ticks=app.runner.stats.ticks,
        knob_sets=counts["knobs"],
        prompt_swaps=counts["prompts"],
        rss_start_mb=rss_start,
        rss_end_mb=rss_end,
        underruns=at_end[0] - at_start[0],
        gaps=at_end[1] - at_start[1],
        late_blocks=at_end[2] - at_start[2],
        start_underruns=at_start[0],
        tick_ms_first=statistics.median(first) if first else float("nan"),
        tick_ms_last=statistics.median(last) if last else float("nan"),
        errors=app.runner.stats.errors,
        gpu_mb=gpu_mb,
        status=status,
        rss_minute1_mb=rss_minute1,
        gpu_minute1_mb=gpu_minute1,
        gap_times_s=tuple(gap_times),
    )
