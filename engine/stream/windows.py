"""Windows on a timeline: generation that walks with the playhead, so a tick costs the window, not the song.

A loop, or an endless song, is a timeline of latent frames. A windowed stream asks for W frames at a time, placed
at the playhead (`place_window`): the window's first `keep` frames are kept (the frames already on the timeline,
held exactly by the request's latent mask) and the rest is generated. `Timeline` holds the newest latent of every
frame in a ring on the device: the loop itself, or, for endless play, the window plus headroom, where a position
is reused once the playhead has passed it. Frames before its frozen frontier (where the writer last started
writing audio) never change again; a window delivered later only lands after it (`Timeline.merge`).

Why the latent mask and not ACE-Step's repaint context: the repaint task gives kept frames through the context
channels, which a cover source and the 5 Hz LM's structure already fill (`is_cover` hints); the mask works in
every mode and holds kept frames bit for bit (its last step takes x0 = source there)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..params import DEFAULT_WINDOW_SECONDS, LATENT_RATE_HZ, MAX_SONG_SECONDS, MIN_WINDOW_SECONDS

KEEP_FRACTION = 0.5  # of a window: context kept behind the write point; the rest reaches ahead of the playhead
ENDLESS_HEADROOM_SECONDS = 10.0  # endless ring beyond the window: the audio behind the window's start still playing


def check_window_seconds(seconds: float, option: str = "--window-seconds") -> float:
    """A window length in seconds, 0 (whole-loop generation) or MIN_WINDOW_SECONDS..MAX_SONG_SECONDS."""
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{option} must be a finite number >= 0 (0: the whole loop), got {seconds:g}")
    if 0 < seconds < MIN_WINDOW_SECONDS or seconds > MAX_SONG_SECONDS:
        raise ValueError(
            f"{option} {seconds:g} is outside {MIN_WINDOW_SECONDS:g}..{MAX_SONG_SECONDS:g} s; use 0 for the whole "
            f"loop, or e.g. {option} {DEFAULT_WINDOW_SECONDS:g}"
        )
    return seconds


def window_frames(window_s: float, song_frames: int | None, option: str = "--window-seconds") -> int | None:
    """W in latent frames, or None for whole-loop generation (W = 0, or a loop no longer than the window).
    `song_frames`: the loop's length, None for endless play (which always walks); `option`: the caller's name for W
    in errors."""
    frames = round(check_window_seconds(window_s, option) * LATENT_RATE_HZ)
    if frames == 0:
        if song_frames is None:
            raise ValueError(f"endless play needs a window: give {option}, e.g. {DEFAULT_WINDOW_SECONDS:g}")
        return None
    return frames if song_frames is None or frames < song_frames else None


def ring_frames(window: int, song_frames: int | None) -> int:
    """Frames of the timeline's ring: the loop, or for endless play the window plus headroom."""
    return song_frames if song_frames is not None else window + round(ENDLESS_HEADROOM_SECONDS * LATENT_RATE_HZ)


@dataclass(frozen=True)
class WindowPlace:
    """Where one request's frames lie on the timeline."""

    start: int  # absolute timeline frame of the window's first frame
    frames: int  # W
    keep: int  # the window's leading frames that are kept (the rest is generated)

    @property
    def write_frame(self) -> int:
        """The first generated frame: where the writer is expected to start writing this window's audio."""
        return self.start + self.keep


def place_window(write_frame: int, frames: int, keep_fraction: float = KEEP_FRACTION) -> WindowPlace:
    """A window of `frames` whose generated part starts at `write_frame` (absolute), with up to
    `keep_fraction` of it kept behind (less at the very start of the timeline)."""
    write_frame = max(0, int(write_frame))
    keep = min(write_frame, int(frames * keep_fraction))
    return WindowPlace(write_frame - keep, frames, keep)


def _ring_runs(start: int, count: int, ring: int) -> list[tuple[int, int, int]]:
    """(ring position, window offset, length) of the at most two contiguous runs frames start..start+count-1
    occupy in a ring of `ring` frames."""
    runs, offset = [], 0
    while offset < count:
        position = (start + offset) % ring
        length = min(count - offset, ring - position)
        runs.append((position, offset, length))
        offset += length
    return runs


def cyclic_crop(frames_of: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """[1, count, C] of a [1, N, C] tensor from absolute frame `start`, its frames taken cyclically (mod N): a
    loop-length context, target or curve read at a window's place."""
    ring = frames_of.shape[1]
    return torch.cat([frames_of[:, p : p + n] for p, _, n in _ring_runs(start, count, ring)], dim=1)


class Timeline:
    """The newest latent of every timeline frame, in a ring of `ring` frames on the device. `endless`: a ring
    position holds only the absolute frame last written there (else, in a loop, every lap of the frame)."""

    def __init__(self, ring: int, channels: int, device: torch.device, dtype: torch.dtype, endless: bool):
        self.ring, self.endless = ring, endless
        self.latents = torch.zeros(1, ring, channels, device=device, dtype=dtype)
        self.frame_at = torch.full((ring,), -1, dtype=torch.int64)  # absolute frame each position holds; -1: none
        self.frozen = 0  # frames before this absolute frame never change again
        self.version = 0  # grows with every merge

    def check_fits(self, place: WindowPlace) -> None:
        if place.frames > self.ring:
            raise ValueError(f"a window of {place.frames} frames does not fit a timeline ring of {self.ring}")

    def holds(self, place: WindowPlace) -> torch.Tensor:
        """[W] bool: which of the window's frames the timeline has a latent for."""
        held = torch.empty(place.frames, dtype=torch.bool)
        for position, offset, length in _ring_runs(place.start, place.frames, self.ring):
            at = self.frame_at[position : position + length]
            if self.endless:
                wanted = torch.arange(place.start + offset, place.start + offset + length)
                held[offset : offset + length] = at == wanted
            else:
                held[offset : offset + length] = at >= 0
        return held

    def window(self, place: WindowPlace) -> torch.Tensor:
        """[1, W, C]: the timeline's latents over the window (a new tensor)."""
        return cyclic_crop(self.latents, place.start, place.frames)

    def merge(self, latent: torch.Tensor, place: WindowPlace) -> int:
        """Write a delivered window's generated frames that lie at or after the frozen frontier; -> frames written."""
        self.check_fits(place)
        first = max(place.keep, self.frozen - place.start)
        if first >= place.frames:
            return 0
        for position, offset, length in _ring_runs(place.start + first, place.frames - first, self.ring):
            source = first + offset
            self.latents[:, position : position + length] = latent[:, source : source + length]
            absolute = place.start + source
            self.frame_at[position : position + length] = torch.arange(absolute, absolute + length)
        self.version += 1
        return place.frames - first

    def fill(self, latents: torch.Tensor) -> None:
        """Start a loop's timeline from whole-loop latents [1, ring, C] (a source's)."""
        self.latents.copy_(latents)
        self.frame_at = torch.arange(self.ring)
        self.version += 1

    def freeze(self, frame: int) -> None:
        """Frames before absolute `frame` are final (their audio is written): no later merge changes them."""
        self.frozen = max(self.frozen, int(frame))

    def snapshot(self, unwritten: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the ring's latents (for the writer's thread, while merges go on here); `unwritten` [1, ring, C]
        gives the frames never written (silence, say: the ring's zeros are not)."""
        copy = self.latents.clone()
        if unwritten is not None:
            never = (self.frame_at < 0).to(copy.device)
            copy[:, never] = unwritten[:, never].to(copy.dtype)
        return copy
