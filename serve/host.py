"""A host of live sessions for remote players: every session a LiveRunner on one SharedTicker (one model, one device,
one batched forward a tick), its own knob registry, prompts and loop buffer; a clock thread plays every loop in real
time and hands each block, encoded, to the session's subscribers.

A subscriber that reads too slowly loses its oldest chunks (counted), never the ring's time: the clock and the
ring never wait for a client."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..engine.params import (
    DEFAULT_PRECISION,
    DEFAULT_WINDOW_SECONDS,
    LATENT_RATE_HZ,
    REALTIME_LATENT_INTERVAL_MS,
    song_frames,
)
from ..engine.prompts import time_signature_numerator
from ..engine.session import Session
from ..engine.stream import MAX_LANES, AdmissionRefused
from ..engine.stream.windows import check_window_seconds, ring_frames, window_frames
from ..live.app import add_lora_knobs
from ..live.knobs import KnobRegistry
from ..live.latency import LatencyRecord
from ..live.loop_buffer import LoopBuffer
from ..live.loop_map import LoopMap
from ..live.renderer import BlockRenderer
from ..live.runner import PROMPT_SLOTS, LiveRunner, RunnerConfig
from ..live.shared_ticker import SharedTicker
from ..live.sync.grid import Grid
from . import refusals
from .admission import Admission
from .errors import SessionRefused, UnknownSession
from .protocol import encode_chunk

log = logging.getLogger("flowjam.serve")

BLOCK_FRAMES = 2400  # 50 ms at 48 kHz: the clock's period and the size of an audio chunk
SUBSCRIBER_CHUNKS = 40  # 2 s of audio waiting for a slow client before its oldest chunks go
HEARD_SHOWN = 16  # knob changes followed to the ear that a session's status lists (the newest)


@dataclass(frozen=True)
class SessionSpec:
    prompt: str
    prompt_b: str | None = None
    negative: str | None = None
    seconds: float = 30.0  # loop length
    window_seconds: float | None = None  # generated per request at the playhead (0: the whole loop); None: the host's
    endless: bool = False  # no loop: the song goes on, a window ahead of the playhead
    knobs: dict[str, float | str] = field(default_factory=dict)  # initial values, validated as set_knobs does
    bpm: float | None = None  # a musical grid: the tempo in the prompts' metas, and a loop of whole bars of it
    time_signature: int | str | None = None  # beats per bar (2, 3, 4, 6; "4/4" style too); default 4
    bars: int | None = None  # the loop is exactly this many bars (needs bpm; default: `seconds` in whole bars)

    def grid(self) -> Grid | None:
        """The session's grid, None without a tempo; ValueError naming the field."""
        if self.bpm is None:
            if self.bars is not None or self.time_signature is not None:
                raise ValueError("bars and time_signature need a tempo: give bpm (30..300)")
            return None
        if self.bars is not None and (not isinstance(self.bars, int) or isinstance(self.bars, bool) or self.bars < 1):
            raise ValueError(f"bars must be a whole number of at least 1, got {self.bars!r}")
        if self.bars is not None and self.endless:
            raise ValueError("bars sets a loop's length: an endless session has none; leave bars out")
        beats = 4 if self.time_signature is None else time_signature_numerator(self.time_signature)
        return Grid(self.bpm, beats)


@dataclass(frozen=True)
class HostOptions:
    """How a process or a replica builds its host: the model from local files (or a seeded preset) on one device."""

    preset: str = "tiny"
    checkpoint: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    backend: str | None = None
    precision: str = DEFAULT_PRECISION
    latent_interval_ms: float = REALTIME_LATENT_INTERVAL_MS
    loras: tuple[tuple[str, float], ...] = ()  # (file, strength a new session starts at), attached live
    window_seconds: float = DEFAULT_WINDOW_SECONDS  # a session's window unless its create gives one (--window-seconds)

    def build(self) -> RingHost:
        """The host; ValueError or FileNotFoundError naming the LoRA file that does not load."""
        session = Session.load(
            self.checkpoint,
            preset=self.preset,
            device=self.device,
            dtype=getattr(torch, self.dtype),
            precision=self.precision,
        )
        if self.backend is not None:
            session.backend = self.backend
        for path, strength in self.loras:  # live: every session of the ring plays each at its own strength
            try:
                session.load_lora(path, strength, mode="live")
            except (ValueError, FileNotFoundError) as error:
                raise type(error)(f"LoRA {path}: {error}") from None
        return RingHost(session, latent_interval_ms=self.latent_interval_ms, window_seconds=self.window_seconds)


