"""Recordings that survive a kill, a second recorder and a full disk: what the audio callback played is streamed to a
WAV on disk as it plays.

The callback copies every played block into a ring (shared memory in process mode); a drain thread here moves the
new frames to `<name>.partial` beside the target every DRAIN_INTERVAL_S and rewrites the WAV header's sizes after
each append, so the file is a valid WAV at every moment: a SIGKILL loses at most the last drain interval. A clean
stop drains the rest and renames the file into place.

Takes, like a DAW's: a finished take is never overwritten (recording to `take.wav` when it exists writes
`take-2.wav`, then `take-3.wav`...). A recorder holds an OS lock (flock) on its `.partial` until it is renamed into
place; the lock goes with the process however it ends. So a second recorder to the same path takes the next number
instead of touching the first one's file, and a `.partial` nobody holds (its recorder died) is moved aside to
`<stem>.recovered-<time>.wav`, never overwritten.

A write that fails (a full disk) stops the take at once: the file is cut back to its last whole frame with a header
that says so, the error is kept in `RecordingDrain.error` and logged once, and the music plays on. Past 4 GB the
take goes on as RF64: the header reserves a JUNK chunk that becomes the ds64 chunk (EBU Tech 3306).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import logging
import os
import struct
import threading
import time
from pathlib import Path

import numpy as np

log = logging.getLogger("flowjam.recording")

DRAIN_INTERVAL_S = 0.25
RING_SECONDS = 30.0  # how far the drain may fall behind the callback before frames are lost (and counted)
RIFF_LIMIT_BYTES = 0xFFFFFFFF  # the largest RIFF size a 32-bit field holds; beyond it the header becomes RF64
HEADER_BYTES = 80  # RIFF or RF64 (12) + JUNK or ds64 (36) + fmt (24) + data (8)
_DS64_BYTES = 28
_UNKNOWN_SIZE = struct.pack("<I", 0xFFFFFFFF)
_PCM = 1
_WRITE_FIXES = {
    errno.ENOSPC: "free space on that disk",
    errno.EDQUOT: "free space on that disk (your quota is used up)",
    errno.EFBIG: "record to a disk that allows larger files (FAT32 stops at 4 GB)",
}


class TakeBusy(BlockingIOError):
    """Another recorder, alive in some process, holds this `.partial`."""


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def numbered(path: Path, number: int) -> Path:
    """Take `number` of `path`: take.wav, take-2.wav, take-3.wav..."""
    return path if number == 1 else path.with_name(f"{path.stem}-{number}{path.suffix}")


def wav_header(channels: int, sample_rate: int, frames: int, riff_limit_bytes: int = RIFF_LIMIT_BYTES) -> bytes:
    """The HEADER_BYTES header of a 16-bit PCM WAV holding `frames`: RIFF with a JUNK chunk held in reserve while its
    size fits `riff_limit_bytes`, else RF64 with the ds64 chunk in the JUNK's place (sizes 0xFFFFFFFF in 32 bits)."""
    block = channels * 2
    data_bytes = frames * block
    riff_bytes = HEADER_BYTES - 8 + data_bytes
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, _PCM, channels, sample_rate, sample_rate * block, block, 16)
    if riff_bytes <= riff_limit_bytes:
        junk = b"JUNK" + struct.pack("<I", _DS64_BYTES) + bytes(_DS64_BYTES)
        return b"RIFF" + struct.pack("<I", riff_bytes) + b"WAVE" + junk + fmt + b"data" + struct.pack("<I", data_bytes)
    ds64 = b"ds64" + struct.pack("<IQQQI", _DS64_BYTES, riff_bytes, data_bytes, frames, 0)
    return b"RF64" + _UNKNOWN_SIZE + b"WAVE" + ds64 + fmt + b"data" + _UNKNOWN_SIZE


