"""The wire format shared by the server and its clients: audio chunks (binary WebSocket messages) and the JSON
control messages. Audio is 48 kHz stereo, 16-bit little-endian, interleaved, after a fixed header.

Flow control: a client sends {"ack": sample} (the sample after the last chunk it has taken) every ACK_EVERY chunks.
The server keeps at most ACK_WINDOW_FRAMES of audio sent and not yet acknowledged to a client that acknowledges: while
that much is in flight, new chunks are dropped and counted in the header; once the client has acknowledged what was
sent, the live audio goes again. So a stalled client's backlog stays bounded wherever it builds (a proxy's queue, the
kernel's), and a client that catches up late is never left waiting. A client that never acknowledges is sent
everything."""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

SAMPLE_RATE = 48_000
CHANNELS = 2
MAGIC = b"FJA1"
HEADER = struct.Struct("<4sQIII")  # magic, sample index, loop position, frames, dropped chunks so far
ACK_EVERY = 4  # a client acknowledges every 4th chunk: {"ack": the sample after it} (200 ms)
CLOSE_MESSAGE = '{"close": true}'  # a client's request that the server end its stream and close it
ACK_WINDOW_FRAMES = 2 * SAMPLE_RATE  # a client that acknowledges has at most 2 s of audio unacknowledged


@dataclass(frozen=True)
class AudioChunk:
    sample: int  # frames played by the session before this chunk's first frame (its playhead, monotonic)
    position: int  # where in the loop the chunk starts (frames)
    dropped: int  # chunks this subscriber lost so far because it read too slowly (oldest dropped first)
    audio: np.ndarray  # [frames, 2] float32 in [-1, 1]

    @property
    def frames(self) -> int:
        return int(self.audio.shape[0])


def encode_chunk(audio: np.ndarray, sample: int, position: int, dropped: int = 0) -> bytes:
    """[frames, 2] float32 -> header + int16 PCM (clipped to full scale)."""
    if audio.ndim != 2 or audio.shape[1] != CHANNELS:
        raise ValueError(f"audio must be [frames, {CHANNELS}], got shape {tuple(audio.shape)}")
    pcm = np.clip(np.rint(audio * 32767.0), -32768, 32767).astype("<i2")
    return HEADER.pack(MAGIC, sample, position, audio.shape[0], dropped) + pcm.tobytes()


def chunk_span(data: bytes) -> tuple[int, int]:
    """An encoded chunk's (sample index, frames), read from its header alone."""
    _, sample, _, frames, _ = HEADER.unpack_from(data)
    return sample, frames


def with_more_dropped(data: bytes, dropped: int) -> bytes:
    """The chunk with `dropped` more chunks counted in its header (dropped on the way, after the host)."""
    magic, sample, position, frames, before = HEADER.unpack_from(data)
    return HEADER.pack(magic, sample, position, frames, before + dropped) + data[HEADER.size :]


def decode_chunk(data: bytes) -> AudioChunk:
    if len(data) < HEADER.size:
        raise ValueError(f"an audio chunk needs a {HEADER.size}-byte header, got {len(data)} bytes")
    magic, sample, position, frames, dropped = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"not a flowjam audio chunk (magic {magic!r}, expected {MAGIC!r})")
    body = len(data) - HEADER.size
    if body != frames * CHANNELS * 2:
        raise ValueError(f"audio chunk of {frames} frames needs {frames * CHANNELS * 2} bytes of PCM, got {body}")
    pcm = np.frombuffer(data, "<i2", offset=HEADER.size).reshape(frames, CHANNELS)
    return AudioChunk(sample, position, dropped, pcm.astype(np.float32) / 32767.0)