class AudioSubscription:
    """A bounded queue of encoded chunks for one client; full, the oldest chunk goes and is counted."""

    def __init__(self, max_chunks: int):
        if max_chunks < 1:
            raise ValueError(f"a subscription holds at least one chunk, got max_chunks={max_chunks}")
        self._chunks: deque[bytes] = deque()
        self._max = max_chunks
        self._ready = threading.Condition()
        self.dropped = 0
        self.ended: str | None = None

    def put(self, audio: np.ndarray, sample: int, position: int) -> None:
        with self._ready:
            if len(self._chunks) >= self._max:
                self._chunks.popleft()
                self.dropped += 1
            self._chunks.append(encode_chunk(audio, sample, position, self.dropped))
            self._ready.notify()

    def get(self, timeout_s: float) -> bytes | None:
        """The oldest waiting chunk, or None after `timeout_s` with none; once the session has ended and every
        chunk is read, UnknownSession with the reason."""
        with self._ready:
            if not self._chunks and self.ended is None:
                self._ready.wait(timeout_s)
            if self._chunks:
                return self._chunks.popleft()
            if self.ended is not None:
                raise UnknownSession(self.ended)
            return None

    def finish(self, reason: str) -> None:
        with self._ready:
            self.ended = reason
            self._ready.notify_all()

    def close(self) -> None:
        self.finish("the subscription was closed")


@dataclass(eq=False)
class HostedSession:
    name: str
    registry: KnobRegistry
    buffer: LoopBuffer
    runner: LiveRunner
    renderer: BlockRenderer
    subscriptions: list[AudioSubscription] = field(default_factory=list)


