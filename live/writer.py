"""The writer: decodes the newest latent's window at playhead + lead and patches it into the loop buffer.

It runs on a thread of its own and, on a GPU, on a high-priority CUDA stream of its own with its own CUDA graphs
(one per window shape), so the decode of a new latent overlaps the next tick instead of following it. Between new
latents it re-decodes the newest one at the moving playhead (gap-fill) before the last window runs out, so the
region about to play is always the freshest audio there is. The lead follows the measured time from reading the
playhead to the patch being in the buffer, its jitter, and the output's block (audio within a block past the
playhead may already be read). A ring of several sessions can have one `RingWriter` (ring_writer.py) decode every
due session's window in one batch instead (`SharedTicker(batched_writes=True)`).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..engine.audio.window_decode import MAX_CAPTURED_WINDOW_S
from ..engine.params import LATENT_RATE_HZ
from ..engine.session import DECODE_MARGIN_FRAMES, Session
from .latency import RunnerStats
from .loop_buffer import LoopBuffer
from .loop_map import LoopMap
from .realtime import raise_thread_priority

if TYPE_CHECKING:
    from .ring_writer import RingWriter

FADE_FRAMES = 480  # 10 ms equal-gain edges on every patch
WAKE_MARGIN_S = 0.008  # beyond the measured write time and the output's block: a late wake-up
UNKNOWN_BLOCK_S = 0.022  # the block the lead covers before the output has said its own (1024 frames at 48 kHz)
JITTER_COVER = 4.0  # mean absolute deviations of the write time the lead covers
EMA_WEIGHT = 0.2
WINDOW_STEP_S = 0.2  # windows are whole multiples of this, so a few captured window shapes serve every write
MIN_GAP_S = 0.01
WARM_WINDOWS_S = tuple(round(WINDOW_STEP_S * k, 6) for k in range(1, round(MAX_CAPTURED_WINDOW_S / WINDOW_STEP_S) + 1))
"""Every window a write can ask for and a graph replays, captured at the first write: a knob's first move or a busy
tick lengthens the window, and a shape decoded for the first time then (plain, its convolutions tuned, with the
device lock held that a tick's capture waits for) cost a first touch 100-200 ms."""


def decode_stream(device: torch.device) -> torch.cuda.Stream | None:
    """A high-priority CUDA stream for a writer's decodes (None off a GPU), so they overlap the next tick."""
    return torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None


@contextmanager
def writing_thread(cuda_stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Set up the calling thread as a writer: raised priority, and its decodes on `cuda_stream` (on a CPU, one
    core, so the ticks keep the others)."""
    raise_thread_priority()
    if cuda_stream is None:
        torch.set_num_threads(1)
    with torch.cuda.stream(cuda_stream) if cuda_stream is not None else nullcontext():
        yield


@dataclass(frozen=True)
class WritePlan:
    """One write, planned: the latent, its freshness ((request sequence, tick) of a new latent, None for a gap-fill),
    when the playhead was read, the first buffer frame the patch replaces, the window's start in the latent (s) and
    the samples of the decoded window before that frame."""

    latent: torch.Tensor
    fresh: tuple[int, int] | None
    read_at: float
    start: int
    window_start_s: float
    into: int


class AheadWriter:
    def __init__(
        self,
        session: Session,
        buffer: LoopBuffer,
        stats: RunnerStats,
        on_error: Callable[[Exception], None],
        lead_range_s: tuple[float, float],
        min_patch_s: float,
        loop_filled: bool,
        loop_map: LoopMap,
        ring: RingWriter | None = None,
    ):
        """`loop_filled`: the buffer already holds the loop (else the first latent is decoded whole into it);
        `loop_map`: where the buffer's audio lies on the latents offered; `ring`: the ring's writer that decodes
        this session's windows with the others' once started (else a thread of its own does)."""
        self.session, self.buffer, self.stats, self.loop_map = session, buffer, stats, loop_map
        self._on_error = on_error
        self._lead_range_s, self._min_patch_s = lead_range_s, min_patch_s
        self._loop_filled = loop_filled
        if loop_filled:
            stats.audio_from_frames = buffer.played_frames
        self._ring = ring
        self._decode = session.window_decoder()
        self._cuda_stream = decode_stream(session.device) if ring is None else None
        self._latest: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None, int, int] | None = None
        self._last_write: float | None = None
        self._written_s = 0.0  # the last decoded window's length (s): the playhead passes its end about then
        self._adapted = False  # the averages are set (by the first steady write)
        self._ready = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        if self._ring is not None:
            return self._ring.writes_for(self)
        return self._thread is not None and self._thread.is_alive()

    @property
    def graph_counters(self) -> dict[str, int]:
        """The window decoder's graph counters (captures, replays, failures): the ring writer's on a ring."""
        decoder = self._decode if self._ring is None else self._ring.decoder
        return dict(vars(decoder.counters))

    def offer(self, latent: torch.Tensor, fresh_from: int, tick: int) -> None:
        """A latent finished by tick `tick`, its request made at registry sequence `fresh_from`; one not yet taken
        is replaced. On a GPU it is ready once the offering thread's stream gets here (work still queued there, a
        copy of the timeline say, comes first): the writer's stream waits for that point before reading it."""
        ready = None
        if latent.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(latent.device))
        with self._ready:
            self._pending = (latent, ready, fresh_from, tick)
            self._ready.notify()

    def forget(self) -> None:
        """Drop the latent gap-fills re-decode (the loop's source changed): write nothing until the next one."""
        with self._ready:
            self._latest, self._pending = None, None

    def write_pending(self) -> None:
        """Write the offered latent, or gap-fill with the newest one, in the calling thread (a runner stepped by
        hand)."""
        with self._ready:
            latent, fresh = self._take()
        if latent is not None:
            self._write(latent, fresh)

    def start(self) -> None:
        if self._ring is not None:
            self._ring.add(self)
            return
        self._thread = threading.Thread(target=self._run, name="flowjam-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        if self._ring is not None:
            self._ring.remove(self, timeout_s)  # a batch writing this session ends first
            return
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def take(self) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        """(latent to write, (its request's sequence, its tick) if it is new, None for a gap-fill); on a GPU the
        calling thread waits for the latent to be made (a ring that overlaps its ticks offers latents of a tick
        still running: a write's time, from its playhead read on, must not hold that tick)."""
        with self._ready:
            return self._take(host_waits=True)

    def _take(self, host_waits: bool = False) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        pending, self._pending = self._pending, None
        if pending is None:
            return self._latest, None
        latent, ready, *fresh = pending
        if ready is not None and host_waits:
            ready.synchronize()
        if ready is not None:  # read on this thread's stream: wait for the offering stream, and keep the memory
            # from being handed to that stream again while a decode here still reads it
            torch.cuda.current_stream(latent.device).wait_event(ready)
            latent.record_stream(torch.cuda.current_stream(latent.device))
        self._latest = latent
        return latent, tuple(fresh)

    def due_at(self) -> float:
        """When the next write is due (perf_counter s): at once for an offered latent, else a gap-fill's time;
        never, with nothing to write."""
        with self._ready:
            if self._pending is not None:
                return 0.0
            if self._latest is None:
                return math.inf
        return time.perf_counter() + self._gap_s()

    def _gap_s(self) -> float:
        """Time until a gap-fill is due: before the playhead passes the last window, less a write."""
        stats = self.stats
        if self._last_write is None:
            return 0.05
        due = self._last_write + self._written_s - stats.lead_s - 2.0 * stats.write_s
        return max(MIN_GAP_S, due - time.perf_counter())

    def _run(self) -> None:
        with writing_thread(self._cuda_stream):
            while True:
                with self._ready:
                    self._ready.wait_for(lambda: self._pending is not None or self._stopping, self._gap_s())
                    if self._stopping:
                        return
                    latent, fresh = self._take()
                if latent is None:
                    continue
                try:
                    self._write(latent, fresh)
                except Exception as error:  # a failed write must not stop the next ones
                    self._on_error(error)
                    time.sleep(MIN_GAP_S)

    def _write(self, latent: torch.Tensor, fresh: tuple[int, int] | None) -> None:
        """Decode the window at playhead + lead and patch it into the loop buffer."""
        if self.stats.writes == 0:  # window shapes a steady stream uses, captured before they are needed
            self._decode.warm_up(latent, WARM_WINDOWS_S, DECODE_MARGIN_FRAMES)
        plan = self.plan(latent, fresh)
        audio = self._decode(latent, plan.window_start_s, self.stats.patch_s, DECODE_MARGIN_FRAMES, cyclic=True)
        self.land(plan, audio.cpu(), warm_up=self._decode.last_was_warm_up)  # .cpu(): waits for the decode only

    def plan(self, latent: torch.Tensor, fresh: tuple[int, int] | None) -> WritePlan:
        """Read the playhead: where the next patch starts (playhead + lead) and the window that holds it. The first
        latent of a loop not yet filled is decoded whole into it first."""
        if not self._loop_filled:  # the first latent fills the whole loop: no never-written (silent) region is left
            self.buffer.fill(self.loop_map.loop_audio(self.session.decode(latent), FADE_FRAMES))
            self._loop_filled = True
            self.stats.audio_from_frames = self.buffer.played_frames
        hop, frames = self.session.models.vae.hop_samples, latent.shape[1]
        read_at = time.perf_counter()
        start = self.buffer.playhead_frames + int(self.stats.lead_s * self.buffer.sample_rate)
        latent_at = self.loop_map.latent_sample(start)  # the first sample the new audio replaces
        frame, into = (latent_at // hop) % frames, latent_at % hop  # the latent frame holding it, and where in it
        return WritePlan(latent, fresh, read_at, start, frame / LATENT_RATE_HZ, into)

    def land(self, plan: WritePlan, audio: torch.Tensor, warm_up: bool = False) -> None:
        """Patch the decoded window (host audio [2, samples] from the plan's window start) into the loop buffer from
        the plan's start exactly, and follow the write in the figures. `warm_up`: its decode captured a new shape
        (a one-off time the lead need not cover)."""
        stats, rate = self.stats, self.buffer.sample_rate
        decoded = time.perf_counter()
        window_s = audio.shape[1] / rate
        audio = self.loop_map.splice(audio[:, plan.into :], plan.start, FADE_FRAMES)
        self.buffer.patch(plan.start, audio, FADE_FRAMES)
        patched = time.perf_counter()
        stats.decode_ms = (decoded - plan.read_at) * 1000.0
        stats.writes += 1
        if plan.fresh is not None:
            stats.written_seq = plan.fresh[0]
        interval = None if self._last_write is None else patched - self._last_write
        self._last_write, self._written_s = patched, window_s
        if not warm_up:
            self._adapt(interval, patched - plan.read_at)
        playhead = self.buffer.playhead_frames
        if 0 <= playhead - plan.start < audio.shape[1]:  # the playhead passed the patch's start: heard from now
            stats.late_writes += 1
            ahead_s = 0.0
        else:
            ahead_s = ((plan.start - playhead) % self.buffer.frames) / rate
        if plan.fresh is not None:
            stats.latency.heard(patched, patched + ahead_s, *plan.fresh)

    def fail(self, error: Exception) -> None:
        """A write of this session failed (the stream plays on from the buffer)."""
        self._on_error(error)

    def _adapt(self, interval_s: float | None, write_s: float) -> None:
        """The lead covers the time from reading the playhead to the patch being in the buffer (the decode and the
        copy), with room for its jitter; the window spans the next write too, in whole window steps. The first
        steady write sets the averages."""
        stats = self.stats
        if not self._adapted:
            self._adapted = True
            stats.interval_s, stats.write_s, stats.write_jitter_s = interval_s or write_s, write_s, 0.0
        else:
            stats.interval_s += EMA_WEIGHT * ((interval_s or stats.interval_s) - stats.interval_s)
            stats.write_jitter_s += EMA_WEIGHT * (abs(write_s - stats.write_s) - stats.write_jitter_s)
            stats.write_s += EMA_WEIGHT * (write_s - stats.write_s)
        low, high = self._lead_range_s
        block = self.buffer.block_frames
        margin = (block / self.buffer.sample_rate if block else UNKNOWN_BLOCK_S) + WAKE_MARGIN_S
        stats.lead_s = min(high, max(low, stats.write_s + JITTER_COVER * stats.write_jitter_s + margin))
        song_s = self.buffer.frames / self.buffer.sample_rate
        wanted = max(self._min_patch_s, stats.lead_s + 2 * stats.interval_s)
        stats.patch_s = min(song_s, WINDOW_STEP_S * math.ceil(wanted / WINDOW_STEP_S - 1e-9))
