"""The runner thread: owns the stream, turns knob values into shared curves and requests, ticks, and writes
freshly decoded audio into the loop buffer just ahead of the playhead.

Every tick decodes a short window at playhead + lead: the newest finished latent, or the last one again when
none came (gap-fill), so the region the playhead is about to play is always the freshest audio there is. The
lead follows the measured interval between buffer writes. Prompt changes, source swaps and depth changes come in
as messages and are applied between ticks; audio keeps playing from the buffer meanwhile.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from ..conditioning import Conditioning
from ..models.presets import LATENT_RATE_HZ
from ..session import Session, Source
from .knobs import KnobChange, KnobKind, KnobRegistry
from .loop_buffer import LoopBuffer

log = logging.getLogger("flowjam.runner")

FADE_FRAMES = 480  # 10 ms equal-gain edges on every patch
LEAD_MARGIN_S = 0.05
EMA_WEIGHT = 0.2


@dataclass(frozen=True)
class RunnerConfig:
    depth: int = 4
    backend: str | None = None  # None: the session's own backend
    window_s: float = 0.4  # audio kept per write
    min_lead_s: float = 0.05
    max_lead_s: float = 2.0


@dataclass
class LatencyRecord:
    """One knob change followed to the engine and to the ear (perf_counter seconds)."""

    change: KnobChange
    kind: KnobKind
    applied_tick: int = 0  # index of the tick whose knob pass applied it
    ticks_started_since_received: int = 0  # ticks that began after the change arrived but before it applied (0 = next tick)
    tick_done_at: float | None = None  # end of the first tick that used the new value
    ear_at: float | None = None  # when the playhead reaches the first audio made with it

    @property
    def knob_to_tick_ms(self) -> float | None:
        return None if self.tick_done_at is None else (self.tick_done_at - self.change.received_at) * 1000.0

    @property
    def knob_to_ear_ms(self) -> float | None:
        return None if self.ear_at is None else (self.ear_at - self.change.received_at) * 1000.0


@dataclass
class RunnerStats:
    ticks: int = 0
    latents: int = 0
    writes: int = 0
    tick_ms: float = 0.0
    decode_ms: float = 0.0
    interval_s: float = 0.0
    lead_s: float = 0.1
    window_s: float = 0.4
    last_error: str | None = None
    errors: int = 0
    latencies: list[LatencyRecord] = field(default_factory=list)


class LiveRunner:
    def __init__(
        self,
        session: Session,
        registry: KnobRegistry,
        buffer: LoopBuffer,
        prompt: str | Conditioning,
        prompt_b: str | Conditioning | None = None,
        source: Source | None = None,
        config: RunnerConfig = RunnerConfig(),
    ):
        self.session, self.registry, self.buffer, self.config = session, registry, buffer, config
        self.frames = buffer.frames // session.models.vae.hop_samples
        if self.frames < 1:
            raise ValueError("the loop buffer is shorter than one latent frame")
        self.stream = session.stream(depth=int(registry.get("depth")), backend=config.backend)
        buffer.gain = registry.get("volume")
        self._messages: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seq_applied = 0
        encode = lambda p: p if isinstance(p, Conditioning) else session.encode_text(p)  # noqa: E731
        self._prompts = {"a": encode(prompt), "b": encode(prompt_b if prompt_b is not None else prompt)}
        self._blends: OrderedDict[float, Conditioning] = OrderedDict()
        self._silence_context = session.context_latents(self.frames, None)
        self._set_source(source)
        self._latest: torch.Tensor | None = None
        self._pending: list[LatencyRecord] = []
        self._tick_starts: list[float] = []
        self.stats = RunnerStats(window_s=config.window_s)
        self._lock = threading.Lock()

    # ---- messages (any thread) -------------------------------------------------------------------------------

    def set_prompt(self, which: str, text: str) -> None:
        if which not in ("a", "b"):
            raise ValueError(f"prompt slot must be 'a' or 'b', got {which!r}")
        self._messages.put(("prompt", (which, text)))

    def set_conditioning(self, which: str, conditioning: Conditioning) -> None:
        """Use an already encoded condition as prompt A or B (from a ComfyUI graph, say)."""
        if which not in ("a", "b"):
            raise ValueError(f"prompt slot must be 'a' or 'b', got {which!r}")
        self._messages.put(("conditioning", (which, conditioning)))

    def set_curve(self, name: str, curve: torch.Tensor | None) -> None:
        """A per-frame shared curve (or None to fall back to the knob's scalar) for every in-flight slot."""
        self._messages.put(("curve", (name, curve)))

    def set_structure(self, context: torch.Tensor | None) -> None:
        """Text-only structure: context latents [1, frames, 128] (e.g. `session.codes_context` of LM codes) that the
        `structure` knob fades in, with no source audio; None goes back to plain text2music."""
        if context is not None and tuple(context.shape) != (1, self.frames, self._silence_context.shape[-1]):
            raise ValueError(f"structure context must be [1, {self.frames}, {self._silence_context.shape[-1]}], got {tuple(context.shape)}")
        self._messages.put(("structure", context))

    def swap_source(self, source: Source | None) -> None:
        """Replace the source (None: text-only). Its length must match the loop buffer."""
        if source is not None and source.frames != self.frames:
            raise ValueError(f"source has {source.frames} frames but the loop has {self.frames}; trim or pad it to the loop length")
        self._messages.put(("source", source))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="flowjam-runner", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def current_source(self) -> Source | None:
        return self._source

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- the loop (runner thread) ----------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.step()
            except Exception as error:  # a bad message or knob must never stop the music
                self.stats.errors += 1
                if str(error) != self.stats.last_error:
                    log.exception("runner step failed; the stream keeps playing")
                self.stats.last_error = str(error)
                time.sleep(0.01)

    def step(self) -> None:
        """One tick: messages, knobs, submit, tick, write the window ahead of the playhead."""
        self._drain_messages()
        self._apply_knobs()
        started = time.perf_counter()
        self._tick_starts.append(started)
        del self._tick_starts[:-64]
        self.stream.submit(self._request())
        finished = self.stream.tick()
        tick_done = time.perf_counter()
        self.stats.ticks += 1
        self.stats.tick_ms = (tick_done - started) * 1000.0
        for record in self._pending:
            if record.tick_done_at is None and record.kind is KnobKind.SHARED:
                record.tick_done_at = tick_done
        fresh_from: int | None = None
        if finished:
            self._latest = finished[-1].latent
            fresh_from = finished[-1].request.tag
            self.stats.latents += len(finished)
            for record in self._pending:
                if record.tick_done_at is None and record.kind is KnobKind.REQUEST and fresh_from >= record.change.seq:
                    record.tick_done_at = tick_done
        if self._latest is not None:
            self._write_ahead(started, fresh_from)

    def _drain_messages(self) -> None:
        while True:
            try:
                kind, payload = self._messages.get_nowait()
            except queue.Empty:
                return
            if kind == "prompt":
                which, text = payload
                self._prompts[which] = self.session.encode_text(text)
                self._blends.clear()
            elif kind == "conditioning":
                which, conditioning = payload
                self._prompts[which] = conditioning
                self._blends.clear()
            elif kind == "curve":
                name, curve = payload
                self.stream.set_shared_curve(name, curve if curve is not None else self.registry.get(name))
            elif kind == "source":
                self._set_source(payload)
                self._latest = None  # the next generation starts from the new source, not the old loop
            elif kind == "structure":
                self._source = None
                self._hints_context = None if payload is None else payload.to(self.session.device, self.session.dtype)

    def _apply_knobs(self) -> None:
        for change in self.registry.changes_since(self._seq_applied):
            spec = self.registry.specs[change.name]
            if spec.kind is KnobKind.SHARED:
                self.stream.set_shared_curve(change.name, change.value)
            elif change.name == "depth":
                self.stream.set_depth(int(change.value))
            elif change.name == "volume":
                self.buffer.gain = change.value
            if spec.kind is not KnobKind.GLOBAL:
                self._track(change, spec.kind)
            self._seq_applied = max(self._seq_applied, change.seq)

    def _track(self, change: KnobChange, kind: KnobKind) -> None:
        waited = sum(start > change.received_at for start in self._tick_starts)
        with self._lock:
            self._pending.append(LatencyRecord(change, kind, self.stats.ticks + 1, waited))

    def _set_source(self, source: Source | None) -> None:
        """Switch source; its context latents are built here once, not on every tick."""
        self._source = source
        self._hints_context = None if source is None else self.session.context_latents(self.frames, source)

    def _condition(self) -> Conditioning:
        blend = round(self.registry.get("prompt_blend"), 2)
        cached = self._blends.get(blend)
        if cached is None:
            cached = self.session.blend_conditionings(self._prompts["a"], self._prompts["b"], blend)
            self._blends[blend] = cached
            if len(self._blends) > 16:
                self._blends.popitem(last=False)
        return cached

    def _request(self):
        knobs = self.registry
        seconds = self.frames / LATENT_RATE_HZ
        options: dict[str, Any] = dict(seed=int(knobs.get("seed")), steps=int(knobs.get("steps")), shift=knobs.get("shift"), tag=knobs.seq)
        if self._hints_context is not None:
            options["context_latents"] = torch.lerp(self._silence_context, self._hints_context, knobs.get("structure"))
        start = self._latest if self._latest is not None else (None if self._source is None else self._source.latents)
        if start is None:
            return self.session.make_request(self._condition(), seconds, **options)
        return self.session.make_request(self._condition(), seconds, denoise=knobs.get("denoise"), source_latents=start, **options)

    def _write_ahead(self, started: float, fresh_from: int | None) -> None:
        """Decode the window at playhead + lead and patch it into the loop buffer."""
        hop = self.session.models.vae.hop_samples
        rate = self.buffer.sample_rate
        playhead = self.buffer.playhead_frames
        lead_samples = int(self.stats.lead_s * rate)
        frame = -(-(playhead + lead_samples) // hop) % self.frames
        decode_started = time.perf_counter()
        audio = self.session.decode(self._latest, t_start=frame / LATENT_RATE_HZ, window_s=self.stats.window_s, cyclic=True)
        now = time.perf_counter()
        self.buffer.patch(frame * hop, audio, FADE_FRAMES)
        self.stats.decode_ms = (now - decode_started) * 1000.0
        self.stats.writes += 1
        self._adapt(now - started)
        playhead_now = self.buffer.playhead_frames
        ahead_s = ((frame * hop - playhead_now) % self.buffer.frames) / rate
        self._resolve_ear(now + ahead_s, fresh_from)

    def _adapt(self, interval_s: float) -> None:
        stats, config = self.stats, self.config
        stats.interval_s = interval_s if stats.writes <= 1 else (1 - EMA_WEIGHT) * stats.interval_s + EMA_WEIGHT * interval_s
        stats.lead_s = min(config.max_lead_s, max(config.min_lead_s, 1.5 * stats.interval_s + LEAD_MARGIN_S))
        song_s = self.buffer.frames / self.buffer.sample_rate
        stats.window_s = min(song_s, max(config.window_s, stats.lead_s + 2 * stats.interval_s))

    def _resolve_ear(self, ear_at: float, fresh_from: int | None) -> None:
        with self._lock:
            for record in self._pending:
                if record.ear_at is not None or record.tick_done_at is None:
                    continue
                if fresh_from is None:
                    continue  # a gap-fill re-decode of an older latent: the change is not in it yet
                if record.kind is KnobKind.SHARED or fresh_from >= record.change.seq:
                    record.ear_at = ear_at
            done = [r for r in self._pending if r.ear_at is not None]
            self._pending = [r for r in self._pending if r.ear_at is None][-256:]
            self.stats.latencies = (self.stats.latencies + done)[-256:]

    def status(self) -> dict[str, Any]:
        stats = self.stats
        return {
            "ticks": stats.ticks,
            "latents": stats.latents,
            "tick_ms": round(stats.tick_ms, 2),
            "decode_ms": round(stats.decode_ms, 2),
            "lead_s": round(stats.lead_s, 3),
            "window_s": round(stats.window_s, 3),
            "playhead_s": round(self.buffer.position / self.buffer.sample_rate, 3),
            "errors": stats.errors,
            "last_error": stats.last_error,
            "depth": self.stream.pipeline.depth,
        }
