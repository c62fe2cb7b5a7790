"""The ring's writer: one thread that writes every session of a shared ring ahead of its playhead
(`SharedTicker(batched_writes=True)`; by default each session's writer has a thread of its own).

Woken once a ring cycle, after the whole hand-out, it takes every session whose write is due (a latent just offered,
or a gap-fill due within `GATHER_S`), reads their playheads and decodes all their windows in one batched decode, on a
high-priority CUDA stream of its own, while the ring's thread prepares the next tick. Built because eight writer
threads cost a ring ~14 ms of host time a cycle; measured on an H200 it takes the hand-out's share of that away but
adds as much to the runners' turns, writes fewer patches late at 8 sessions and hears a shared knob later, since a
session's write waits for the whole batch (docs/benchmarks.md, "One writer per ring").
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict

import torch

from ..engine.audio.window_decode import batch_rows
from ..engine.params import LATENT_RATE_HZ
from ..engine.session import DECODE_MARGIN_FRAMES, Session
from ..engine.stream import MAX_LANES
from .writer import MIN_GAP_S, WARM_WINDOWS_S, AheadWriter, WritePlan, decode_stream, writing_thread

GATHER_S = 0.05  # a gap-fill due this soon is written with the batch being written now
IDLE_WAIT_S = 0.05  # the longest sleep while sessions are attached (a first latent's gap-fill timing)


class RingWriter:
    def __init__(self, session: Session):
        self.session = session
        self.decoder = session.window_decoder()
        self._cuda_stream = decode_stream(session.device)
        self._writers: list[AheadWriter] = []
        self._writing: list[AheadWriter] = []  # the batch being written now
        self._lock = threading.Condition()
        self._woken = False
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._warm_rows = 0  # batches of up to this many windows are captured at every window length
        self.batches = 0
        self.windows = 0  # windows decoded in those batches

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def writes_for(self, writer: AheadWriter) -> bool:
        """This writer's session is written by the ring's thread now."""
        with self._lock:
            return self.alive and writer in self._writers

    def add(self, writer: AheadWriter) -> None:
        """Write this session from now on (the thread starts with the first)."""
        with self._lock:
            if writer not in self._writers:
                self._writers.append(writer)
            if self._thread is None and not self._stopping:
                self._thread = threading.Thread(target=self._run, name="flowjam.ring-writer", daemon=True)
                self._thread.start()
            self._lock.notify()

    def remove(self, writer: AheadWriter, timeout_s: float) -> None:
        """Stop writing this session; a batch writing it ends first (up to `timeout_s`)."""
        with self._lock:
            if writer in self._writers:
                self._writers.remove(writer)
            self._lock.wait_for(lambda: writer not in self._writing, timeout_s)

    def wake(self, stop: bool = False) -> None:
        """The hand-out is over: write what it offered (`stop`: and end the thread)."""
        with self._lock:
            self._woken = True
            self._stopping = self._stopping or stop
            self._lock.notify()

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the thread after the batch in progress."""
        self.wake(stop=True)
        if self._thread is not None:
            self._thread.join(timeout_s)

    def write_now(self, writers: list[AheadWriter]) -> None:
        """Write these sessions' offered latents (or gap-fills) in one batch on the calling thread (a ring stepped
        by hand)."""
        self._write(writers, len(writers))

    def _sleep_s(self) -> float | None:
        """Until the earliest gap-fill is due (None: no session to write)."""
        if not self._writers:
            return None
        due = min(writer.due_at() for writer in self._writers)
        return max(MIN_GAP_S, min(IDLE_WAIT_S, due - time.perf_counter())) if math.isfinite(due) else IDLE_WAIT_S

    def _run(self) -> None:
        with writing_thread(self._cuda_stream):
            while True:
                with self._lock:
                    self._lock.wait_for(lambda: self._woken or self._stopping, self._sleep_s())
                    if self._stopping:
                        return
                    self._woken = False
                    horizon = time.perf_counter() + GATHER_S
                    self._writing = [writer for writer in self._writers if writer.due_at() <= horizon]
                    sessions = len(self._writers)
                try:
                    self._write(self._writing, sessions)
                finally:
                    with self._lock:
                        self._writing = []
                        self._lock.notify_all()

    def _write(self, due: list[AheadWriter], sessions: int) -> None:
        """Plan every due session's write (its playhead read now), decode the windows of one length in one batch,
        and patch each into its session's buffer."""
        taken = []
        for writer in due:
            try:
                latent, fresh = writer.take()
            except Exception as error:  # one session's failure must not stop the others' writes
                writer.fail(error)
                continue
            if latent is not None:
                taken.append((writer, latent, fresh))
        if not taken:
            return
        self._warm(taken[0][1], sessions)  # before any playhead is read: a capture is no write time
        planned: list[tuple[AheadWriter, WritePlan]] = []
        for writer, latent, fresh in taken:
            try:
                planned.append((writer, writer.plan(latent, fresh)))
            except Exception as error:
                writer.fail(error)
        if not planned:
            return
        window_s = max(writer.stats.patch_s for writer, _ in planned)
        keep = math.ceil(window_s * LATENT_RATE_HZ)
        by_length: dict[int, list[tuple[AheadWriter, WritePlan]]] = defaultdict(list)
        for writer, plan in planned:  # a loop shorter than the window is decoded whole, apart from the others
            by_length[min(keep, plan.latent.shape[1])].append((writer, plan))
        for group in by_length.values():
            self._decode_group(group, window_s)

    def _decode_group(self, group: list[tuple[AheadWriter, WritePlan]], window_s: float) -> None:
        plans = [plan for _, plan in group]
        try:
            audio = self.decoder.decode_many(
                [plan.latent for plan in plans], [plan.window_start_s for plan in plans], window_s, DECODE_MARGIN_FRAMES
            ).cpu()  # on a GPU this waits for the decode only (this thread's stream)
        except Exception as error:
            for writer, _ in group:
                writer.fail(error)
            time.sleep(MIN_GAP_S)
            return
        warm_up = self.decoder.last_was_warm_up
        self.batches += 1
        self.windows += len(group)
        for (writer, plan), window in zip(group, audio):
            try:
                writer.land(plan, window, warm_up)
            except Exception as error:
                writer.fail(error)

    def _warm(self, latent: torch.Tensor, sessions: int) -> None:
        """Capture every window length at every batch size up to the ring's sessions' before the batches need them
        (a shape decoded for the first time mid-play costs a write 100-200 ms)."""
        if not self.decoder.captures:
            return
        rows = batch_rows(min(max(sessions, 1), MAX_LANES))
        if rows <= self._warm_rows:
            return
        counts = tuple(count for count in (1 << k for k in range(rows.bit_length())) if self._warm_rows < count <= rows)
        self.decoder.warm_up(latent, WARM_WINDOWS_S, DECODE_MARGIN_FRAMES, counts)
        self._warm_rows = rows
