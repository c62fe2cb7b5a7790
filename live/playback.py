"""Playback: plays a LoopBuffer on an audio device through a sounddevice callback, and keeps the clock.

Four modes:
- "process" (default): a spawned process attaches to the shared buffer and runs the output stream there, so the
  engine's Python threads (GIL load) cannot starve the callback. The engine's entry script needs the usual
  `if __name__ == "__main__":` guard, and `flowjam` must be importable by name in the child (spawn re-imports).
- "thread": the callback runs in this process (simpler; fine when the process is otherwise idle).
- "null": no audio device; a clock thread 'plays' one block every blocksize / sample_rate seconds into nowhere.
- "null-process": the same clock in a spawned process, as "process" runs a device: the engine's compiles and
  captures (which hold the GIL) cannot make it late, so its underruns are the ones a sound card would have had.

The callback never allocates audio memory, never locks and never waits: it copies the block at the playhead,
applies the gain, optionally copies the block into a preallocated recording ring, and advances the counter.

sounddevice is imported inside functions only: importing it initialises PortAudio, which must happen after a JACK
server is up (and never in processes that make no sound).

Real time: the output process runs at SCHED_FIFO 1 where the OS allows it (above every normal process, so a CPU hog
cannot preempt its main thread while that holds the GIL the callback needs; below every audio thread, so its set-up
never delays one), then raises the callback's thread to REALTIME_PRIORITY unless the host API made it real-time
already (an RT JACK server does, at its own client priority). It locks its memory (mlockall) and freezes the garbage
collector's generations before the stream starts. The null clock thread asks for REALTIME_PRIORITY for itself. Where
the OS refuses, the parent logs it once, and the output process asks PortAudio for its "high" latency instead of
"low" (a larger margin where the host API honours it; JACK's margin is its period).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

from ..engine.outputs import check_output_path
from .loop_buffer import (
    APPLIED_GAIN,
    APPLIED_TRANSPORT,
    BLOCK,
    CALLBACKS,
    GAIN,
    GAPS,
    LATE_BLOCKS,
    LATENCY_S,
    RECORDED,
    RUNNING,
    STOP,
    TRANSPORT,
    LoopBuffer,
)
from .realtime import acquire_realtime, log_refusal, promote_callback_thread, settle
from .recording import RING_SECONDS, RecordingDrain
from .renderer import BlockRenderer

MODES = ("process", "thread", "null", "null-process")
DEFAULT_BLOCKSIZE = 512  # 10.7 ms at 48 kHz: the writer's lead covers one block (see writer.py)
SPAWNED = ("process", "null-process")  # the modes whose output runs in its own process
NULL_DEVICE_NAME = "null (no audio device)"
LIST_HINT = "run with --list-devices to see the outputs, or --no-audio to run without sound"
log = logging.getLogger("flowjam.playback")
_START_TIMEOUT_S = 30.0


PORTAUDIO_MISSING = "the PortAudio library is not installed"
PORTAUDIO_FIX = (
    "install it (Debian/Ubuntu: sudo apt install libportaudio2; Fedora: sudo dnf install portaudio; "
    "macOS: brew install portaudio)"
)


class PlaybackError(RuntimeError):
    """The audio output could not be opened or started."""


class PortAudioMissing(PlaybackError):
    """sounddevice cannot load PortAudio, the system library it plays through: no output can open on this machine."""


def sounddevice():
    """The sounddevice module (importing it loads PortAudio); PortAudioMissing, naming the fix, without PortAudio."""
    try:
        import sounddevice as sd
    except OSError as error:  # sounddevice raises OSError("PortAudio library not found")
        raise PortAudioMissing(f"{PORTAUDIO_MISSING} ({error}): {PORTAUDIO_FIX}") from None
    return sd


def list_devices() -> str:
    """A table of PortAudio's devices that can play (index, name, host API, output channels, default rate)."""
    sd = sounddevice()

    apis = sd.query_hostapis()
    default_output = sd.default.device[1]
    rows = [f"{'':2}{'index':>5}  {'name':32}  {'host API':28}  {'out ch':>6}  {'rate':>6}"]
    for index, device in enumerate(sd.query_devices()):
        if device["max_output_channels"] > 0:
            mark = "*" if index == default_output else ""
            rows.append(
                f"{mark:2}{index:>5}  {device['name'][:32]:32}  {apis[device['hostapi']]['name'][:28]:28}  "
                f"{device['max_output_channels']:>6}  {device['default_samplerate']:>6.0f}"
            )
    if len(rows) == 1:
        names = ", ".join(api["name"] for api in apis) or "none"
        return (
            f"no audio outputs (PortAudio host APIs: {names}). Start a JACK server before flowjam "
            "(e.g. `jackd -d dummy -r 48000`) or run with --no-audio."
        )
    return "\n".join(rows + ["* = default output"])


