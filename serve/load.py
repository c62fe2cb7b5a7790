"""A running `flowjam serve` measured from outside, as players reach it (`flowjam bench served`): sessions created
one at a time over HTTP, each one's audio read over its WebSocket on a thread of its own, a shared knob turned on
every session at once and followed to the ear through each session's status, and optionally one Ray Serve replica
killed while they play. Knob -> tick and knob -> ear are the host's own figures (from the change's arrival there);
calls, chunks, events and the latent interval are timed on this client's clock (time.monotonic)."""

from __future__ import annotations

import math
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from ..live.bench import p95
from .client import Client, ServerError
from .protocol import AudioChunk

KNOB = "velocity_scale"  # a shared knob: in the very next tick, heard with the next latent written
KNOB_VALUES = (1.3, 0.7)  # round by round
CALL_TIMEOUT_S = 150.0  # a create may wait for a replica to start its session (the gateway gives it 120 s)
LOCAL_REPLICA = "local"  # the replica `serve --local` names (gateway.LocalRouter): no Ray behind it
STATUS_POLL_S = 0.1  # how often a turn reads its session's status until its change is listed as heard
HEARD_TIMEOUT_S = 15.0
FIRST_SOUND_TIMEOUT_S = 300.0  # a GPU replica's first session waits for its graphs to compile
LOST_TIMEOUT_S = 30.0  # a killed replica's sessions say so within this (a few ms on an H200 host)
WATCH_AFTER_KILL_S = 10.0  # the other sessions' chunks are watched this long after a kill
RETRY_CREATE_S = 1.0  # between re-creates a full server refuses (503)
RECEIVE_S = 0.5  # a listener's longest wait for a message before it looks whether it should stop

Killer = Callable[[str], None]  # kills a replica by its id


@dataclass(frozen=True)
class LoadOptions:
    sessions: int
    prompt: str = "lofi hip hop, mellow piano"
    song_seconds: float = 60.0  # each session's loop
    window_seconds: float = 20.0
    depth: int = 4
    cfg_mode: str = "off"
    rounds: int = 6
    interval_s: float = 3.0  # between the rounds' starts
    recreate_timeout_s: float = 120.0

    def create_fields(self) -> dict[str, Any]:
        knobs = {"depth": self.depth, "cfg_mode": self.cfg_mode}
        return {"seconds": self.song_seconds, "window_seconds": self.window_seconds, "knobs": knobs}


@dataclass(frozen=True)
class Spread:
    """A figure over many measurements: how many, their median and 95th percentile (None without any)."""

    count: int
    median: float | None
    p95: float | None

    @classmethod
    def of(cls, values: list[float | None]) -> Spread:
        ordered = sorted(value for value in values if value is not None)
        return cls(len(ordered), statistics.median(ordered), p95(ordered)) if ordered else cls(0, None, None)


@dataclass(frozen=True)
class Created:
    """One create: sent `sent_s` after the run began (or after the kill, re-creating), answered `call_s` later, on
    `replica`, or refused with the server's status and message."""

    session: str
    sent_s: float
    call_s: float
    replica: str | None = None
    refused_status: int | None = None
    refused: str | None = None
    sounded_s: float | None = None  # the answer -> the session's first audible chunk

    @property
    def answered_s(self) -> float:
        return self.sent_s + self.call_s


@dataclass(frozen=True)
class Turn:
    """One session's knob change in one round: the HTTP call, and the host's figures once its status lists it."""

    session: str
    round: int
    value: float
    call_ms: float | None = None
    to_tick_ms: float | None = None
    to_ear_ms: float | None = None
    error: str | None = None  # the call's refusal, or the change not heard in time


@dataclass(frozen=True)
class Played:
    """One session over the rounds: its status's figures and what its stream received."""

    session: str
    replica: str
    latent_interval_ms: float | None  # the status's `latents` counted over the rounds, timed on this client
    write_interval_ms: float | None  # the status's `interval_ms`: the runner's mean time between buffer writes
    ring_tick_ms: float | None
    host_sessions: int | None  # sessions on its host, as its status says
    runner_errors: int | None
    chunks: int
    longest_gap_ms: float | None  # between chunks, from its first audible one until the rounds ended
    skipped: int  # chunks whose sample did not follow the chunk before
    dropped: int  # chunks the server dropped for this client (the newest chunk's count)
    events: list[dict[str, Any]]  # every event its stream brought by then, with `at_s` since the run began
    stream_failure: str | None  # what ended its stream on this client's side, if anything did


