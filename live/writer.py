"""The writer: decodes the newest latent's window at playhead + lead and patches it into the loop buffer.

It runs on a thread of its own and, on a GPU, on a high-priority CUDA stream of its own with its own CUDA graphs
(one per window shape), so the decode of a new latent overlaps the next tick instead of following it. Between new
latents it re-decodes the newest one at the moving playhead (gap-fill) before the last window runs out, so the
region about to play is always the freshest audio there is. The lead follows the measured time from reading the
playhead to the patch being in the buffer, its jitter, and the output's block (audio within a block past the
playhead may already be read).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

from ..engine.audio.window_decode import MAX_CAPTURED_WINDOW_S
from ..engine.params import LATENT_RATE_HZ
from ..engine.session import DECODE_MARGIN_FRAMES, Session
from .latency import RunnerStats
from .loop_buffer import LoopBuffer
from .loop_map import LoopMap
from .realtime import raise_thread_priority

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
    ):
        """`loop_filled`: the buffer already holds the loop (else the first latent is decoded whole into it);
        `loop_map`: where the buffer's audio lies on the latents offered."""
        self.session, self.buffer, self.stats, self.loop_map = session, buffer, stats, loop_map
        self._on_error = on_error
        self._lead_range_s, self._min_patch_s = lead_range_s, min_patch_s
        self._loop_filled = loop_filled
        if loop_filled:
            stats.audio_from_frames = buffer.played_frames
        self._decode = session.window_decoder()
        cuda = session.device.type == "cuda"
        self._cuda_stream = torch.cuda.Stream(session.device, priority=-1) if cuda else None
        self._latest: torch.Tensor | None = None
        self._pending: tuple[torch.Tensor, torch.cuda.Event | None, int, int] | None = None
        self._last_write: float | None = None
        self._adapted = False  # the averages are set (by the first steady write)
        self._ready = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def graph_counters(self) -> dict[str, int]:
        """The window decoder's graph counters (captures, replays, failures)."""
        return dict(vars(self._decode.counters))

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
        self._thread = threading.Thread(target=self._run, name="flowjam-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> None:
        with self._ready:
            self._stopping = True
            self._ready.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _take(self) -> tuple[torch.Tensor | None, tuple[int, int] | None]:
        """(latent to write, (its request's sequence, its tick) if it is new, None for a gap-fill)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return self._latest, None
        latent, ready, *fresh = pending
        if ready is not None:  # read on this thread's stream: wait for the offering stream, and keep the memory
            # from being handed to that stream again while a decode here still reads it
            torch.cuda.current_stream(latent.device).wait_event(ready)
            latent.record_stream(torch.cuda.current_stream(latent.device))
        self._latest = latent
        return latent, tuple(fresh)

    def _gap_s(self) -> float:
        """Time until a gap-fill is due: before the playhead passes the last window, less a write."""
        stats = self.stats
        if self._last_write is None:
            return 0.05
        due = self._last_write + stats.patch_s - stats.lead_s - 2.0 * stats.write_s
        return max(MIN_GAP_S, due - time.perf_counter())

    def _run(self) -> None:
        raise_thread_priority()
        if self._cuda_stream is None:  # on a CPU the decode takes one core, so the ticks keep the others
            torch.set_num_threads(1)
        with torch.cuda.stream(self._cuda_stream) if self._cuda_stream is not None else nullcontext():
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
        stats = self.stats
        hop, loop_map = self.session.models.vae.hop_samples, self.loop_map
        rate = self.buffer.sample_rate
        frames = latent.shape[1]
        if not self._loop_filled:  # the first latent fills the whole loop: no never-written (silent) region is left
            self.buffer.fill(loop_map.loop_audio(self.session.decode(latent), FADE_FRAMES))
            self._loop_filled = True
            stats.audio_from_frames = self.buffer.played_frames
        if stats.writes == 0:  # window shapes a steady stream uses, captured before they are needed
            self._decode.warm_up(latent, WARM_WINDOWS_S, DECODE_MARGIN_FRAMES)
        read_at = time.perf_counter()
        start = self.buffer.playhead_frames + int(stats.lead_s * rate)  # the first sample the new audio replaces
        latent_at = loop_map.latent_sample(start)
        frame, into = (latent_at // hop) % frames, latent_at % hop  # the latent frame holding it, and where in it
        audio = self._decode(
            latent, frame / LATENT_RATE_HZ, stats.patch_s, DECODE_MARGIN_FRAMES, cyclic=True
        ).cpu()  # on a GPU this waits for the decode only (the writer's own stream): the audio is real from here on
        decoded = time.perf_counter()
        audio = loop_map.splice(audio[:, into:], start, FADE_FRAMES)  # from playhead + lead exactly
        self.buffer.patch(start, audio, FADE_FRAMES)
        patched = time.perf_counter()
        stats.decode_ms = (decoded - read_at) * 1000.0
        stats.writes += 1
        if fresh is not None:
            stats.written_seq = fresh[0]
        interval = None if self._last_write is None else patched - self._last_write
        self._last_write = patched
        if not self._decode.last_was_warm_up:  # a one-off capture is not the write time the lead must cover
            self._adapt(interval, patched - read_at)
        playhead = self.buffer.playhead_frames
        if 0 <= playhead - start < audio.shape[1]:  # the playhead passed the patch's start: heard from now
            stats.late_writes += 1
            ahead_s = 0.0
        else:
            ahead_s = ((start - playhead) % self.buffer.frames) / rate
        if fresh is not None:
            stats.latency.heard(patched, patched + ahead_s, *fresh)

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
