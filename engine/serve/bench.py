"""How many live sessions one host keeps in real time: N sessions on one ring (runners, writers and the host's
real-time clock, as served), each getting a fresh latent at least every `latent_interval_ms` and its knobs heard
within the target; knob -> ear measured per session, every session's knob turned at the same moment."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

from ..live.bench import LatencySummary, summarize_latency
from ..live.ring import CyclePhases
from .errors import SessionRefused
from .host import RingHost, SessionSpec

KNOB_TRIALS = (("velocity_scale", (1.3, 0.7)), ("denoise", (0.5, 0.8)))


@dataclass(frozen=True)
class SessionsReport:
    sessions: int
    refused: str | None  # admission control's reason when the last session was refused
    ring_tick_ms: float  # median over the measurement
    phases: CyclePhases  # where the ring's cycle went, at the end
    latent_interval_ms: float  # the slowest session's median time between fresh latents
    knobs: list[LatencySummary]  # over every session's trials
    errors: int

    def realtime(self, interval_ms: float, ear_ms: float) -> bool:
        shared = self.knobs[0]
        return self.refused is None and self.latent_interval_ms <= interval_ms and shared.ear_ms_p95 <= ear_ms


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


def measure_sessions(
    host: RingHost,
    sessions: int,
    song_seconds: float = 60.0,
    depth: int = 4,
    cfg_mode: str = "full",
    trials: int = 8,
    lora: str | None = None,
) -> SessionsReport:
    """Start `sessions` sessions on `host` (admission control may refuse some: the host learns its tick cost from
    the sessions before), wait for every loop to be written, then turn each knob of KNOB_TRIALS on every session at
    once, `trials` times (plus a first touch, left out), following each change to the ear; the latent interval is
    timed over the trials. `lora`: a LoRA of the host that session i plays at its own strength 0.5 + 0.1 i. The
    sessions are ended at the end."""
    refused = None
    try:
        for index in range(sessions):
            knobs: dict[str, float | str] = {"depth": depth, "cfg_mode": cfg_mode}
            if lora is not None:
                knobs[f"lora/{lora}"] = round(0.5 + 0.1 * index, 2)
            try:
                host.create(f"s{index}", SessionSpec(f"session {index}", seconds=song_seconds, knobs=knobs))
            except SessionRefused as error:
                refused = str(error)
                break
        runners = [host.runner(name) for name in host.names()]
        _wait(lambda: all(r.stats.writes > 1 for r in runners), 600, "every session's first writes")
        latents = [r.stats.latents for r in runners]
        started = time.monotonic()
        ticks = []
        summaries = []
        for knob, values in KNOB_TRIALS:
            records: list[list] = []
            for trial in range(-1, trials):
                changes = [r.registry.set(knob, values[trial % 2], origin="bench") for r in runners]
                heard = [_follow(r, c.seq, f"a {knob} change to reach the ear") for r, c in zip(runners, changes)]
                ticks.append(host.ring.tick_ms)
                records.append(heard)
                time.sleep(0.05)
            flat = [record for round_ in records[1:] for record in round_]
            first = max(records[0], key=lambda record: record.knob_to_ear_ms)
            summaries.append(summarize_latency(knob, runners[0].registry.specs[knob].kind.value, flat, first))
        elapsed_ms = (time.monotonic() - started) * 1000.0
        interval = max(elapsed_ms / max(1, r.stats.latents - n) for r, n in zip(runners, latents))
        return SessionsReport(
            len(runners),
            refused,
            statistics.median(ticks),
            replace(host.ring.phases),
            interval,
            summaries,
            sum(r.stats.errors for r in runners),
        )
    finally:
        for name in host.names():
            host.end(name)