class RingHost:
    def __init__(
        self,
        session: Session,
        latent_interval_ms: float = REALTIME_LATENT_INTERVAL_MS,
        block_frames: int = BLOCK_FRAMES,
        window_seconds: float = DEFAULT_WINDOW_SECONDS,
        batched_writes: bool = False,
        overlap_ticks: bool = False,
    ):
        """`window_seconds`: a session's window when its create gives none; `batched_writes`, `overlap_ticks`: see
        `SharedTicker`."""
        self.session = session
        self.window_seconds = check_window_seconds(window_seconds)
        self.ticker = SharedTicker(
            session,
            latent_interval_ms=latent_interval_ms,
            batched_writes=batched_writes,
            overlap_ticks=overlap_ticks,
        )
        self.block_frames = block_frames
        self._sessions: dict[str, HostedSession] = {}
        self._starting: set[str] = set()  # names being created (outside the lock)
        self._lock = threading.Lock()
        self._depth_lock = threading.Lock()  # a depth set on the ring and in the session's knobs, one at a time
        self.admission = Admission(latent_interval_ms)
        self._closing = threading.Event()
        self.late_blocks = 0  # clock wake-ups more than a block late (the lost time is not made up, as on a device)
        self._clock = threading.Thread(target=self._play, name="flowjam-host-clock", daemon=True)
        self._clock.start()

    # ---- sessions ------------------------------------------------------------------------------------------------

    def create(self, name: str, spec: SessionSpec) -> dict[str, Any]:
        """Start a session on the ring; SessionRefused when the ring is full or could not keep every session in
        real time with it, ValueError for a bad spec."""
        if not isinstance(spec.prompt, str) or not spec.prompt.strip():
            raise ValueError("a session needs a prompt: a non-empty text such as 'lofi hip hop, mellow piano'")
        if spec.window_seconds is None:
            spec = replace(spec, window_seconds=self.window_seconds)
        grid = spec.grid()
        samples, request_frames = _session_frames(
            spec, grid, self.session.models.vae.hop_samples, self.session.sample_rate
        )
        registry = KnobRegistry()
        add_lora_knobs(registry, self.session)  # a lora/<name> knob per LoRA of the host, this session's own
        for knob, value in spec.knobs.items():
            registry.set(knob, value, origin="create")
        with self._lock:
            if self._closing.is_set():
                raise SessionRefused(refusals.shutting_down())
            if name in self._sessions or name in self._starting:
                raise ValueError(refusals.name_taken())
            if len(self._sessions) + len(self._starting) >= MAX_LANES:
                raise SessionRefused(refusals.host_full(MAX_LANES))
            playing = {hosted.runner.request_frames for hosted in self._sessions.values()}
            if playing and request_frames not in playing:
                raise ValueError(refusals.one_request_length(playing.pop() / LATENT_RATE_HZ))
            self._starting.add(name)
        try:
            with self.admission.turn:  # creates take turns: each is measured against the ring with the last one in
                self.admission.check(self._latent_times)
                hosted = self._start(name, spec, grid, samples, registry)
                hosted.runner.start()
                self.admission.changed()
        finally:
            with self._lock:
                self._starting.discard(name)
        log.info("session %s started (%d playing)", name, len(self._sessions))
        return self.status(name)

    def _start(self, name: str, spec: SessionSpec, grid: Grid | None, samples: int, registry: KnobRegistry):
        """The session's buffer and runner on a lane of the ring (admission control's prediction may refuse it),
        built outside the lock: the clock keeps playing the other sessions meanwhile."""
        buffer = LoopBuffer(samples, 2, self.session.sample_rate)
        try:
            metas = {} if grid is None else {"bpm": round(grid.bpm), "time_signature": grid.beats_per_bar}
            runner = LiveRunner(
                self.session,
                registry,
                buffer,
                spec.prompt,
                spec.prompt_b,
                config=RunnerConfig(window_s=spec.window_seconds, endless=spec.endless, **metas),
                negative=spec.negative,
                ticker=self.ticker,
                name=name,
            )
        except AdmissionRefused as error:
            buffer.unlink()
            raise SessionRefused(refusals.admission(error, name)) from None
        except BaseException:
            buffer.unlink()
            raise
        hosted = HostedSession(name, registry, buffer, runner, BlockRenderer(buffer, self.block_frames, None))
        with self._lock:
            self._sessions[name] = hosted
        return hosted

    def _latent_times(self) -> list[list[float]]:
        """Every playing session's latent times (perf_counter), for admission."""
        with self._lock:
            playing = list(self._sessions.values())
        return [list(hosted.runner.stats.latent_times) for hosted in playing]

    def end(self, name: str) -> None:
        with self._lock:
            hosted = self._sessions.pop(name, None)
        if hosted is None:
            raise UnknownSession(refusals.unknown_session(name))
        for subscription in hosted.subscriptions:
            subscription.finish(f"session {name!r} was ended")
        hosted.runner.stop()
        hosted.buffer.unlink()
        self.admission.changed()
        log.info("session %s ended", name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._sessions)

    def runner(self, name: str) -> LiveRunner:
        """The session's runner (its knob registry, figures and latest latent), for benchmarks and tests."""
        return self._get(name).runner

    def close(self) -> None:
        """End every session and stop the clock and the ring."""
        self._closing.set()
        for name in self.names():
            try:
                self.end(name)
            except UnknownSession:
                pass
        self._clock.join(5.0)
        self.ticker.stop()

    # ---- control ---------------------------------------------------------------------------------------------

    def set_knobs(self, name: str, knobs: dict[str, float | str]) -> dict[str, float]:
        """Set several knobs at once: all are checked first (a bad one sets none), then applied; -> their values."""
        hosted = self._get(name)
        if not isinstance(knobs, dict) or not knobs:
            raise ValueError('knobs must be a non-empty object of knob names to values, e.g. {"denoise": 0.6}')
        trial = KnobRegistry(hosted.registry.specs.values())
        for knob, value in knobs.items():
            trial.set(knob, value, origin="check")
        with self._depth_lock:
            if "depth" in knobs:  # set on the ring first: admission control has its say (ValueError, 400)
                depth = int(trial.get("depth"))
                try:
                    self.ticker.set_depth(name, depth)
                except AdmissionRefused as error:
                    raise ValueError(refusals.admission(error, name, depth)) from None
                except ValueError:  # its lane ended meanwhile
                    raise UnknownSession(refusals.unknown_session(name)) from None
            for knob, value in knobs.items():
                hosted.registry.set(knob, value, origin="remote")
        return {knob: _knob_value(hosted.registry, knob) for knob in knobs}

    def set_prompt(self, name: str, slot: str, text: str) -> None:
        hosted = self._get(name)
        if slot not in PROMPT_SLOTS:
            raise ValueError(f"prompt slot must be one of {', '.join(PROMPT_SLOTS)}, got {slot!r}")
        if not isinstance(text, str) or (slot != "negative" and not text.strip()):
            raise ValueError(f"prompt {slot!r} needs a non-empty text (only the negative may be empty)")
        hosted.runner.set_prompt(slot, text)

    def status(self, name: str) -> dict[str, Any]:
        hosted = self._get(name)
        status = hosted.runner.status()
        status.update(
            session=name,
            sample=hosted.buffer.played_frames,
            loop_s=round(hosted.buffer.frames / hosted.buffer.sample_rate, 3),
            knobs={knob: _knob_value(hosted.registry, knob) for knob in hosted.registry.specs},
            knob_seq=hosted.registry.seq,
            written_seq=hosted.runner.stats.written_seq,
            dropped=sum(s.dropped for s in hosted.subscriptions),
            sessions=len(self._sessions),
            ring_tick_ms=round(self.ticker.tick_ms, 2),
            heard=[_heard(record) for record in hosted.runner.stats.latencies[-HEARD_SHOWN:]],
        )
        return status

    def subscribe(self, name: str, max_chunks: int = SUBSCRIBER_CHUNKS) -> AudioSubscription:
        """The session's audio from the next block on, as encoded chunks (see protocol.py)."""
        hosted = self._get(name)
        subscription = AudioSubscription(max_chunks)
        with self._lock:
            hosted.subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, name: str, subscription: AudioSubscription) -> None:
        subscription.close()
        with self._lock:
            hosted = self._sessions.get(name)
            if hosted is not None and subscription in hosted.subscriptions:
                hosted.subscriptions.remove(subscription)

    # ---- the clock -------------------------------------------------------------------------------------------

    def _play(self) -> None:
        """Every block period, play a block of every session and hand it to its subscribers."""
        out = np.zeros((self.block_frames, 2), np.float32)
        period_s = self.block_frames / self.session.sample_rate
        deadline = time.monotonic()
        while not self._closing.is_set():
            with self._lock:
                playing = list(self._sessions.values())
            for hosted in playing:
                try:
                    self._play_block(hosted, out)
                except Exception as error:  # a session ended under the clock: skip it this block
                    log.debug("clock: %s", error)
            deadline += period_s
            if time.monotonic() - deadline > period_s:
                self.late_blocks += 1
                deadline = time.monotonic()
            self._closing.wait(max(0.0, deadline - time.monotonic()))

    def _play_block(self, hosted: HostedSession, out: np.ndarray) -> None:
        sample, position = hosted.buffer.played_frames, hosted.buffer.position
        hosted.renderer.render(out, self.block_frames)
        for subscription in tuple(hosted.subscriptions):
            subscription.put(out, sample, position)

    def _get(self, name: str) -> HostedSession:
        with self._lock:
            hosted = self._sessions.get(name)
        if hosted is None:
            raise UnknownSession(refusals.unknown_session(name))
        return hosted


