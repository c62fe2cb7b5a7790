"""LoopBuffer: the looping playback buffer in shared memory, plus the counters that make up the audio clock.

The engine patches decoded audio into the buffer just ahead of the playhead; an output callback (in this process
or in a spawned one that attaches by name) reads it at the playhead and advances the played-frames counter. That
counter is the clock: frames handed to the audio device since the buffer was created.

Concurrency: one writer of audio (the engine), one reader (the callback), no locks. A patch that lands inside the
block being read can tear that one block (part old, part new audio); patches are meant to land ahead of the
playhead, where this never happens. Each counter has a single writer, and aligned 8-byte stores are atomic.
"""

from __future__ import annotations

import threading
from multiprocessing import shared_memory

import numpy as np

_MAGIC = 0x464C4A4D4C4F4F50  # "FLJMLOOP"
_COUNTERS, _REALS = 16, 8
_HEADER_BYTES = 8 * (_COUNTERS + _REALS)

# Slots of LoopBuffer.counters (int64). The output side writes them; Playback writes STOP and resets at start.
FRAMES, CHANNELS, SAMPLE_RATE = 1, 2, 3
PLAYED = 4  # absolute frames handed to the device: THE playhead
LATE_BLOCKS = 5  # the output itself came late: the device flagged output_underflow, or the null clock woke late
CALLBACKS = 6
RUNNING = 7  # 1 while an output stream plays this buffer
STOP = 8  # set by Playback to ask the output process to stop
RECORDED = 9  # frames written to the recording ring since the recording started
FADE_STARTED = 10  # PLAYED at the first frame of the newest transport fade (stop or play), -1 before any
BLOCK = 11  # frames the output renders per callback (the playhead moves in these steps); 0 before it starts
GAPS = 12  # exact-zero blocks while playing: the engine fell behind the playhead
# Slots of LoopBuffer.reals (float64).
GAIN = 0  # target volume, linear
APPLIED_GAIN = 1  # volume the callback used at the end of its last block (it ramps from here to GAIN)
LATENCY_S = 2  # output latency reported by PortAudio
TRANSPORT = 3  # 1 = playing, 0 = stopped (the callback fades to it)
APPLIED_TRANSPORT = 4  # transport gain at the end of the callback's last block
TRANSPORT_FADE_FRAMES = 480  # a stop or play fades over 10 ms at 48 kHz


