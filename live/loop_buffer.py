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
_COUNTERS, _REALS = 32, 16
_HEADER_BYTES = 8 * (_COUNTERS + _REALS)
MAX_REGIONS = 2

# Slots of LoopBuffer.counters (int64). The output side writes them; Playback writes STOP and resets at start.
FRAMES, CHANNELS, SAMPLE_RATE = 1, 2, 3  # FRAMES: a region's capacity
PLAYED = 4  # absolute frames handed to the device: THE playhead
LATE_BLOCKS = 5  # the output itself came late: the device flagged output_underflow, or the null clock woke late
CALLBACKS = 6
RUNNING = 7  # 1 while an output stream plays this buffer
STOP = 8  # set by Playback to ask the output process to stop
RECORDED = 9  # frames written to the recording ring since the recording started
FADE_STARTED = 10  # PLAYED at the first frame of the newest transport fade (stop or play), -1 before any
BLOCK = 11  # frames the output renders per callback (the playhead moves in these steps); 0 before it starts
GAPS = 12  # exact-zero blocks while playing: the engine fell behind the playhead
START_AT = 13  # the transport starts (fades in) when PLAYED reaches this frame (a clock's bar line); -1: none
BLOCK_PLAYED = 14  # PLAYED at the start of the newest block; BLOCK_TIME is when that block was rendered
REGIONS = 15  # loops the buffer holds (1, or 2 where a new tempo's loop is made beside the one playing)
ACTIVE = 16  # the region the output plays
SWITCH_AT = 17  # the output moves to region SWITCH_TO (and the NEXT_CLICK_ settings) at this PLAYED frame; -1: none
SWITCH_TO = 18
BAR_SWITCH = -2  # SWITCH_AT for a DAW plugin: switch on the host's next bar line (other outputs never switch on it)
LENGTHS = (20, 21)  # each region's loop length (<= FRAMES)
SHIFTS = (24, 25)  # each region's position runs this many frames ahead of PLAYED: a clock's phase lock moves it
BARS = (26, 27)  # each region's loop in whole bars (0: not on a grid): a plugin maps the host's bars onto it
# Slots of LoopBuffer.reals (float64).
GAIN = 0  # target volume, linear
APPLIED_GAIN = 1  # volume the callback used at the end of its last block (it ramps from here to GAIN)
LATENCY_S = 2  # output latency reported by PortAudio
TRANSPORT = 3  # 1 = playing, 0 = stopped (the callback fades to it)
APPLIED_TRANSPORT = 4  # transport gain at the end of the callback's last block
BLOCK_TIME = 5  # the sync clock (live/sync/clock.py) when the newest block was rendered
CLICK_BAR = 6  # a metronome click on every bar start, bars this many frames long; 0: no click
CLICK_CYCLE = 7  # bar starts count from each start of a cycle this long (0: the loop; endless play: one bar)
NEXT_CLICK_BAR, NEXT_CLICK_CYCLE = 8, 9  # the click from the next switch on
BAR_FRAMES = (10, 11)  # each region's bar in frames, with BARS
TRANSPORT_FADE_FRAMES = 480  # a stop or play fades over 10 ms at 48 kHz
MIN_CLICK_BAR = 480