@dataclass(frozen=True)
class KillFigures:
    """One replica killed while every session plays (times since the kill, on this client's clock)."""

    replica: str
    sessions: list[str]  # the replica's, lost with it
    lost_ms: Spread  # the kill -> each one's `lost` event
    not_lost: list[str]  # no `lost` event within LOST_TIMEOUT_S
    codes_after: dict[str, int]  # each one's status call afterwards -> its HTTP status (200: it still answered)
    # every other session: the longest gap between its chunks over the WATCH_AFTER_KILL_S after the kill
    others_longest_gap_ms: dict[str, float]
    others_skipped: int
    others_dropped: int
    recreated: list[Created]  # sent_s from the kill
    refusals: int  # re-creates answered 503 (and tried again)
    first_through_s: float | None  # the kill -> the first re-create answered
    last_through_s: float | None  # the kill -> the last, once every one went through


@dataclass(frozen=True)
class LoadReport:
    server: str
    options: LoadOptions
    creates: list[Created]
    create_s: Spread  # the answered creates' calls
    placement: dict[str, int]  # replica -> sessions created on it
    first_sound_s: Spread  # each session's create answered -> its first audible chunk
    played: list[Played]
    latent_interval_ms: Spread
    turns: list[Turn]
    heard: int
    call_ms: Spread  # the knob call: client -> proxy -> gateway -> replica -> answer
    to_tick_ms: Spread  # from the change's arrival at its host
    to_ear_ms: Spread
    client_to_ear_ms: Spread  # call + to the ear, per change: an upper bound (the call's answer comes back too)
    kill: KillFigures | None = None
    ended: int = 0  # sessions ended at the end

    @property
    def errors(self) -> list[str]:
        return [f"{turn.session} round {turn.round}: {turn.error}" for turn in self.turns if turn.error]

    @property
    def ok(self) -> bool:
        return bool(self.turns) and self.heard == len(self.turns)