class LoopBuffer:
    """A looping float32 buffer of `frames` x `channels` in shared memory, stored interleaved ([frames, channels],
    the layout PortAudio wants, so the callback copies contiguous rows); the API speaks [channels, frames]."""

    def __init__(
        self, frames: int, channels: int = 2, sample_rate: int = 48_000, name: str | None = None, create: bool = True
    ):
        if create:
            if frames <= 0 or channels <= 0 or sample_rate <= 0:
                raise ValueError(
                    f"frames, channels and sample_rate must be positive, got {frames}, {channels}, {sample_rate}"
                )
            size = _HEADER_BYTES + 4 * frames * channels
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        else:
            if name is None:
                raise ValueError("attaching to a LoopBuffer needs its name")
            self._shm = shared_memory.SharedMemory(name=name)
        self._owner = create
        self._lock = threading.Lock()  # this process's threads against close(): none touches an unmapped view
        self.counters = np.ndarray((_COUNTERS,), np.int64, self._shm.buf, 0)
        self.reals = np.ndarray((_REALS,), np.float64, self._shm.buf, 8 * _COUNTERS)
        if create:
            self.counters[:] = 0
            self.counters[[0, FRAMES, CHANNELS, SAMPLE_RATE]] = (_MAGIC, frames, channels, sample_rate)
            self.counters[FADE_STARTED] = -1
            self.reals[:] = 0.0
            self.reals[[GAIN, APPLIED_GAIN, TRANSPORT, APPLIED_TRANSPORT]] = 1.0
        elif self.counters[0] != _MAGIC:
            self.counters = self.reals = None
            self._shm.close()
            raise ValueError(f"shared memory {name!r} is not a LoopBuffer")
        self.frames, self.channels, self.sample_rate = (int(self.counters[i]) for i in (FRAMES, CHANNELS, SAMPLE_RATE))
        self.name = self._shm.name
        self.data = np.ndarray((self.frames, self.channels), np.float32, self._shm.buf, _HEADER_BYTES)
        if create:
            self.data[:] = 0.0

    @classmethod
    def attach(cls, name: str) -> LoopBuffer:
        """Open an existing buffer by name from another process; close() it there, never unlink(). Attach from
        processes started by multiprocessing: they share the creator's resource tracker, whereas an unrelated
        Python process would have its own tracker unlink the memory when it exits."""
        return cls(0, name=name, create=False)

    # --- writing (engine side) ---------------------------------------------------------------------------------

    def patch(self, start_frame: int, audio, fade_frames: int = 480) -> None:
        """Write [channels, N] audio at start_frame (taken modulo the loop, wrapping past its end), crossfaded in
        with equal-gain (sin²) curves, right for the correlated audio of successive generations, over fade_frames at both edges (shortened to N // 2 for short patches);
        between the fades the new audio replaces what was there. N must not exceed the loop length."""
        new = self._as_frames_major(audio)
        count = new.shape[0]
        if count > self.frames:
            raise ValueError(f"patch of {count} frames does not fit a loop of {self.frames} frames")
        if count == 0:
            return
        fade = max(0, min(int(fade_frames), count // 2))
        start = int(start_frame) % self.frames
        if fade:
            rise = (np.sin(0.5 * np.pi * (np.arange(fade) + 0.5) / fade) ** 2).astype(np.float32)[:, None]
            fall = 1.0 - rise
            with self._lock:
                old_head = self.data[(start + np.arange(fade)) % self.frames]
                old_tail = self.data[(start + count - fade + np.arange(fade)) % self.frames]
            new = new.copy()
            new[:fade] = new[:fade] * rise + old_head * fall
            new[count - fade :] = new[count - fade :] * rise[::-1] + old_tail * fall[::-1]
        first = min(count, self.frames - start)
        with self._lock:
            self.data[start : start + first] = new[:first]
            self.data[: count - first] = new[first:]

    def fill(self, audio) -> None:
        """Replace the whole loop (initial content); audio must be [channels, frames] of exactly the loop length."""
        new = self._as_frames_major(audio)
        if new.shape[0] != self.frames:
            raise ValueError(f"fill needs exactly {self.frames} frames, got {new.shape[0]}")
        with self._lock:
            self.data[:] = new

    def _as_frames_major(self, audio) -> np.ndarray:
        """[channels, N] (numpy or torch; 1-D means one channel for all) -> float32 [N, channels] view or copy."""
        if hasattr(audio, "detach"):  # a torch tensor; torch is not imported here (the output process stays light)
            audio = audio.detach().float().cpu().numpy()
        audio = np.asarray(audio, np.float32)
        if audio.ndim == 1:
            audio = np.broadcast_to(audio, (self.channels, audio.shape[0]))
        if audio.ndim != 2 or audio.shape[0] != self.channels:
            raise ValueError(f"audio must be [{self.channels}, frames], got shape {tuple(audio.shape)}")
        if not np.isfinite(audio).all():
            raise ValueError("audio contains NaN or infinite samples")
        return audio.T

    # --- reading (callback side) -------------------------------------------------------------------------------

    def read_into(self, out: np.ndarray, position: int) -> None:
        """Copy frames [position, position + len(out)) modulo the loop into out ([N, channels] float32), wrapping;
        allocates no audio memory (safe in an audio callback)."""
        count = out.shape[0]
        start = position % self.frames
        while count:
            take = min(count, self.frames - start)
            done = out.shape[0] - count
            out[done : done + take] = self.data[start : start + take]
            count -= take
            start = 0

    def snapshot(self) -> np.ndarray:
        """A copy of the loop as [channels, frames]."""
        with self._lock:
            return np.ascontiguousarray(self.data.T)

    # --- clock and meters --------------------------------------------------------------------------------------

    @property
    def block_frames(self) -> int:
        """Frames the output renders per callback (0 before playback starts): audio within one block past the
        playhead may already be read."""
        return self._counter(BLOCK)

    @property
    def playhead_frames(self) -> int:
        """Absolute frames played since the buffer was created (monotonic): the audio clock."""
        return self._counter(PLAYED)

    @property
    def position(self) -> int:
        """Where in the loop the next block will be read."""
        return self.playhead_frames % self.frames

    @property
    def underruns(self) -> int:
        """Blocks heard as a hole, of either kind."""
        return self.late_blocks + self.gaps

    @property
    def late_blocks(self) -> int:
        return self._counter(LATE_BLOCKS)

    @property
    def gaps(self) -> int:
        return self._counter(GAPS)

    @property
    def callbacks(self) -> int:
        return self._counter(CALLBACKS)

    @property
    def running(self) -> bool:
        return bool(self._counter(RUNNING))

    @property
    def gain(self) -> float:
        return self._real(GAIN)

    @gain.setter
    def gain(self, value: float) -> None:
        """Linear volume; the callback ramps to a new value over one block (no clicks)."""
        if not np.isfinite(value) or value < 0:
            raise ValueError(f"gain must be a finite number >= 0, got {value}")
        self._set_real(GAIN, float(value))

    @property
    def playing(self) -> bool:
        """Transport state: False after stop (the output fades to silence while the clock runs on)."""
        return bool(self._real(TRANSPORT))

    @playing.setter
    def playing(self, value: bool) -> None:
        """Stop fades the output to silence over TRANSPORT_FADE_FRAMES, play fades it back in at the playhead."""
        self._set_real(TRANSPORT, 1.0 if value else 0.0)

    @property
    def fade_started_frames(self) -> int:
        """The playhead at the start of the newest transport fade (-1 before any)."""
        return self._counter(FADE_STARTED)

    def _counter(self, index: int) -> int:
        with self._lock:
            return int(self.counters[index])

    def _real(self, index: int) -> float:
        with self._lock:
            return float(self.reals[index])

    def _set_real(self, index: int, value: float) -> None:
        with self._lock:
            self.reals[index] = value

    # --- lifetime ----------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this process's mapping. The counters, levels and audio stay readable (and writable, to no effect) as
        private copies of their last values, so a thread that still finishes a tick or a write after a stop (a
        runner stopped with a timeout) sees the final state instead of failing: the methods and properties here
        wait for one in progress, and none touches the mapping afterwards. Arrays taken from the mapping directly
        (the output callback's) must not be used after it: stop the playback first."""
        with self._lock:
            if self._shm is None:
                return
            shm, self._shm = self._shm, None
            self.counters, self.reals, self.data = self.counters.copy(), self.reals.copy(), self.data.copy()
            try:
                shm.close()
            except BufferError:  # someone still holds an export of it; the mapping goes with the last one
                pass

    def unlink(self) -> None:
        """Free the shared memory (creator only; attached processes just close). The name disappears at once;
        processes that still map it keep their mapping until they close."""
        if self._owner and self._shm is not None:
            try:
                self._shm.unlink()
            except FileNotFoundError:
                pass
        self.close()

    def __enter__(self) -> LoopBuffer:
        return self

    def __exit__(self, *exc) -> None:
        self.unlink() if self._owner else self.close()

    def __repr__(self) -> str:
        return f"LoopBuffer({self.frames} frames x {self.channels} ch @ {self.sample_rate} Hz, name={self.name!r})"
