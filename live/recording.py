"""Recordings that survive a kill: what the audio callback played is streamed to a WAV on disk as it plays.

The callback copies every played block into a ring (shared memory in process mode); a drain thread here moves the
new frames to `<name>.partial` beside the target every DRAIN_INTERVAL_S and rewrites the WAV header's sizes after
each append, so the file is a valid WAV at every moment: a SIGKILL loses at most the last drain interval. A clean
stop drains the rest and renames the file into place; a `.partial` left by a killed take is moved aside to
`<stem>.recovered-<time>.wav` the next time the same path is recorded to, never overwritten.
"""

from __future__ import annotations

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
_HEADER_BYTES = 44
_PCM = 1


def partial_path(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def recover_partial(path: Path) -> Path | None:
    """Move a `.partial` left by a killed take aside (it is a valid WAV); returns where it went."""
    partial = partial_path(path)
    if not partial.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(partial.stat().st_mtime))
    target = path.with_name(f"{path.stem}.recovered-{stamp}{path.suffix or '.wav'}")
    counter = 1
    while target.exists():
        target = path.with_name(f"{path.stem}.recovered-{stamp}-{counter}{path.suffix or '.wav'}")
        counter += 1
    os.replace(partial, target)
    log.warning("an earlier recording to %s was cut off; what it holds was kept as %s", path, target)
    return target


class WavStream:
    """A 16-bit PCM WAV that grows by appends and whose header always describes the frames already on disk."""

    def __init__(self, path: Path, channels: int, sample_rate: int):
        self.path, self.channels, self.sample_rate = path, channels, sample_rate
        self.frames = 0
        self._file = open(path, "wb")  # held open for the whole take
        self._file.write(self._header(0))
        self._file.flush()

    def _header(self, data_bytes: int) -> bytes:
        channels, rate = self.channels, self.sample_rate
        fmt = struct.pack("<HHIIHH", _PCM, channels, rate, rate * channels * 2, channels * 2, 16)
        riff = b"RIFF" + struct.pack("<I", 36 + data_bytes) + b"WAVE"
        return riff + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + struct.pack("<I", data_bytes)

    def append(self, audio: np.ndarray) -> None:
        """Append float frames [N, channels] in [-1, 1] (clipped), then make the header count them."""
        if not len(audio):
            return
        pcm = np.round(np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2")
        self._file.seek(0, os.SEEK_END)
        self._file.write(pcm.tobytes())
        self.frames += len(audio)
        data_bytes = self.frames * self.channels * 2
        self._file.seek(4)
        self._file.write(struct.pack("<I", 36 + data_bytes))
        self._file.seek(40)
        self._file.write(struct.pack("<I", data_bytes))
        self._file.flush()

    def close(self) -> None:
        """Flush to disk and close (idempotent)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()


class RecordingDrain:
    """Moves played frames from the callback's recording ring into a WavStream on a thread of its own."""

    def __init__(self, path: Path, ring: np.ndarray, counters: np.ndarray, recorded_slot: int, sample_rate: int):
        self.path, self.sample_rate = Path(path), sample_rate  # Playback checked the path before anything played
        self._ring, self._counters, self._recorded_slot = ring, counters, recorded_slot
        recover_partial(self.path)
        self._wav = WavStream(partial_path(self.path), ring.shape[1], sample_rate)
        self._drained = 0
        self.lost_frames = 0
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
        while not self._stop.wait(DRAIN_INTERVAL_S):
            self.drain()

    def drain(self) -> None:
        """Write every frame recorded since the last drain; frames the ring already overwrote are counted as lost
        and written as silence, so the file stays in time with what was played."""
        with self._lock:
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

    def close_unfinished(self) -> None:
        """Stop draining and close the file where it is (a valid `.partial`); safe after finish()."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._wav.close()

    def finish(self) -> Path:
        """Drain what is left, close the file and rename it into place; returns the final path."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.drain()
        self._wav.close()
        os.replace(self._wav.path, self.path)
        return self.path