class Listener:
    """One session's stream read on a thread of its own: when each chunk and the first audible one arrived, chunks
    that skipped samples, the server's dropped count, and every event."""

    def __init__(self, client: Client, session: str):
        self.session = session
        self.arrivals: list[float] = []
        self.skips: list[float] = []  # arrivals of chunks that did not follow the chunk before
        self.dropped = 0
        self.first_sound_at: float | None = None
        self.events: list[tuple[float, dict[str, Any]]] = []
        self.failure: str | None = None
        self.closed_at: float | None = None
        self._next_sample: int | None = None
        self._stop = threading.Event()
        self.stream = client.stream(session)
        self._thread = threading.Thread(target=self._read, name=f"load-{session}", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    item = self.stream.receive(RECEIVE_S)
                except TimeoutError:
                    continue
                if item is None:
                    break
                self._take(item, time.monotonic())
        except Exception as error:  # reported with the figures, not lost on this thread
            self.failure = repr(error)
        self.closed_at = time.monotonic()

    def _take(self, item: AudioChunk | dict[str, Any], at: float) -> None:
        if isinstance(item, dict):
            self.events.append((at, item))
            return
        if self._next_sample is not None and item.sample != self._next_sample:
            self.skips.append(at)
        self._next_sample = item.sample + item.frames
        self.dropped = item.dropped
        if self.first_sound_at is None and item.audio.any():
            self.first_sound_at = at
        self.arrivals.append(at)

    def event_at(self, name: str) -> float | None:
        return next((at for at, event in self.events if event.get("event") == name), None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(4 * RECEIVE_S)
        self.stream.close()


def heard_record(heard: list[dict[str, Any]], knob: str, value: float, after_seq: int) -> dict[str, Any] | None:
    """The change of `knob` to `value` newer than `after_seq` among a status's `heard` records, if it is there."""
    return next(
        (
            record
            for record in heard
            if record["knob"] == knob and record["seq"] > after_seq and math.isclose(record["value"], value)
        ),
        None,
    )


def latent_interval_ms(before: tuple[float, int], after: tuple[float, int]) -> float | None:
    """The mean time between fresh latents from two (time s, latents so far) samples; None if none came."""
    latents = after[1] - before[1]
    return (after[0] - before[0]) * 1000.0 / latents if latents > 0 else None


def longest_gap_ms(arrivals: list[float], start: float, end: float) -> float:
    """The longest time without a chunk from `start` to `end`: between two arrivals, or at either edge."""
    edges = [start, *(at for at in arrivals if start < at < end), end]
    return max(later - earlier for earlier, later in zip(edges, edges[1:])) * 1000.0


def measure_load(
    client: Client, options: LoadOptions, kill: Killer | None = None, say: Callable[[str], None] = print
) -> LoadReport:
    """Run the load on `client`'s server (see the module docstring); `kill`: a replica's end, for the kill phase.
    Every session is ended at the end, also after an error or Ctrl-C. `say` hears the progress."""
    run = LoadRun(client, options, say)
    try:
        report = run.measure(kill)
    finally:
        ended = run.end_all()
    return replace(report, ended=ended)


class LoadRun:
    """One run's state: the sessions playing (-> their replica), their listeners and the newest knob change of each
    that was followed, and the clock's origin."""

    def __init__(self, client: Client, options: LoadOptions, say: Callable[[str], None]):
        self.client, self.options, self.say = client, options, say
        self.started = time.monotonic()
        self.prefix = f"load-{secrets.token_hex(3)}"
        self.replicas: dict[str, str] = {}
        self.listeners: dict[str, Listener] = {}
        self.retired: list[Listener] = []  # the streams of sessions lost with their replica
        self.seqs: dict[str, int] = {}
        self.stopping = threading.Event()
        self._barrier: threading.Barrier | None = None
        self._pool = ThreadPoolExecutor(max_workers=options.sessions, thread_name_prefix="load-turn")

    def measure(self, kill: Killer | None) -> LoadReport:
        creates = []
        for index in range(self.options.sessions):
            created = self.create(f"{self.prefix}-{index}", self.started)
            creates.append(created)
            where = f"on replica {created.replica}" if created.replica else f"refused: {created.refused}"
            self.say(f"  create {index + 1}/{self.options.sessions}: {created.call_s:.2f} s, {where}")
            if kill is not None and created.replica == LOCAL_REPLICA:
                raise ValueError(
                    f"{self.client.server} is `flowjam serve --local` (one host, no replica to kill); --kill-replica "
                    "needs the server on Ray Serve: `flowjam serve --replicas N`"
                )
        placement = dict(Counter(self.replicas.values()))
        self.wait_sound(list(self.replicas), FIRST_SOUND_TIMEOUT_S)
        creates = [self.sounded(created, self.started) for created in creates]
        before = self.snapshot()
        rounds = range(self.options.rounds) if self.replicas else ()
        turns = [turn for index in rounds for turn in self.round(index)]
        after = self.snapshot()
        until = time.monotonic()
        played = [self.played(name, before[name], after[name], until) for name in self.replicas]
        killed = None if kill is None or not self.replicas else self.kill(kill)
        heard = [turn for turn in turns if turn.to_ear_ms is not None]
        return LoadReport(
            self.client.server,
            self.options,
            creates,
            Spread.of([created.call_s for created in creates if created.replica]),
            placement,
            Spread.of([created.sounded_s for created in creates if created.replica]),
            played,
            Spread.of([figures.latent_interval_ms for figures in played]),
            turns,
            len(heard),
            Spread.of([turn.call_ms for turn in turns]),
            Spread.of([turn.to_tick_ms for turn in heard]),
            Spread.of([turn.to_ear_ms for turn in heard]),
            Spread.of([turn.call_ms + turn.to_ear_ms for turn in heard]),
            killed,
        )

    # ---- sessions ------------------------------------------------------------------------------------------------

    def create(self, name: str, origin: float) -> Created:
        """Create `name` and open its stream -> the create's figures, times since `origin`."""
        sent = time.monotonic()
        try:
            answer = self.client.create(self.options.prompt, name=name, **self.options.create_fields())
        except ServerError as error:
            if error.status in (401, 403):
                raise ValueError(f"{error}; give the server's key: --key-file FILE or FLOWJAM_SERVE_KEY") from None
            return Created(name, sent - origin, time.monotonic() - sent, None, error.status, error.message)
        created = Created(name, sent - origin, time.monotonic() - sent, answer["replica"])
        self.replicas[name] = answer["replica"]
        self.seqs[name] = answer["status"]["knob_seq"]
        self.listeners[name] = Listener(self.client, name)
        return created

    def wait_sound(self, names: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = [self.listeners[name] for name in names]
        while any(listener.first_sound_at is None and listener.closed_at is None for listener in waiting):
            if time.monotonic() > deadline or self.stopping.wait(0.05):
                return

    def sounded(self, created: Created, origin: float) -> Created:
        listener = self.listeners.get(created.session)
        if created.replica is None or listener is None or listener.first_sound_at is None:
            return created
        return replace(created, sounded_s=listener.first_sound_at - origin - created.answered_s)

    def snapshot(self) -> dict[str, tuple[float, dict[str, Any] | None]]:
        """Every playing session's status (None if refused), with when it was answered."""

        def status(name: str) -> tuple[float, dict[str, Any] | None]:
            try:
                answer = self.client.status(name)
            except ServerError:
                answer = None
            return time.monotonic(), answer

        return dict(zip(self.replicas, self._pool.map(status, self.replicas)))

    def played(self, name: str, before: tuple, after: tuple, until: float) -> Played:
        listener = self.listeners[name]
        (before_at, first), (after_at, last) = before, after
        interval = None
        if first is not None and last is not None:
            interval = latent_interval_ms((before_at, first["latents"]), (after_at, last["latents"]))
        last = last or {}
        start = listener.first_sound_at
        return Played(
            name,
            self.replicas[name],
            interval,
            last.get("interval_ms"),
            last.get("ring_tick_ms"),
            last.get("sessions"),
            last.get("errors"),
            len(listener.arrivals),
            None if start is None else longest_gap_ms(listener.arrivals, start, until),
            len(listener.skips),
            listener.dropped,
            [{"at_s": round(at - self.started, 3), **event} for at, event in listener.events],
            listener.failure,
        )

    def end_all(self) -> int:
        """End every session playing and close every stream -> how many were ended."""
        self.stopping.set()
        if self._barrier is not None:
            self._barrier.abort()
        ended = 0
        for name in list(self.replicas):
            try:
                self.client.end(name)
                ended += 1
            except (ServerError, OSError) as error:  # lost with its replica (410), or the server is gone
                self.say(f"  ending {name}: {error}")
        for listener in [*self.listeners.values(), *self.retired]:
            listener.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        return ended

    # ---- the shared knob -----------------------------------------------------------------------------------------

    def round(self, index: int) -> list[Turn]:
        """Turn KNOB on every session at once (one thread each), each followed until its status lists it heard."""
        start = time.monotonic()
        names = list(self.replicas)
        value = KNOB_VALUES[index % len(KNOB_VALUES)]
        barrier = self._barrier = threading.Barrier(len(names))
        turns = list(self._pool.map(lambda name: self.turn(name, index + 1, value, barrier), names))
        heard = sum(turn.to_ear_ms is not None for turn in turns)
        self.say(f"  round {index + 1}/{self.options.rounds}: {KNOB} {value:g}, {heard} of {len(turns)} heard")
        if index + 1 < self.options.rounds:
            self.stopping.wait(max(0.0, start + self.options.interval_s - time.monotonic()))
        return turns

    def turn(self, name: str, round_number: int, value: float, barrier: threading.Barrier) -> Turn:
        turn = Turn(name, round_number, value)
        try:
            barrier.wait(HEARD_TIMEOUT_S)
        except threading.BrokenBarrierError:
            return replace(turn, error="the round was stopped")
        sent = time.monotonic()
        try:
            self.client.set_knobs(name, {KNOB: value})
        except (ServerError, OSError) as error:
            return replace(turn, error=str(error))
        turn = replace(turn, call_ms=(time.monotonic() - sent) * 1000.0)
        while time.monotonic() - sent < HEARD_TIMEOUT_S and not self.stopping.wait(STATUS_POLL_S):
            try:
                heard = self.client.status(name)["heard"]
            except (ServerError, OSError) as error:
                return replace(turn, error=f"status: {error}")
            record = heard_record(heard, KNOB, value, self.seqs[name])
            if record is not None:
                self.seqs[name] = record["seq"]
                return replace(turn, to_tick_ms=record["to_tick_ms"], to_ear_ms=record["to_ear_ms"])
        return replace(turn, error=f"not heard within {HEARD_TIMEOUT_S:g} s")

    # ---- a replica killed ----------------------------------------------------------------------------------------

    def kill(self, kill: Killer) -> KillFigures:
        """Kill the replica holding the most sessions; time its sessions' `lost` events, create them again at once
        (as their players would) until the server takes them (or recreate_timeout_s), and watch the other sessions'
        chunks meanwhile."""
        victim = Counter(self.replicas.values()).most_common(1)[0][0]
        lost = [name for name, replica in self.replicas.items() if replica == victim]
        kept = [name for name in self.replicas if name not in lost]
        kept_dropped = {name: self.listeners[name].dropped for name in kept}
        self.say(f"  killing replica {victim} ({len(lost)} sessions on it)")
        killed_at = time.monotonic()
        kill(victim)
        lost_at = {name: self._lost_at(name, killed_at + LOST_TIMEOUT_S) for name in lost}
        codes = {name: self._code_after(name, killed_at + LOST_TIMEOUT_S) for name in lost}
        for name in lost:
            del self.replicas[name]
            self.retired.append(self.listeners.pop(name))
        recreated, refusals = self.recreate(lost, killed_at)
        watched_until = killed_at + WATCH_AFTER_KILL_S
        self.stopping.wait(max(0.0, watched_until - time.monotonic()))
        gaps = {name: longest_gap_ms(self.listeners[name].arrivals, killed_at, watched_until) for name in kept}
        skipped = sum(killed_at < at < watched_until for name in kept for at in self.listeners[name].skips)
        dropped = sum(self.listeners[name].dropped - kept_dropped[name] for name in kept)
        through = [created.answered_s for created in recreated if created.replica]
        return KillFigures(
            victim,
            lost,
            Spread.of([None if at is None else (at - killed_at) * 1000.0 for at in lost_at.values()]),
            [name for name, at in lost_at.items() if at is None],
            codes,
            gaps,
            skipped,
            dropped,
            recreated,
            refusals,
            min(through, default=None),
            max(through) if through and len(through) == len(lost) else None,
        )

    def _lost_at(self, name: str, deadline: float) -> float | None:
        listener = self.listeners[name]
        while listener.event_at("lost") is None and listener.closed_at is None and time.monotonic() < deadline:
            self.stopping.wait(0.005)
        return listener.event_at("lost")

    def _code_after(self, name: str, deadline: float) -> int:
        """The HTTP status the session's status call gets once the server has noticed (200 if it never did)."""
        while True:
            try:
                self.client.status(name)
            except ServerError as error:
                return error.status
            if time.monotonic() > deadline or self.stopping.wait(STATUS_POLL_S):
                return 200

    def recreate(self, names: list[str], killed_at: float) -> tuple[list[Created], int]:
        """Create `names` again, one at a time, each tried again while the server answers 503 -> their creates
        (times since the kill, each once it sounded) and how many 503s there were."""
        deadline = time.monotonic() + self.options.recreate_timeout_s
        recreated, refusals = [], 0
        for name in names:
            created = self.create(name, killed_at)
            while created.refused_status == 503 and time.monotonic() < deadline and not self.stopping.is_set():
                refusals += 1
                self.stopping.wait(RETRY_CREATE_S)
                created = self.create(name, killed_at)
            outcome = f"on replica {created.replica}" if created.replica else f"refused: {created.refused}"
            self.say(f"  re-create {name}: {created.answered_s:.1f} s after the kill, {outcome}")
            recreated.append(created)
        self.wait_sound([created.session for created in recreated if created.replica], FIRST_SOUND_TIMEOUT_S)
        return [self.sounded(created, killed_at) for created in recreated], refusals


def ray_killer(address: str) -> Killer:
    """A Killer of the server's RingReplica actors, ended as `ray.kill` ends one (not restarted by Ray: Serve's
    controller starts a new replica once its health check finds this one dead). ValueError naming the fix when Ray
    Serve is not importable here or no Ray cluster answers at `address`."""
    try:
        import ray

        from .deployment import SERVE_NAMESPACE, replica_actor_name
    except ImportError as error:
        raise ValueError(
            f"--kill-replica needs Ray Serve here ({error}): pip install -e '.[serve]' and run this on a node of the "
            "server's Ray cluster"
        ) from None
    try:
        ray.init(address=address, logging_level="error", log_to_driver=False, configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ValueError(
            f"--kill-replica joins the server's Ray cluster and none answered at --address {address} ({error}); run "
            "this on a node of that cluster, or give its address"
        ) from None

    def kill(replica: str) -> None:
        try:
            actor = ray.get_actor(replica_actor_name(replica), namespace=SERVE_NAMESPACE)
        except ValueError:
            raise ValueError(
                f"replica {replica} has no actor in the Ray cluster at --address {address}; give the address of the "
                "cluster the server runs on"
            ) from None
        ray.kill(actor, no_restart=True)

    return kill
