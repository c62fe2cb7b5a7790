"""`flowjam listen`: plays a served session on this machine's sound card, and can record what arrived.

Chunks come over the WebSocket in bursts (the network's jitter); a small jitter buffer between the socket and the
audio callback starts playing once START_S of audio waits, and starts over (silence until START_S waits again) after
an underrun, so one late chunk costs one gap, not a crackle per block. The device's clock and the server's drift
apart slowly: more than MAX_BUFFER_S waiting drops the oldest frames, so the delay never grows.

`--out` records every frame that arrived, in order, whether or not it played (a missing chunk is a gap in the file
too, counted in the summary), to `<out>.partial` with a valid header at every moment, renamed into place at the end.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..engine.outputs import check_output_path
from ..live.playback import LIST_HINT, PlaybackError, find_device
from ..live.recording import WavStream, partial_path, recover_partial
from .client import Client
from .protocol import CHANNELS, SAMPLE_RATE

START_S = 0.15
MAX_BUFFER_S = 1.0
RECEIVE_TIMEOUT_S = 10.0  # no chunk for this long: the server stalled, stop listening


class JitterBuffer:
    """Frames between the socket (push) and the audio callback (pull); the lock is held for a copy at most."""

    def __init__(self, start_frames: int, max_frames: int, channels: int = CHANNELS):
        self.start_frames, self.max_frames, self.channels = start_frames, max_frames, channels
        self.underruns = 0  # callbacks that found too little audio (after playing had started)
        self.skipped_frames = 0  # frames dropped because more than max_frames waited
        self._blocks: deque[np.ndarray] = deque()
        self._offset = 0  # frames of the first block already played
        self._frames = 0
        self._playing = False
        self._finished = False  # no more audio will come: play out what waits, running dry is the end
        self._lock = threading.Lock()

    @property
    def frames(self) -> int:
        return self._frames

    def push(self, audio: np.ndarray) -> None:
        with self._lock:
            self._blocks.append(audio)
            self._frames += len(audio)
            while self._frames > self.max_frames:
                first = self._blocks[0]
                excess = min(self._frames - self.max_frames, len(first) - self._offset)
                self._advance(excess)
                self.skipped_frames += excess

    def finish(self) -> None:
        """No more audio will be pushed: what waits plays even if it is less than start_frames, and running dry
        from now on is the end of the stream, not an underrun."""
        with self._lock:
            self._finished = True

    def pull(self, out: np.ndarray) -> None:
        """Fill `out` [frames, channels] with the oldest waiting audio, or silence while (re)buffering."""
        with self._lock:
            if not self._playing and (self._frames >= self.start_frames or (self._finished and self._frames)):
                self._playing = True
            if not self._playing:
                out.fill(0.0)
                return
            filled = 0
            while filled < len(out) and self._blocks:
                first = self._blocks[0]
                take = min(len(out) - filled, len(first) - self._offset)
                out[filled : filled + take] = first[self._offset : self._offset + take]
                self._advance(take)
                filled += take
            if filled < len(out):
                out[filled:].fill(0.0)
                if not self._finished:
                    self.underruns += 1
                self._playing = False

    def _advance(self, frames: int) -> None:
        self._offset += frames
        self._frames -= frames
        if self._offset == len(self._blocks[0]):
            self._blocks.popleft()
            self._offset = 0


@dataclass
class ListenReport:
    chunks: int = 0
    frames: int = 0  # frames that arrived (and were recorded)
    dropped: int = 0  # chunks the server dropped because this client read too slowly
    gaps: int = 0  # places where the chunks' sample indices jumped
    missing_frames: int = 0  # frames those gaps skipped
    underruns: int = 0  # the jitter buffer ran dry while playing, or the device's callback came late
    skipped_frames: int = 0  # frames dropped because the device played slower than the server sent
    device: str | None = None  # what played (None: nothing did)
    ended: str | None = None  # why the server ended the stream, if it did

    def summary(self) -> str:
        ms = 1000.0 / SAMPLE_RATE
        line = (
            f"{self.frames / SAMPLE_RATE:.2f} s received in {self.chunks} chunks; {self.dropped} dropped by the server "
            f"(read too slowly), {self.gaps} gaps ({self.missing_frames * ms:.0f} ms missing)"
        )
        if self.device is not None:
            line += f", {self.underruns} underruns, {self.skipped_frames * ms:.0f} ms skipped (device slower)"
        return line + (f"; the server ended the stream: {self.ended}" if self.ended else "")


def listen(
    client: Client,
    session: str,
    seconds: float | None = None,
    out: Path | None = None,
    device: str | int | None = None,
    play: bool = True,
    on_message: Callable[[str], None] | None = None,
) -> ListenReport:
    """Play (and with `out` record) the session until `seconds` of its audio arrived, the server ends the stream,
    or Ctrl-C. `play=False`: record only, no sound card. Without a device named, a machine with no audio output
    records only (with a warning) when `out` is given."""
    if seconds is not None and not seconds > 0:
        raise ValueError(f"--seconds must be > 0 (leave it out to listen until Ctrl-C), got {seconds:g}")
    say = on_message or _print
    if out is not None:
        check_output_path(out, "--out")
    report = ListenReport()
    buffer = JitterBuffer(int(START_S * SAMPLE_RATE), int(MAX_BUFFER_S * SAMPLE_RATE))
    client.status(session)  # an unknown session fails here (ServerError 404), before a device or a file opens
    stream = client.stream(session)
    output = wav = None
    try:
        if play:
            try:
                output, report.device = _open_output(buffer, device)
            except PlaybackError as error:
                if device is not None or out is None:
                    raise
                say(f"no audio output ({error}); recording only")
        if out is not None:
            recover_partial(out)
            wav = WavStream(partial_path(out), CHANNELS, SAMPLE_RATE)
        try:
            _receive(stream, report, buffer, wav, seconds, say)
            buffer.finish()
            if output is not None:  # let what waits play out
                deadline = time.monotonic() + buffer.frames / SAMPLE_RATE + 0.5
                while buffer.frames and time.monotonic() < deadline:
                    time.sleep(0.02)
        except KeyboardInterrupt:  # Ctrl-C ends listening; the file and the summary still come
            pass
    finally:
        stream.close()
        if output is not None:
            output.stop()
            output.close()
        if wav is not None:
            wav.close()
            os.replace(wav.path, out)
    report.underruns, report.skipped_frames = buffer.underruns, buffer.skipped_frames
    return report


def _receive(stream, report: ListenReport, buffer: JitterBuffer, wav, seconds: float | None, say) -> None:
    wanted_frames = None if seconds is None else round(seconds * SAMPLE_RATE)
    expected: int | None = None
    while wanted_frames is None or report.frames < wanted_frames:
        try:
            item = stream.receive(RECEIVE_TIMEOUT_S)
        except TimeoutError:
            say(f"no audio from the server for {RECEIVE_TIMEOUT_S:g} s; stopping")
            return
        if item is None:
            return
        if isinstance(item, dict):
            if item.get("event") in ("ended", "lost"):
                report.ended = item.get("reason") or item.get("error")
            elif item.get("event") == "error":
                say(f"server: {item.get('error')}")
            continue
        audio = item.audio
        if wanted_frames is not None:
            audio = audio[: wanted_frames - report.frames]
        if expected is not None and item.sample != expected:
            report.gaps += 1
            report.missing_frames += max(0, item.sample - expected)
        expected = item.sample + item.frames
        report.chunks += 1
        report.frames += len(audio)
        report.dropped = item.dropped
        buffer.push(audio)
        if wav is not None:
            wav.append(audio)


def _open_output(buffer: JitterBuffer, device: str | int | None):
    """Open and start a float32 OutputStream at 48 kHz pulling from `buffer` -> (stream, device name)."""
    try:
        import sounddevice as sd
    except OSError as error:  # no PortAudio library on this machine
        raise PlaybackError(
            f"sounddevice cannot load PortAudio ({error}); install it (Debian: libportaudio2), or record "
            "without sound: --no-audio --out FILE"
        ) from None

    def callback(outdata: np.ndarray, frames: int, time_info, status) -> None:
        if status.output_underflow:  # the callback itself came late
            buffer.underruns += 1
        buffer.pull(outdata)

    try:
        stream = sd.OutputStream(
            samplerate=SAMPLE_RATE,
            device=find_device(device),
            channels=CHANNELS,
            dtype="float32",
            latency="low",
            callback=callback,
        )
    except (ValueError, sd.PortAudioError) as error:
        hint = "" if LIST_HINT in str(error) else f". {LIST_HINT}"
        raise PlaybackError(f"cannot open audio output {device!r}: {error}{hint}") from None
    try:
        stream.start()
    except sd.PortAudioError as error:
        stream.close(ignore_errors=True)
        raise PlaybackError(f"cannot start audio output {device!r}: {error}. {LIST_HINT}") from None
    info = sd.query_devices(stream.device)
    return stream, f"{info['name']} ({sd.query_hostapis(info['hostapi'])['name']})"


def _print(message: str) -> None:
    print(f"flowjam listen: {message}", file=sys.stderr, flush=True)
