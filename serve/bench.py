"""How many live sessions one host keeps in real time: N sessions on one ring (runners, writers and the host's
real-time clock, as served), each getting a fresh latent at least every `latent_interval_ms` and its knobs heard
within the target; knob -> ear measured per session, every session's knob turned at the same moment."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

from ..engine.params import DEFAULT_WINDOW_SECONDS
from ..engine.stream.tick_graph import GraphCounters
from ..live.bench import LatencySummary, summarize_latency
from ..live.shared_ticker import CyclePhases
from .errors import SessionRefused
from .host import RingHost, SessionSpec

SETTLE_CYCLES = 8  # ring cycles with no new tick plan and no capture: the ring replays the graphs it keeps
SETTLE_TIMEOUT_S = 120.0
KNOB_TRIALS = (("velocity_scale", (1.3, 0.7)), ("denoise", (0.5, 0.8)))  # a shared knob, then a per-request one


@dataclass(frozen=True)
class SessionsReport:
    sessions: int
    refused: str | None  # admission control's reason when the last session was refused
    ring_tick_ms: float  # median over the measurement
    phases: CyclePhases  # where the ring's cycle went, at the end of the shared knob's trials
    latent_interval_ms: float  # the slowest session's mean time between fresh latents while shared knobs move
    restarting_interval_ms: float  # the same while a per-request knob moves (each change restarts the slots)
    cycles_per_latent: float  # ring cycles between the slowest session's fresh latents while shared knobs move
    starting_s: float  # the first create -> the last session started (admission measures the ring between creates)
    settle_s: float | None  # the last session started -> the ring's tick graphs settled (None: not within the timeout)
    touch_settle_s: tuple[float | None, ...]  # each knob's first touch -> settled again (its new plans captured)
    knobs: list[LatencySummary]  # over every session's trials
    errors: int
    graphs: GraphCounters | None = None  # the ring's tick graphs at the end (None on a backend without graphs)
    writes: int = 0  # audio patches every session wrote during the knobs' turns
    late_writes: int = 0  # of them, those the playhead had reached before they landed (their fade-in cut short)
    write_batches: int = 0  # the ring writer's batches that wrote them (0: a writer thread per session)

    def realtime(self, interval_ms: float, ear_ms: float) -> bool:
        shared = self.knobs[0]
        return self.refused is None and self.latent_interval_ms <= interval_ms and shared.ear_ms_p95 <= ear_ms


def _write_batches(host) -> int:
    writer = host.ticker.writer
    return 0 if writer is None else writer.batches


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.005)


def _follow(runner, seq: int, what: str):
    """The latency record of change `seq` once it has reached the ear."""
    _wait(lambda: any(record.change.seq == seq for record in runner.stats.latencies), 60, what)
    return next(record for record in runner.stats.latencies if record.change.seq == seq)


def _turn(host: RingHost, runners: list, knob: str, value: float, ticks: list[float]) -> list:
    """Set `knob` on every session at once and follow each change to the ear; -> their latency records (the ring's
    tick then goes to `ticks`)."""
    changes = [r.registry.set(knob, value, origin="bench") for r in runners]
    heard = [_follow(r, c.seq, f"a {knob} change to reach the ear") for r, c in zip(runners, changes)]
    ticks.append(host.ticker.tick_ms)
    time.sleep(0.05)
    return heard


def _latent_interval_ms(runner, since: float) -> float:
    """The mean time between the runner's fresh latents since `since` (perf_counter), first to last."""
    times = [t for t in runner.stats.latent_times if t >= since]
    return (times[-1] - times[0]) * 1000.0 / (len(times) - 1) if len(times) > 1 else math.inf


def _settle(host: RingHost, since: float) -> float | None:
    """Wait until the ring has run SETTLE_CYCLES cycles with no new tick plan and no capture: a new session's
    slots bring plans the ring runs plain once and captures the next time, and those ticks cost more than replays.
    -> seconds from `since` (monotonic) until then; None if it did not settle within SETTLE_TIMEOUT_S."""
    ticker = host.ticker
    last_change, last_ticks = None, ticker.ticks
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        counters = ticker.pipeline.graph_counters
        if counters is None:
            return time.monotonic() - since
        change = (counters.new_plans, counters.captures)
        if change != last_change:
            last_change, last_ticks = change, ticker.ticks
        elif ticker.ticks - last_ticks >= SETTLE_CYCLES:
            return time.monotonic() - since
        time.sleep(0.005)
    return None