def _heard(record: LatencyRecord) -> dict[str, Any]:
    """A knob change followed to the ear, as a status lists it: ms from its arrival at this host to the first tick
    that used it and to when its sound reaches the playhead (a client through a gateway adds its call's way here)."""
    change = record.change
    return {
        "knob": change.name,
        "value": change.value,
        "kind": record.kind.value,
        "seq": change.seq,
        "origin": change.origin,
        "to_tick_ms": round(record.knob_to_tick_ms, 1),
        "to_ear_ms": round(record.knob_to_ear_ms, 1),
    }


def _knob_value(registry: KnobRegistry, name: str) -> float | str:
    spec = registry.specs[name]
    value = registry.get(name)
    return spec.choice(value) if spec.choices else value


def _session_frames(spec: SessionSpec, grid: Grid | None, hop: int, rate: int) -> tuple[int, int]:
    """(samples of the session's playback buffer, T of its requests): a loop (of whole bars, with a grid) and its
    window (the loop itself when the window covers it), or an endless song's ring and its window. ValueError, naming
    the field, otherwise."""
    check_window_seconds(spec.window_seconds, "window_seconds")
    if spec.endless:
        if spec.window_seconds == 0:
            raise ValueError("endless play needs a window: give window_seconds, e.g. 20")
        window = window_frames(spec.window_seconds, None)
        return ring_frames(window, None) * hop, window
    samples = song_frames(spec.seconds, "seconds") * hop
    if grid is not None:
        bars = spec.bars or min(grid.most_bars(rate), max(1, round(samples / grid.bar_samples(rate))))
        samples = grid.loop_of_bars(bars, rate, "bars")
    frames = LoopMap(samples, hop).frames
    window = window_frames(spec.window_seconds, frames)
    return samples, frames if window is None else window