def recover_partial(path: Path) -> Path | None:
    """Move aside a `.partial` of `path` that no live recorder holds and that holds something (a take cut off by a
    kill: a valid WAV up to its last drain); returns where it went."""
    partial = partial_path(path)
    try:
        file = _open_locked(partial, os.O_RDWR)
    except (FileNotFoundError, TakeBusy):
        return None
    with file:
        status = os.fstat(file.fileno())
        if status.st_size == 0:  # nothing to keep (or a recorder that is just starting)
            return None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(status.st_mtime))
        suffix = path.suffix or ".wav"
        target = path.with_name(f"{path.stem}.recovered-{stamp}{suffix}")
        counter = 1
        while target.exists():
            target = path.with_name(f"{path.stem}.recovered-{stamp}-{counter}{suffix}")
            counter += 1
        os.replace(partial, target)  # under the lock: no other recorder is moving or claiming it
    log.warning("an earlier recording to %s was cut off; what it holds was kept as %s", path, target)
    return target


def _open_locked(path: Path, flags: int) -> io.FileIO:
    """`path` opened unbuffered with `flags` (never truncated) and flock'ed by this open file; TakeBusy while another
    open file holds the lock."""
    while True:
        file = open(path, "r+b", buffering=0, opener=lambda name, _: os.open(name, flags, 0o666))
        try:
            fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.close()
            raise TakeBusy(
                errno.EWOULDBLOCK, "another recorder is writing this take; stop it or choose another path", str(path)
            ) from None
        if _is_at(file, path):
            return file
        file.close()  # moved or replaced between the open and the lock: lock what is there now


def _is_at(file: io.FileIO, path: Path) -> bool:
    """Whether `path` still names the file open in `file`."""
    try:
        named = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(file.fileno())
    return (named.st_dev, named.st_ino) == (opened.st_dev, opened.st_ino)


class WavStream:
    """A 16-bit PCM WAV that grows by appends and whose header always describes the whole frames on disk.

    It locks `path` until it is closed or renamed into place (TakeBusy if a live recorder holds it) and starts it
    empty: move a `.partial` worth keeping aside first (recover_partial). `riff_limit_bytes`: where the header turns
    RF64 (tests switch early)."""

    def __init__(self, path: Path, channels: int, sample_rate: int, riff_limit_bytes: int = RIFF_LIMIT_BYTES):
        self.path, self.channels, self.sample_rate = Path(path), channels, sample_rate
        self.riff_limit_bytes = riff_limit_bytes
        self.frames = 0
        self._block = channels * 2
        self._file = _open_locked(self.path, os.O_RDWR | os.O_CREAT)  # held open for the whole take
        try:
            self._file.truncate(0)
            self._write_at(0, self._header())
        except BaseException:
            self._file.close()
            raise

    def _header(self) -> bytes:
        return wav_header(self.channels, self.sample_rate, self.frames, self.riff_limit_bytes)

    def append(self, audio: np.ndarray) -> None:
        """Append float frames [N, channels] in [-1, 1] (clipped), then make the header count them. A failed write
        (a full disk) raises, with the file cut back to the whole frames that landed and the header counting them."""
        if not len(audio):
            return
        pcm = np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
        try:
            self._write_frames(pcm)
        except OSError:
            with contextlib.suppress(OSError):  # a disk that refuses even this keeps the previous, smaller header
                self._file.truncate(HEADER_BYTES + self.frames * self._block)
                self._write_at(0, self._header())
            raise
        self._write_at(0, self._header())

    def _write_frames(self, pcm: bytes) -> None:
        """Write `pcm` after the frames on disk; `frames` counts each whole frame that lands, even if a later
        write fails."""
        view, landed = memoryview(pcm), 0
        self._file.seek(HEADER_BYTES + self.frames * self._block)
        try:
            while landed < len(view):
                landed += self._file.write(view[landed:])
        finally:
            self.frames += landed // self._block

    def _write_at(self, offset: int, data: bytes) -> None:
        view = memoryview(data)
        self._file.seek(offset)
        while view:
            view = view[self._file.write(view) :]

    def rename_into_place(self, final: Path) -> None:
        """Sync, rename to `final` while still holding the lock (no recorder can take the name in between), close."""
        os.fsync(self._file.fileno())
        os.replace(self.path, final)
        self.path = final
        self._file.close()

    def discard(self) -> None:
        """Delete the file (while still locked, so no recorder that opened it meanwhile can keep it) and close."""
        self.path.unlink()
        self._file.close()

    def close(self) -> None:
        """Flush to disk and close (idempotent); the file stays where it is."""
        if not self._file.closed:
            os.fsync(self._file.fileno())
            self._file.close()