def measure_sessions(
    host: RingHost,
    sessions: int,
    song_seconds: float = 60.0,
    depth: int = 4,
    cfg_mode: str = "full",
    trials: int = 8,
    lora: str | None = None,
    window_s: float = DEFAULT_WINDOW_SECONDS,
    endless: bool = False,
) -> SessionsReport:
    """Start `sessions` sessions on `host` (admission control may refuse some: the host learns its tick cost from
    the sessions before), wait for every loop to be written and the ring's tick graphs to settle, then turn each knob
    of KNOB_TRIALS on every session at once: a first touch (reported apart; the ring settles again after it, as
    the knob's new plans are captured), then `trials` times, following each change to the ear. A turn's figure is
    its slowest session's, so the first touch is held against the later turns' (their median), like for like: against
    the median of every session's later touches, the slowest of several sessions would miss even where the first
    touch costs nothing more. The latent interval
    is timed over each knob's trials: a shared knob keeps every slot's work, a per-request one restarts it.
    `lora`: a LoRA of the host that session i plays at its own strength 0.5 + 0.1 i. The sessions are ended at the
    end."""
    refused = None
    creating = time.monotonic()
    try:
        for index in range(sessions):
            knobs: dict[str, float | str] = {"depth": depth, "cfg_mode": cfg_mode}
            if lora is not None:
                knobs[f"lora/{lora}"] = round(0.5 + 0.1 * index, 2)
            try:
                spec = SessionSpec(
                    f"session {index}", seconds=song_seconds, knobs=knobs, window_seconds=window_s, endless=endless
                )
                host.create(f"s{index}", spec)
            except SessionRefused as error:
                refused = str(error)
                break
        all_started = time.monotonic()
        runners = [host.runner(name) for name in host.names()]
        _wait(lambda: all(r.stats.writes > 1 for r in runners), 600, "every session's first writes")
        settle_s = _settle(host, all_started)
        writes_before = [(r.stats.writes, r.stats.late_writes) for r in runners]
        batches_before = _write_batches(host)
        ticks = []
        summaries = []
        intervals = []
        cycles = []
        touch_settle_s = []
        phases = []
        for knob, values in KNOB_TRIALS:
            touched = time.monotonic()
            first = max(_turn(host, runners, knob, values[1], ticks), key=lambda record: record.knob_to_ear_ms)
            touch_settle_s.append(_settle(host, touched))
            started, ring_ticks = time.perf_counter(), host.ticker.ticks
            turns = [_turn(host, runners, knob, values[trial % 2], ticks) for trial in range(trials)]
            flat = [record for turn in turns for record in turn]
            slowest = statistics.median(max(r.knob_to_ear_ms for r in turn) for turn in turns)
            kind = runners[0].registry.specs[knob].kind.value
            summaries.append(summarize_latency(knob, kind, flat, first, later_touch_ear_ms=slowest))
            cycle_ms = (time.perf_counter() - started) * 1000.0 / max(1, host.ticker.ticks - ring_ticks)
            interval_ms = max(_latent_interval_ms(r, started) for r in runners)
            intervals.append(interval_ms)
            cycles.append(interval_ms / cycle_ms)
            phases.append(replace(host.ticker.phases))
        shared_interval, restarting_interval = intervals
        return SessionsReport(
            len(runners),
            refused,
            statistics.median(ticks),
            phases[0],
            shared_interval,
            restarting_interval,
            cycles[0],
            all_started - creating,
            settle_s,
            tuple(touch_settle_s),
            summaries,
            sum(r.stats.errors for r in runners),
            host.ticker.pipeline.graph_counters,
            sum(r.stats.writes - before[0] for r, before in zip(runners, writes_before)),
            sum(r.stats.late_writes - before[1] for r, before in zip(runners, writes_before)),
            _write_batches(host) - batches_before,
        )
    finally:
        for name in host.names():
            host.end(name)
