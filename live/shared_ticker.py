"""One ring for several live sessions: a tick thread drives every attached runner over one StreamPipeline, so all
their slots advance in one batched forward a tick; each runner keeps its own knobs, prompts, loop buffer, writer
and lane of the ring (its slots, depth, pacing and shared curves). With `batched_writes` one ring writer
(`RingWriter`) decodes every session's due windows in one batch, woken once a cycle after the hand-out.

A tick here is what `LiveRunner.tick` is for a runner alone, spread over the runners: every runner applies its
messages and knobs and submits (`begin_tick`), the ring ticks once (waited for on a GPU), and every runner gets the
latents its lane finished (`end_tick`). A runner that fails in its part counts the error and the others play on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..engine.params import REALTIME_LATENT_INTERVAL_MS
from ..engine.session import Session
from ..engine.stream import RealtimeNeed, StreamLane, StreamPipeline
from .realtime import raise_thread_priority
from .ring_writer import RingWriter

log = logging.getLogger("flowjam.ticker")

PHASE_EMA = 0.1  # weight of the newest cycle in CyclePhases


@dataclass
class CyclePhases:
    """Where a ring's cycle goes (exponential moving averages, ms): every runner's first half (messages, knobs, its
    request), the tick (waited for on a GPU), every runner's second half (latents handed out), and the rest of the
    cycle (threads waiting to change sessions, the wait for a first session)."""

    runners_ms: float = 0.0
    tick_ms: float = 0.0
    handout_ms: float = 0.0
    cycle_ms: float = 0.0
    cycles: int = 0  # cycles averaged

    def add(self, runners_ms: float, tick_ms: float, handout_ms: float, cycle_ms: float) -> None:
        """One whole cycle: its parts and its length, start to the next cycle's start (so never less than the parts)."""
        weight = 1.0 if self.cycles == 0 else PHASE_EMA  # the first cycle seeds the averages
        self.runners_ms += weight * (runners_ms - self.runners_ms)
        self.tick_ms += weight * (tick_ms - self.tick_ms)
        self.handout_ms += weight * (handout_ms - self.handout_ms)
        self.cycle_ms += weight * (cycle_ms - self.cycle_ms)
        self.cycles += 1


@dataclass
class InFlight:
    """A tick launched and handed out whose end the ring has not waited for yet: when it was launched, and per lane
    (runner, when its turn began, the tick's number, the latents it finished, the newest one's request tag)."""

    launched: float
    lanes: dict[str, tuple[object, float, int, int, int | None]]