def open_take(path: Path, channels: int, sample_rate: int) -> tuple[Path, WavStream]:
    """(where the take will go, its open `.partial`): the first of take.wav, take-2.wav... that is neither a finished
    take nor being recorded. A `.partial` a dead recorder left on the way is recovered; a number is logged once."""
    taken = None  # why the path asked for was not used
    number = 0
    while True:
        number += 1
        take = numbered(path, number)
        recover_partial(take)
        if not take.exists():
            try:
                wav = WavStream(partial_path(take), channels, sample_rate)
            except TakeBusy:
                taken = taken or f"{take.name} is being recorded by another process"
                continue
            if not take.exists():
                if taken:
                    log.warning("recording to %s (%s)", take.name, taken)
                return take, wav
            wav.discard()  # its recorder renamed it into place between the two looks
        taken = taken or f"{take.name} exists"


class RecordingDrain:
    """Moves played frames from the callback's recording ring into a WavStream on a thread of its own.

    `path` is where the take goes once finished: the path asked for, or its next free number (see open_take)."""

    def __init__(self, path: Path, ring: np.ndarray, counters: np.ndarray, recorded_slot: int, sample_rate: int):
        self.sample_rate = sample_rate  # Playback checked the path before anything played
        self.path, self._wav = open_take(Path(path), ring.shape[1], sample_rate)
        self._ring, self._counters, self._recorded_slot = ring, counters, recorded_slot
        self._drained = 0
        self.lost_frames = 0
        self.error: str | None = None  # set when a write failed and the take stopped there
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="flowjam-recording", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def frames(self) -> int:
        """Frames on disk so far (what a kill now would leave)."""
        return self._wav.frames

    def _run(self) -> None:
        while self.error is None and not self._stop.wait(DRAIN_INTERVAL_S):
            self.drain()

    def drain(self) -> None:
        """Write every frame recorded since the last drain. A write that fails stops the take there (see error)."""
        with self._lock:
            if self.error is not None:
                return
            try:
                self._drain_ring()
            except OSError as failure:
                self._cut_short(failure)

    def _drain_ring(self) -> None:
        """Frames the ring already overwrote are counted as lost and written as silence, so the file stays in time
        with what was played."""
        recorded = int(self._counters[self._recorded_slot])
        size = self._ring.shape[0]
        behind = recorded - self._drained
        if behind > size:
            lost = behind - size
            self.lost_frames += lost
            log.warning(
                "recording fell %.1f s behind; %d frames were lost (written as silence)",
                behind / self.sample_rate,
                lost,
            )
            self._wav.append(np.zeros((lost, self._ring.shape[1]), np.float32))
            self._drained += lost
        start, end = self._drained % size, recorded % size
        if recorded == self._drained:
            return
        if start < end:
            self._wav.append(self._ring[start:end])
        else:
            self._wav.append(self._ring[start:])
            self._wav.append(self._ring[:end])
        self._drained = recorded

    def _cut_short(self, failure: OSError) -> None:
        seconds = self.frames / self.sample_rate
        self.error = (
            f"recording to {self.path} stopped at {seconds:.2f} s: {failure.strerror or failure}; the take keeps "
            f"those {seconds:.2f} s; {_WRITE_FIXES.get(failure.errno, 'check that disk')} to record again"
        )
        log.warning("%s", self.error)

    def _stop_thread(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def close_unfinished(self) -> None:
        """Stop draining and close the file where it is (a valid `.partial`); safe after finish()."""
        self._stop_thread()
        self._wav.close()

    def finish(self) -> Path:
        """Drain what is left, then rename the file into place (also after a failed write: it holds the take up to
        there); returns the final path."""
        self._stop_thread()
        self.drain()
        self._wav.rename_into_place(self.path)
        return self.path
