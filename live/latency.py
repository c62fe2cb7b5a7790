"""Knob-change latency (knob -> first tick that used it -> ear) and the runner's live figures, shared by the tick
thread and the writer thread."""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from ..engine.params import KnobKind
from .knobs import KnobChange


@dataclass
class LatencyRecord:
    """One knob change followed to the engine and to the ear (perf_counter seconds)."""

    change: KnobChange
    kind: KnobKind
    applied_tick: int = 0  # index of the tick whose knob pass applied it
    cycles_waited: int = 0  # ticks (on a ring: its cycles) begun after it arrived, before the one applying it
    tick_done_at: float | None = None  # end of the first tick that used the new value
    written_at: float | None = None  # when the first audio made with it was patched into the loop
    ear_at: float | None = None  # when the playhead reaches that audio

    @property
    def knob_to_tick_ms(self) -> float | None:
        return None if self.tick_done_at is None else (self.tick_done_at - self.change.received_at) * 1000.0

    @property
    def knob_to_written_ms(self) -> float | None:
        return None if self.written_at is None else (self.written_at - self.change.received_at) * 1000.0

    @property
    def knob_to_ear_ms(self) -> float | None:
        return None if self.ear_at is None else (self.ear_at - self.change.received_at) * 1000.0


class LatencyTracker:
    """Follows knob changes from their arrival to the first tick that used them and to the ear.

    A shared knob is in the very next tick and in every latent finished from that tick on; a per-request knob is in
    the first finished latent whose request was made after it (requests carry the registry's sequence number as
    their tag)."""

    def __init__(self, keep: int = 256):
        self.keep = keep
        self.done: list[LatencyRecord] = []
        self._pending: list[LatencyRecord] = []
        self._tick_starts: deque[float] = deque(maxlen=64)
        self._own_starts = True
        self._lock = threading.Lock()

    def follow_cycles(self, starts: deque[float]) -> None:
        """On a shared ring: count the ring's cycle starts (kept by its thread, the one that applies knobs), not this
        runner's own ticks, so a cycle that passed this session by counts as a cycle its knob waited."""
        self._tick_starts, self._own_starts = starts, False

    def tick_started(self, at: float) -> None:
        if self._own_starts:
            self._tick_starts.append(at)

    def track(self, change: KnobChange, kind: KnobKind, tick: int) -> None:
        waited = sum(start > change.received_at for start in self._tick_starts)
        with self._lock:
            self._pending.append(LatencyRecord(change, kind, tick, waited))

    def tick_done(self, at: float, fresh_from: int | None, tick: int | None = None) -> None:
        """Tick `tick` ended at `at`; `fresh_from` is the tag of the request it finished (None if none finished).
        Changes applied to a later tick (a ring that overlaps its ticks applies the next one's knobs before this one
        ends) wait for theirs."""
        with self._lock:
            for record in self._pending:
                if record.tick_done_at is not None or (tick is not None and record.applied_tick > tick):
                    continue
                if record.kind is KnobKind.SHARED or (fresh_from is not None and fresh_from >= record.change.seq):
                    record.tick_done_at = at

    def heard(self, written_at: float, ear_at: float, fresh_from: int, finished_tick: int) -> None:
        """Audio of a new latent (from request `fresh_from`, finished by tick `finished_tick`) was patched in at
        `written_at` and reaches the playhead at `ear_at`."""
        with self._lock:
            for record in self._pending:
                if record.ear_at is None and record.tick_done_at is not None:
                    if (record.kind is KnobKind.SHARED and finished_tick >= record.applied_tick) or (
                        record.kind is not KnobKind.SHARED and fresh_from >= record.change.seq
                    ):
                        record.written_at, record.ear_at = written_at, ear_at
            finished = [r for r in self._pending if r.ear_at is not None]
            self._pending = [r for r in self._pending if r.ear_at is None][-self.keep :]
            self.done = (self.done + finished)[-self.keep :]


@dataclass
class RunnerStats:
    ticks: int = 0
    latents: int = 0
    writes: int = 0
    late_writes: int = 0  # patches that landed after the playhead had reached their start (heard at once, cut short)
    written_seq: int = 0  # registry sequence of the newest latent written into the loop (its knob changes are in)
    audio_from_frames: int | None = None  # playhead when the loop first held the stream's audio (None: silent yet)
    tick_ms: float = 0.0
    loop_s: float = 0.0  # between tick starts (EMA)
    decode_ms: float = 0.0
    interval_s: float = 0.0  # between buffer writes
    write_s: float = 0.0  # from reading the playhead to the patch being in the buffer
    write_jitter_s: float = 0.0  # its mean absolute deviation
    lead_s: float = 0.1
    patch_s: float = 0.4
    last_error: str | None = None
    errors: int = 0
    latency: LatencyTracker = field(default_factory=LatencyTracker)
    latent_times: deque[float] = field(default_factory=lambda: deque(maxlen=256))  # perf_counter at each latent

    @property
    def latencies(self) -> list[LatencyRecord]:
        """Changes that have reached the ear, oldest first (the newest 256)."""
        return self.latency.done