class SharedTicker:
    def __init__(
        self,
        session: Session,
        backend: str | None = None,
        latent_interval_ms: float = REALTIME_LATENT_INTERVAL_MS,
        batched_writes: bool = False,
        overlap_ticks: bool = False,
    ):
        """`latent_interval_ms`: what admission control promises every session, a fresh latent at least that
        often (see `RealtimeNeed`). `batched_writes`: one writer thread decodes every session's due windows in one
        batch (`RingWriter`) instead of a writer thread per session. Measured on an H200 at 4 and 8 sessions it
        wrote fewer patches late at 8 but heard a shared knob later (docs/benchmarks.md, "One writer per ring"),
        so it is not the default. `overlap_ticks` (with `batched_writes`): the runners prepare the next tick and the
        hand-out runs while the GPU runs the last one (see `_overlapped_cycle`): at 8 sessions a cycle 8 % shorter,
        a shared knob heard later (docs/benchmarks.md), so not the default either."""
        if overlap_ticks and not batched_writes:
            raise ValueError("overlap_ticks needs batched_writes: the ring's writer is woken once each tick has ended")
        self.session = session
        self.latent_interval_ms = latent_interval_ms
        self.pipeline = StreamPipeline(
            session.models.acestep.decoder, depth=1, backend=backend or session.backend, paced=True
        )
        self.pipeline.cycle_costs = True  # admission learns what a whole cycle of this ring costs, not the tick alone
        self.writer = RingWriter(session) if batched_writes else None
        self.overlap_ticks = overlap_ticks
        self._in_flight: InFlight | None = None  # the tick launched and handed out, not yet waited for
        self._cycle_started: float | None = None
        self._cycle_parts: tuple[float, float, float] | None = None  # the last cycle's runners, tick and hand-out (ms)
        self._runners: dict[str, object] = {}  # lane name -> LiveRunner, in the order they came
        self._playing: set[str] = set()  # the lanes the tick thread ticks (started runners)
        self._lock = threading.Condition()  # runners and lanes change between ticks, never during one
        self._stopping = False
        self._waiting = 0  # threads waiting to change runners or lanes: the tick thread lets them in between ticks
        self._thread: threading.Thread | None = None
        self._tick_done = torch.cuda.Event() if session.device.type == "cuda" else None
        self.cycle_starts: deque[float] = deque(maxlen=64)  # perf_counter at each cycle's start, once its knobs applied
        self.ticks = 0
        self.tick_ms = 0.0
        self.phases = CyclePhases()

    # ---- sessions ------------------------------------------------------------------------------------------------

    def add_lane(self, name: str, depth: int, steps: int, cfg_mode: str) -> StreamLane:
        """A lane for a new session, refused (ValueError with the numbers) if the ring could no longer keep every
        session in real time with it."""
        need = RealtimeNeed(steps, 2 if cfg_mode == "full" else 1, self.latent_interval_ms)
        with self._between_ticks():
            return self.pipeline.add_lane(name, depth, paced=True, need=need)

    def set_depth(self, name: str, depth: int) -> None:
        """Session `name`'s depth, checked and set in one step between ticks, so the next check (another session's)
        counts it: AdmissionRefused, the depth unchanged, if the ring would then miss a session's need. The runner
        applying the same depth from its knob afterwards changes nothing."""
        with self._between_ticks():
            if name not in self.pipeline.lane_names:
                raise ValueError(f"no session {name!r} on this ring")
            self.pipeline.lane(name).set_depth(depth)

    def register(self, runner) -> None:
        """Make `runner` (a LiveRunner on one of this ring's lanes) one of the ring's: `step` ticks it from now on,
        the tick thread once it is attached."""
        with self._between_ticks():
            self._runners[runner.stream.name] = runner

    def attach(self, runner) -> None:
        """Start ticking `runner` with the others on the ring's thread (started with the first runner)."""
        with self._between_ticks():
            self._runners[runner.stream.name] = runner
            self._playing.add(runner.stream.name)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="flowjam.ticker", daemon=True)
                self._thread.start()
            self._lock.notify()

    def detach(self, runner, timeout_s: float = 10.0) -> None:
        """Stop ticking `runner` and end its lane, after the tick in progress."""
        with self._between_ticks(timeout_s):
            name = runner.stream.name
            self._runners.pop(name, None)
            self._playing.discard(name)
            if name in self.pipeline.lane_names:
                self.pipeline.remove_lane(name)

    @contextmanager
    def _between_ticks(self, timeout_s: float | None = None) -> Iterator[None]:
        """Hold the ring between two ticks (the tick thread steps aside for waiting threads)."""
        self._waiting += 1
        try:
            if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
                raise TimeoutError(f"the ring's tick did not end within {timeout_s} s")
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._lock.release()

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._runners)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.writer is not None:
            self.writer.stop(timeout_s)

    # ---- ticking -------------------------------------------------------------------------------------------------

    def step(self) -> None:
        """One tick of every attached runner and, for runners whose writer is not running, their writes (in one
        batch where the ring's writes are batched)."""
        with self._lock:
            runners = list(self._runners.values())
            if self.overlap_ticks:
                self._overlapped_cycle(runners)
                self._end_in_flight()  # stepped by hand: each step's tick ends within it
            else:
                self._tick(runners)
        if self.writer is not None:
            self.writer.write_now([runner.writer for runner in runners if not runner.writer.running])
            return
        for runner in runners:
            runner.write_pending()

    def _run(self) -> None:
        raise_thread_priority()
        while True:
            with self._lock:
                while not self._playing and not self._stopping:
                    self._end_in_flight()
                    self._cycle_started = None  # a wait for sessions is no part of a cycle's cost
                    self._lock.wait()
                if self._stopping:
                    self._end_in_flight()
                    return
                playing = [runner for name, runner in self._runners.items() if name in self._playing]
                if self.overlap_ticks:
                    self._overlapped_cycle(playing)
                else:
                    self._tick(playing)
            if self._waiting:
                time.sleep(0.0005)

    def _begin_cycle(self) -> float:
        """A cycle starts: the last one's length and parts into the phases."""
        cycle_started = time.perf_counter()
        cycle_ms = None if self._cycle_started is None else (cycle_started - self._cycle_started) * 1000.0
        if cycle_ms is not None:
            self.pipeline.record_cycle(cycle_ms)
            if self._cycle_parts is not None:
                self.phases.add(*self._cycle_parts, cycle_ms)
        self._cycle_started = cycle_started
        self._cycle_parts = None
        return cycle_started

    def _runners_turns(self, runners: list) -> dict[str, float]:
        """Every runner's first half (messages, knobs, its request) -> when each began, by lane."""
        started: dict[str, float] = {}
        for runner in runners:
            try:
                started[runner.stream.name] = runner.begin_tick()
            except Exception as error:  # one session's bad message or knob must not stop the others
                runner.count_error(error)
        return started

    def _launch(self, runners: list, wait: bool) -> dict[str, list] | None:
        """The ring's tick (`wait`: until the GPU has run it) -> the latents it finished, by lane; None if it failed
        (every runner counts the error)."""
        try:
            finished = self.pipeline.tick()
            if self._tick_done is not None:
                self._tick_done.record()
                if wait:
                    self._tick_done.synchronize()
        except Exception as error:
            for runner in runners:
                runner.count_error(error)
            time.sleep(0.01)
            return None
        by_lane: dict[str, list] = defaultdict(list)
        for result in finished:
            by_lane[result.lane].append(result)
        return by_lane

    def _overlapped_cycle(self, runners: list) -> None:
        """A cycle whose host work runs beside the GPU's tick: every runner's turn (messages, knobs, its request)
        while the last tick runs, then the wait for it (its figures), the knobs that came meanwhile, the launch of
        the next tick and at once its hand-out (the timeline's merges queue behind the tick on the device; nothing
        here reads the device) and the ring's writer woken (it waits for the tick's latents itself). The device's
        work keeps the order of `_tick`'s, so the audio is the same; a shared knob is applied up to the launch."""
        cycle_started = self._begin_cycle()
        started = self._runners_turns(runners)
        began = time.perf_counter()
        self._end_in_flight()
        waited = time.perf_counter()
        for runner in runners:
            if runner.stream.name in started:
                try:
                    runner.apply_knobs()
                except Exception as error:
                    runner.count_error(error)
        launched = time.perf_counter()
        self.cycle_starts.append(launched)
        by_lane = self._launch(runners, wait=False)
        if by_lane is None:
            return
        lanes = {}
        for runner in runners:
            name = runner.stream.name
            if name in started:
                try:
                    lane_finished = by_lane.get(name, [])
                    tick, fresh_from = runner.hand_out(lane_finished)
                    lanes[name] = (runner, started[name], tick, len(lane_finished), fresh_from)
                except Exception as error:
                    runner.count_error(error)
        self._in_flight = InFlight(launched, lanes)
        self.writer.wake()  # it waits for the tick's latents itself, then writes them at once
        ms = 1000.0
        self._cycle_parts = ((began - cycle_started) * ms, (waited - began) * ms, (time.perf_counter() - launched) * ms)

    def _end_in_flight(self) -> None:
        """Wait for the tick in flight, if any, and note its figures."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return
        if self._tick_done is not None:
            self._tick_done.synchronize()
        done = time.perf_counter()
        self.ticks += 1
        self.tick_ms = (done - in_flight.launched) * 1000.0
        for runner, started, tick, latents, fresh_from in in_flight.lanes.values():
            try:
                runner.tick_ended(started, done, latents, fresh_from, tick)
            except Exception as error:
                runner.count_error(error)

    def _tick(self, runners: list) -> None:
        cycle_started = self._begin_cycle()
        started = self._runners_turns(runners)
        self.cycle_starts.append(cycle_started)
        began = time.perf_counter()
        by_lane = self._launch(runners, wait=True)
        if by_lane is None:
            return
        done = time.perf_counter()
        self.ticks += 1
        self.tick_ms = (done - began) * 1000.0
        for runner in runners:
            name = runner.stream.name
            if name in started:
                try:
                    runner.end_tick(started[name], done, by_lane.get(name, []))
                except Exception as error:
                    runner.count_error(error)
        if self.writer is not None:  # every latent offered: one batch writes them all
            self.writer.wake()
        ms = 1000.0
        self._cycle_parts = ((began - cycle_started) * ms, self.tick_ms, (time.perf_counter() - done) * ms)