class LoopBuffer:
    """Looping float32 audio in shared memory: `regions` loops of at most `frames` x `channels` each (one, or two
    where a new tempo's loop is made beside the one playing), stored interleaved ([frames, channels], the layout
    PortAudio wants, so the callback copies contiguous rows); the API speaks [channels, frames]. The output plays
    the active region; the loop methods here act on it, `region(i)` gives a view of one region."""

    def __init__(
        self,
        frames: int,
        channels: int = 2,
        sample_rate: int = 48_000,
        name: str | None = None,
        create: bool = True,
        regions: int = 1,
        loop_frames: int | None = None,
    ):
        """`frames`: a region's capacity; `loop_frames`: the loop each region starts with (default: all of it)."""
        if create:
            if frames <= 0 or channels <= 0 or sample_rate <= 0:
                raise ValueError(
                    f"frames, channels and sample_rate must be positive, got {frames}, {channels}, {sample_rate}"
                )
            if regions not in range(1, MAX_REGIONS + 1):
                raise ValueError(f"a loop buffer holds 1..{MAX_REGIONS} regions, got {regions}")
            if loop_frames is not None and not 0 < loop_frames <= frames:
                raise ValueError(f"a loop of {loop_frames} frames does not fit a region of {frames}")
            size = _HEADER_BYTES + 4 * frames * channels * regions
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
            self.counters[[0, FRAMES, CHANNELS, SAMPLE_RATE, REGIONS]] = (
                _MAGIC,
                frames,
                channels,
                sample_rate,
                regions,
            )
            self.counters[list(LENGTHS)] = frames if loop_frames is None else loop_frames
            self.counters[[FADE_STARTED, START_AT, SWITCH_AT]] = -1
            self.reals[:] = 0.0
            self.reals[[GAIN, APPLIED_GAIN, TRANSPORT, APPLIED_TRANSPORT]] = 1.0
        elif self.counters[0] != _MAGIC:
            self.counters = self.reals = None
            self._shm.close()
            raise ValueError(f"shared memory {name!r} is not a LoopBuffer")
        self.capacity, self.channels, self.sample_rate, self.regions = (
            int(self.counters[i]) for i in (FRAMES, CHANNELS, SAMPLE_RATE, REGIONS)
        )
        self.name = self._shm.name
        self.data = np.ndarray((self.capacity * self.regions, self.channels), np.float32, self._shm.buf, _HEADER_BYTES)
        if create:
            self.data[:] = 0.0

    @classmethod
    def attach(cls, name: str) -> LoopBuffer:
        """Open an existing buffer by name from another process; close() it there, never unlink(). Attach from
        processes started by multiprocessing: they share the creator's resource tracker, whereas an unrelated
        Python process would have its own tracker unlink the memory when it exits."""
        return cls(0, name=name, create=False)

    # --- regions -----------------------------------------------------------------------------------------------

    def region(self, index: int | None = None) -> LoopRegion:
        """A view of one region (None: the one playing now), for a runner that writes it whichever one plays."""
        return LoopRegion(self, self.active if index is None else index)

    @property
    def active(self) -> int:
        return self._counter(ACTIVE)

    def _index(self, region: int | None) -> int:
        index = self.active if region is None else region
        if index not in range(self.regions):
            raise ValueError(f"this loop buffer has {self.regions} region(s), got region {index}")
        return index

    def loop_frames(self, region: int | None = None) -> int:
        return self._counter(LENGTHS[self._index(region)])

    def prepare(self, region: int, frames: int, shift: int) -> None:
        """Make `region` (not the one playing) a loop of `frames` whose position runs `shift` ahead of the frames
        played; its audio is written next, then the output is switched to it (`switch_at`)."""
        index = self._index(region)
        if index == self.active:
            raise ValueError(f"region {index} is playing: prepare the other one")
        if not 0 < frames <= self.capacity:
            raise ValueError(f"a region holds 1..{self.capacity} frames, got {frames}")
        with self._lock:
            self.counters[[LENGTHS[index], SHIFTS[index]]] = (int(frames), int(shift))

    def switch_at(self, played: int, region: int, click_bar: float = 0.0, click_cycle: float = 0.0) -> None:
        """Move the output to `region` (the playing one too: a new click only) at the frame played `played`, with a
        crossfade over that block, and from then on click bars of `click_bar` frames from every `click_cycle`."""
        index = self._index(region)
        _check_click(click_bar)
        if played < 0 and played != BAR_SWITCH:
            raise ValueError(f"a switch is at a frame >= 0 (or BAR_SWITCH for a plugin), got {played}")
        with self._lock:
            self.reals[[NEXT_CLICK_BAR, NEXT_CLICK_CYCLE]] = (float(click_bar), float(click_cycle))
            self.counters[SWITCH_TO] = index
            self.counters[SWITCH_AT] = int(played)  # last: the output acts once everything above is in place

    @property
    def switch_pending(self) -> bool:
        return self._counter(SWITCH_AT) != -1

    # --- writing (engine side) ---------------------------------------------------------------------------------

    def patch(self, start_frame: int, audio, fade_frames: int = 480, region: int | None = None) -> None:
        """Write [channels, N] audio at start_frame (taken modulo the loop, wrapping past its end), crossfaded in
        with equal-gain (sin²) curves, right for the correlated audio of successive generations, over fade_frames
        at both edges (shortened to N // 2 for short patches); between the fades the new audio replaces what was
        there. N must not exceed the loop length."""
        index = self._index(region)
        loop, base = self.loop_frames(index), index * self.capacity
        new = self._as_frames_major(audio)
        count = new.shape[0]
        if count > loop:
            raise ValueError(f"patch of {count} frames does not fit a loop of {loop} frames")
        if count == 0:
            return
        fade = max(0, min(int(fade_frames), count // 2))
        start = int(start_frame) % loop
        if fade:
            rise = (np.sin(0.5 * np.pi * (np.arange(fade) + 0.5) / fade) ** 2).astype(np.float32)[:, None]
            fall = 1.0 - rise
            with self._lock:
                old_head = self.data[base + (start + np.arange(fade)) % loop]
                old_tail = self.data[base + (start + count - fade + np.arange(fade)) % loop]
            new = new.copy()
            new[:fade] = new[:fade] * rise + old_head * fall
            new[count - fade :] = new[count - fade :] * rise[::-1] + old_tail * fall[::-1]
        first = min(count, loop - start)
        with self._lock:
            self.data[base + start : base + start + first] = new[:first]
            self.data[base : base + count - first] = new[first:]

    def fill(self, audio, region: int | None = None) -> None:
        """Replace the whole loop (initial content); audio must be [channels, frames] of exactly the loop length."""
        index = self._index(region)
        loop, base = self.loop_frames(index), index * self.capacity
        new = self._as_frames_major(audio)
        if new.shape[0] != loop:
            raise ValueError(f"fill needs exactly {loop} frames, got {new.shape[0]}")
        with self._lock:
            self.data[base : base + loop] = new

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

    def read_into(self, out: np.ndarray, position: int, region: int = 0) -> None:
        """Copy frames [position, position + len(out)) modulo `region`'s loop into out ([N, channels] float32),
        wrapping; allocates no audio memory and takes no lock (safe in an audio callback)."""
        loop, base = int(self.counters[LENGTHS[region]]), region * self.capacity
        count = out.shape[0]
        start = position % loop
        while count:
            take = min(count, loop - start)
            done = out.shape[0] - count
            out[done : done + take] = self.data[base + start : base + start + take]
            count -= take
            start = 0

    def snapshot(self, region: int | None = None) -> np.ndarray:
        """A copy of the loop as [channels, frames]."""
        index = self._index(region)
        base = index * self.capacity
        with self._lock:
            return np.ascontiguousarray(self.data[base : base + int(self.counters[LENGTHS[index]])].T)

    # --- clock and meters --------------------------------------------------------------------------------------

    @property
    def block_frames(self) -> int:
        """Frames the output renders per callback (0 before playback starts): audio within one block past the
        playhead may already be read."""
        return self._counter(BLOCK)

    @property
    def played_frames(self) -> int:
        """Frames handed to the device since the buffer was created (monotonic): the audio clock, time."""
        return self._counter(PLAYED)

    @property
    def frames(self) -> int:
        """The playing loop's length."""
        return self.loop_frames()

    def playhead(self, region: int | None = None) -> int:
        """`region`'s song position at the next block to be read: the frames played, moved by its shift."""
        index = self._index(region)
        with self._lock:
            return int(self.counters[PLAYED] + self.counters[SHIFTS[index]])

    @property
    def playhead_frames(self) -> int:
        """The song position of the next block to be read, in frames: the frames played, moved by a clock's phase
        lock (`shift`). Every write is placed by it."""
        return self.playhead()

    @property
    def position(self) -> int:
        """Where in the loop the next block will be read."""
        return self.playhead_frames % self.frames

    def get_shift(self, region: int | None = None) -> int:
        return self._counter(SHIFTS[self._index(region)])

    def set_shift(self, frames: int, region: int | None = None) -> None:
        """Move a loop's position against the frames played (a phase lock's correction): the output crossfades
        from the old position to the new one over its next block."""
        index = self._index(region)
        with self._lock:
            self.counters[SHIFTS[index]] = int(frames)

    shift = property(get_shift, set_shift)

    def set_bars(self, region: int, bars: int, bar_frames: float) -> None:
        """Record that `region` loops `bars` bars of `bar_frames` frames (0 bars: not on a grid), for a DAW plugin
        that maps its host's bars onto the loop."""
        index = self._index(region)
        if bars < 0 or (bars and not (np.isfinite(bar_frames) and bar_frames > 0)):
            raise ValueError(f"bars must be >= 0 with a bar > 0 frames, got {bars} bars of {bar_frames}")
        with self._lock:
            self.reals[BAR_FRAMES[index]] = float(bar_frames)
            self.counters[BARS[index]] = int(bars)

    def start_at(self, played: int) -> None:
        """Start the transport (a fade-in) when the frames played reach `played`; -1 cancels."""
        with self._lock:
            self.counters[START_AT] = int(played)

    def last_block(self) -> tuple[int, float] | None:
        """(frames played at the start of the newest block, the sync clock when it was rendered), read as one pair;
        None before the first block."""
        while True:
            with self._lock:
                before, at, after = (
                    int(self.counters[BLOCK_PLAYED]),
                    float(self.reals[BLOCK_TIME]),
                    int(self.counters[BLOCK_PLAYED]),
                )
            if before == after:
                return None if at == 0.0 else (before, at)

    @property
    def click_bar_frames(self) -> float:
        return self._real(CLICK_BAR)

    def set_click(self, bar_frames: float, cycle_frames: float = 0.0) -> None:
        """A metronome click on every bar start of the loop position (bars of `bar_frames` counted from each start
        of a `cycle_frames` cycle, 0: the loop; 0 bars: no click)."""
        _check_click(bar_frames)
        with self._lock:
            self.reals[[CLICK_BAR, CLICK_CYCLE]] = (float(bar_frames), float(cycle_frames))

    @property
    def latency_s(self) -> float:
        """The output's latency as its device reports it (0 before it starts)."""
        return self._real(LATENCY_S)

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


def _check_click(bar_frames: float) -> None:
    if not np.isfinite(bar_frames) or not (bar_frames == 0 or bar_frames >= MIN_CLICK_BAR):
        raise ValueError(f"a bar must be 0 (no click) or at least {MIN_CLICK_BAR} frames, got {bar_frames}")


class LoopRegion:
    """One region of a LoopBuffer, as a runner and its writer see it: its loop, its playhead, its writes; the clock,
    volume and transport are the buffer's."""

    def __init__(self, buffer: LoopBuffer, index: int):
        buffer._index(index)
        self.buffer, self.index = buffer, index

    def __getattr__(self, name: str):
        return getattr(self.buffer, name)

    @property
    def gain(self) -> float:
        return self.buffer.gain

    @gain.setter
    def gain(self, value: float) -> None:
        self.buffer.gain = value

    @property
    def frames(self) -> int:
        return self.buffer.loop_frames(self.index)

    @property
    def playhead_frames(self) -> int:
        return self.buffer.playhead(self.index)

    @property
    def position(self) -> int:
        return self.playhead_frames % self.frames

    @property
    def shift(self) -> int:
        return self.buffer.get_shift(self.index)

    @shift.setter
    def shift(self, frames: int) -> None:
        self.buffer.set_shift(frames, self.index)

    def patch(self, start_frame: int, audio, fade_frames: int = 480) -> None:
        self.buffer.patch(start_frame, audio, fade_frames, self.index)

    def fill(self, audio) -> None:
        self.buffer.fill(audio, self.index)

    def snapshot(self) -> np.ndarray:
        return self.buffer.snapshot(self.index)