def find_device(spec: str | int | None) -> int | None:
    """An output device index from an index or a case-insensitive substring of its name (or of its host API's
    name, e.g. "jack"); JACK devices win when several match. None -> None (PortAudio's default output), or the
    first output when PortAudio has no default. Raises ValueError naming the available outputs."""
    sd = sounddevice()

    devices, apis = sd.query_devices(), sd.query_hostapis()
    outputs = [index for index, device in enumerate(devices) if device["max_output_channels"] > 0]

    def api_name(index: int) -> str:
        return apis[devices[index]["hostapi"]]["name"]

    def failure(reason: str) -> ValueError:
        available = "; ".join(f"{i}: {devices[i]['name']} ({api_name(i)})" for i in outputs) or "none"
        return ValueError(f"{reason}. Available outputs: {available}. {LIST_HINT}")

    if not outputs:
        raise failure("no audio output device found (is a JACK server running?)")
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        return None if sd.default.device[1] in outputs else _prefer_jack(outputs, devices, apis)
    if isinstance(spec, int) or spec.strip().isdigit():
        index = int(spec)
        if index not in outputs:
            raise failure(f"device {index} is not an audio output")
        return index
    needle = spec.strip().lower()
    matches = [i for i in outputs if needle in devices[i]["name"].lower()]
    matches = matches or [i for i in outputs if needle in api_name(i).lower()]
    if not matches:
        raise failure(f"no audio output matches {spec!r}")
    return _prefer_jack(matches, devices, apis)


def _prefer_jack(candidates: list[int], devices, apis) -> int:
    """The first JACK device among candidates (its host API's default output first), else the first one."""
    jack = [i for i in candidates if apis[devices[i]["hostapi"]]["name"].startswith("JACK")]
    pool = jack or candidates
    defaults = [i for i in pool if apis[devices[i]["hostapi"]]["default_output_device"] == i]
    return (defaults or pool)[0]


def _open_stream(
    renderer: BlockRenderer,
    device,
    blocksize: int,
    latency: str = "low",
    before_start: Callable[[], None] | None = None,
):
    """Open and start an OutputStream at the buffer's rate (JACK does not resample) -> (stream, device name).
    `before_start` runs once the stream (and PortAudio's threads) exist, before its first callback."""
    sd = sounddevice()

    buffer = renderer.buffer
    try:
        index = find_device(device)
        stream = sd.OutputStream(
            samplerate=buffer.sample_rate,
            blocksize=blocksize,
            device=index,
            channels=buffer.channels,
            dtype="float32",
            latency=latency,
            callback=renderer.callback,
        )
    except (ValueError, sd.PortAudioError) as error:
        raise PlaybackError(
            f"cannot open audio output {device!r}: {error}" + ("" if LIST_HINT in str(error) else f". {LIST_HINT}")
        ) from error
    try:
        if before_start is not None:
            before_start()
        stream.start()
    except sd.PortAudioError as error:
        stream.close(ignore_errors=True)
        raise PlaybackError(f"cannot start audio output {device!r}: {error}. {LIST_HINT}") from error
    info = sd.query_devices(stream.device)
    name = f"{info['name']} ({sd.query_hostapis(info['hostapi'])['name']})"
    buffer.reals[LATENCY_S] = float(stream.latency)
    buffer.counters[RUNNING] = 1
    return stream, name


def run_null_clock(renderer: BlockRenderer, blocksize: int, stopped: Callable[[float], bool]) -> None:
    """'Play' a block per period of real time until `stopped(seconds)` (a wait) says so; a wake-up later than one
    block counts an underrun and, like a real device, the lost time is not made up."""
    buffer = renderer.buffer
    out = np.zeros((blocksize, buffer.channels), np.float32)
    period_s = blocksize / buffer.sample_rate
    deadline = time.monotonic()
    while True:
        renderer.render(out, blocksize)
        deadline += period_s
        if time.monotonic() - deadline > period_s:
            buffer.counters[LATE_BLOCKS] += 1
            deadline = time.monotonic()
        if stopped(max(0.0, deadline - time.monotonic())):
            return


def _null_process_main(buffer: LoopBuffer, renderer: BlockRenderer, blocksize: int, conn) -> None:
    """The null clock as the output process runs it: until STOP or the parent's death."""
    parent = multiprocessing.parent_process()
    buffer.counters[RUNNING] = 1
    conn.send(("started", NULL_DEVICE_NAME))

    def stopped(wait_s: float) -> bool:
        time.sleep(wait_s)
        return bool(buffer.counters[STOP]) or not parent.is_alive()

    run_null_clock(renderer, blocksize, stopped)


def _output_process_main(
    buffer_name: str, device, blocksize: int, record_name: str | None, record_frames: int, conn, null: bool = False
) -> None:
    """Entry of the output process: play until Playback sets STOP, the parent dies, or the stream dies (`null`: the
    null clock instead of a device). Ctrl-C reaches the whole process group: the parent decides when this process
    stops, so it ignores SIGINT. A parent killed while this process starts leaves nobody to report to (its pipe
    breaks, its shared memory may be gone): this process then ends quietly, without a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _play_output(buffer_name, device, blocksize, record_name, record_frames, conn, null)
    except (OSError, EOFError):
        if multiprocessing.parent_process().is_alive():
            raise


def _play_output(
    buffer_name: str, device, blocksize: int, record_name: str | None, record_frames: int, conn, null: bool
) -> None:
    # FIFO 1 for this thread and the ones PortAudio starts (they inherit it): above every normal process, so a CPU hog
    # never preempts this thread while it holds the GIL the callback needs, and below every audio thread, so setting
    # up (PortAudio probing devices, locking memory) never delays one, of this stream or of other JACK clients.
    realtime, note = acquire_realtime(1)
    buffer = LoopBuffer.attach(buffer_name)
    record_shm = shared_memory.SharedMemory(name=record_name) if record_name else None
    record = np.ndarray((record_frames, buffer.channels), np.float32, record_shm.buf) if record_shm else None
    stream, stream_died = None, False
    try:
        renderer = BlockRenderer(buffer, blocksize, record)
        if null:  # this thread is the clock
            locked = settle()
            if realtime:
                note = "clock " + acquire_realtime()[1]
            conn.send(("realtime", f"{note}; {locked}"))
            _null_process_main(buffer, renderer, blocksize, conn)
            return
        settled = []
        try:  # without RT, ask for PortAudio's larger margin (JACK's is its period whatever is asked)
            stream, device_name = _open_stream(
                renderer, device, blocksize, "low" if realtime else "high", lambda: settled.append(settle())
            )
        except PlaybackError as error:
            conn.send(("error", str(error)))
            return
        if realtime:
            note = f"{promote_callback_thread(lambda: renderer.native_id)}; process SCHED_FIFO 1"
        conn.send(("realtime", f"{note}; {settled[0]}"))
        conn.send(("started", device_name))
        parent = multiprocessing.parent_process()
        while not buffer.counters[STOP] and stream.active and parent.is_alive():
            time.sleep(0.02)
        stream_died = not buffer.counters[STOP] and not stream.active
        if stream_died:
            conn.send(("error", "the audio stream stopped on its own (device gone or JACK server stopped)"))
    finally:  # the shared memory mappings go with the process
        buffer.counters[RUNNING] = 0
        conn.close()
        if stream_died:  # without its server, PortAudio hangs in close and aborts in Pa_Terminate: skip both
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if stream is not None:
            stream.close(ignore_errors=True)


class Playback:
    """Plays `buffer` on `device` (index, name substring, or None for the default) until stop().

    record_path: exactly the frames that were played, streamed to a 16-bit WAV at the buffer's rate while they play
    (see recording.py: valid after a kill up to the last quarter second, renamed into place by stop(); the next
    free take number when the path is taken, `recording.path`; a full disk stops the take, `recording.error`)."""

    def __init__(
        self,
        buffer: LoopBuffer,
        device: str | int | None = None,
        blocksize: int = DEFAULT_BLOCKSIZE,
        mode: str = "process",
        record_path: str | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if blocksize <= 0:
            raise ValueError(f"blocksize must be positive, got {blocksize}")
        self.buffer, self.device, self.blocksize, self.mode, self.record_path = (
            buffer,
            device,
            blocksize,
            mode,
            record_path,
        )
        self.record_frames = max(blocksize, int(RING_SECONDS * buffer.sample_rate)) if record_path else 0
        if record_path:
            check_output_path(Path(record_path), "--record")
        self.recording: RecordingDrain | None = None
        self.device_name: str | None = None
        self.error: str | None = None
        self.realtime: str | None = None  # how the output (process, or null clock thread) is scheduled
        self._record_shm: shared_memory.SharedMemory | None = None
        self._record: np.ndarray | None = None
        self._process = self._conn = self._stream = self._clock = None
        self._clock_stop = threading.Event()
        self._started = self._stopped = False

    # --- start / stop ------------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._started:
            raise RuntimeError("this Playback was already started; make a new one")
        self._started = True
        if self.mode in SPAWNED and not _importable_by_name():
            log.warning(
                "this package was loaded from a file path (as ComfyUI does): the audio callback runs in a thread"
            )
            self.mode = "thread" if self.mode == "process" else "null"
        counters = self.buffer.counters
        counters[[STOP, RECORDED, LATE_BLOCKS, GAPS, CALLBACKS, RUNNING]] = 0
        counters[BLOCK] = self.blocksize
        self.buffer.reals[LATENCY_S] = 0.0
        self.buffer.reals[APPLIED_GAIN] = self.buffer.reals[GAIN]  # no fade-in from a stale volume
        self.buffer.reals[APPLIED_TRANSPORT] = self.buffer.reals[TRANSPORT]
        try:
            if self.record_path:
                self._allocate_recording()
            if self.mode in SPAWNED:
                self._start_process()
            elif self.mode == "thread":
                self._stream, self.device_name = _open_stream(
                    BlockRenderer(self.buffer, self.blocksize, self._record), self.device, self.blocksize
                )
            else:
                self.device_name = NULL_DEVICE_NAME
                self._clock = threading.Thread(target=self._clock_main, name="flowjam-null-clock", daemon=True)
                counters[RUNNING] = 1
                self._clock.start()
            if self._record is not None:  # the file is opened once the output runs: a failed start leaves none
                self.recording = RecordingDrain(
                    Path(self.record_path), self._record, self.buffer.counters, RECORDED, self.buffer.sample_rate
                )
                self.recording.start()
        except BaseException:  # e.g. the take's file cannot be written: no output is left playing
            self._stopped = True
            try:
                self._stop_output()
            finally:
                self._release_recording()
            raise

    def _allocate_recording(self) -> None:
        shape = (self.record_frames, self.buffer.channels)
        if self.mode in SPAWNED:  # pages are only committed as they are written, but they must fit /dev/shm
            needed = 4 * shape[0] * shape[1]
            try:
                free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
            except OSError:  # no /dev/shm (not Linux): nothing to check
                free = needed
            if free < needed:
                raise PlaybackError(
                    f"recording {shape[0] / self.buffer.sample_rate:.0f} s needs {needed >> 20} MiB of shared "
                    f"memory but /dev/shm has {free >> 20} MiB free; free some shared memory"
                )
            self._record_shm = shared_memory.SharedMemory(create=True, size=4 * shape[0] * shape[1])
            self._record = np.ndarray(shape, np.float32, self._record_shm.buf)
        else:
            self._record = np.zeros(shape, np.float32)

    def _start_process(self) -> None:
        _make_package_importable()
        context = multiprocessing.get_context("spawn")
        self._conn, child_conn = context.Pipe(duplex=False)
        record_name = self._record_shm.name if self._record_shm else None
        self._process = context.Process(
            target=_output_process_main,
            name="flowjam-audio-output",
            daemon=True,
            args=(self.buffer.name, self.device, self.blocksize, record_name, self.record_frames, child_conn),
            kwargs={"null": self.mode == "null-process"},
        )
        self._process.start()
        child_conn.close()
        deadline = time.monotonic() + _START_TIMEOUT_S
        kind = "realtime"
        while kind == "realtime":  # the process says how it is scheduled, then whether its output started
            if not self._conn.poll(max(0.0, deadline - time.monotonic())):
                self._end_process()
                raise PlaybackError(f"the audio output process did not start within {_START_TIMEOUT_S:.0f} s")
            try:
                kind, text = self._conn.recv()
            except EOFError:
                self._end_process()
                raise PlaybackError(
                    f"the audio output process died while starting (exit code {self._process.exitcode}). {LIST_HINT}"
                ) from None
            if kind == "realtime":
                self.realtime = text
                log_refusal(text)
        if kind == "error":
            self._end_process()
            raise PlaybackError(text)
        self.device_name = text

    def stop(self) -> None:
        """Stop playing (idempotent), then write the recording if one was asked for."""
        if not self._started or self._stopped:
            return
        self._stopped = True
        self._stop_output()
        try:
            if self.recording is not None:
                self.recording.finish()
        finally:
            self._release_recording()

    def _stop_output(self) -> None:
        """Stop whichever output started (none, if it failed to)."""
        self.buffer.counters[STOP] = 1
        if self._process is not None:
            self._end_process()
        elif self._stream is not None:
            if self._stream.active:  # a stream that died with its JACK server would hang in close: leave it be
                self._stream.close(ignore_errors=True)
        elif self._clock is not None:
            self._clock_stop.set()
            self._clock.join()
        self.buffer.counters[RUNNING] = 0

    def _end_process(self) -> None:
        self._process.join(timeout=5)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(timeout=5)
        self._poll_messages()
        self._conn.close()

    def _release_recording(self) -> None:
        """Free the ring; a take that never finished (a failed start) keeps its `.partial` file."""
        if self.recording is not None:
            self.recording.close_unfinished()
        self._record = None
        if self._record_shm is not None:
            self._record_shm.close()
            self._record_shm.unlink()
            self._record_shm = None

    def _clock_main(self) -> None:
        """Null mode: the null clock on a thread of this process, SCHED_FIFO where allowed (this thread only: it
        wakes on time under CPU load, though it still waits for the GIL like any thread here)."""
        realtime, note = acquire_realtime()
        self.realtime = note
        log_refusal(note)
        run_null_clock(BlockRenderer(self.buffer, self.blocksize, self._record), self.blocksize, self._clock_stop.wait)

    # --- state -------------------------------------------------------------------------------------------------

    def _poll_messages(self) -> None:
        try:
            while self._conn is not None and not self._conn.closed and self._conn.poll():
                kind, text = self._conn.recv()
                if kind == "error":
                    self.error = text
        except (EOFError, OSError):
            pass
        process = self._process
        if process is not None and not process.is_alive() and not self.buffer.counters[STOP] and self.error is None:
            self.error = f"the audio output process ended unexpectedly (exit code {process.exitcode})"

    @property
    def running(self) -> bool:
        if not self._started or self._stopped:
            return False
        if self._process is not None:
            self._poll_messages()
            alive = self._process.is_alive()
            if not alive:
                self.buffer.counters[RUNNING] = 0
            return alive and bool(self.buffer.counters[RUNNING])
        if self._stream is not None:
            active = self._stream.active
            if not active and self.error is None:
                self.error = "the audio stream stopped on its own (device gone or JACK server stopped)"
            return active
        return self._clock.is_alive()

    @property
    def playhead_frames(self) -> int:
        return self.buffer.playhead_frames

    @property
    def underruns(self) -> int:
        return self.buffer.underruns

    def stats(self) -> dict:
        running = self.running
        rate = self.buffer.sample_rate
        return {
            "mode": self.mode,
            "device": self.device_name,
            "running": running,
            "playhead_frames": self.playhead_frames,
            "playhead_s": self.playhead_frames / rate,
            "underruns": self.underruns,
            "late_blocks": self.buffer.late_blocks,  # of the underruns: the output came late (device or null clock)
            "gaps": self.buffer.gaps,  # of the underruns: silence because the engine fell behind
            "callbacks": self.buffer.callbacks,
            "latency_s": float(self.buffer.reals[LATENCY_S]),
            "realtime": self.realtime,
            "recorded_s": int(self.buffer.counters[RECORDED]) / rate if self.record_path else 0.0,
            "recording_error": self.recording.error if self.recording is not None else None,
            "error": self.error,
        }

    def __enter__(self) -> Playback:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _importable_by_name() -> bool:
    """Whether a spawned process can import this module by its name (not so when a host named it by file path)."""
    return all(part.isidentifier() for part in __name__.split("."))


def _make_package_importable() -> None:
    """The spawned output process imports this module by its package name, with the parent's sys.path. Hosts that
    load the package from a file path (ComfyUI's custom_nodes) do not put its folder's parent on sys.path: add it."""
    package = __name__.split(".")[0]
    root = str(Path(sys.modules[package].__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.append(root)
