"""Windowed VAE decodes: which latent frames a window needs (`plan_window`, pure), and `WindowDecoder`, which
decodes windows as CUDA-graph replays, one graph per window shape and batch size, so a short window costs its work
rather than the launch overhead of the VAE's hundreds of kernels, and the windows of several sessions one launch."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..params import LATENT_RATE_HZ
from ..stream.tick_graph import StaticTensors, TickGraphs

WINDOW_GRAPHS = 48  # window shapes (lengths by batch rows) kept captured (least recently used dropped first)
MAX_CAPTURED_WINDOW_S = 1.6  # longer windows (a loop that fell behind, a whole-loop fill) always decode plain


@dataclass(frozen=True)
class WindowPlan:
    """A window of `keep` frames from frame `start`, decoded from `segments` (latent frame ranges, in order) that
    include `left` frames of context before it (and the rest after it)."""

    start: int
    keep: int
    left: int
    segments: tuple[tuple[int, int], ...]

    @property
    def input_frames(self) -> int:
        return sum(hi - lo for lo, hi in self.segments)

    def frames_of(self, latent: torch.Tensor) -> torch.Tensor:
        """The decoder's input frames [1, input_frames, 64] of a latent [1, T, 64]."""
        pieces = [latent[:, lo:hi] for lo, hi in self.segments]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)

    def kept_samples(self, hop: int) -> slice:
        """The kept window's samples in the decoded audio."""
        return slice(self.left * hop, (self.left + self.keep) * hop)


def plan_window(frames: int, t_start: float, window_s: float, margin_frames: int, cyclic: bool) -> WindowPlan:
    """`window_s` seconds from `t_start` of a `frames`-long latent with `margin_frames` of context each side; cyclic
    windows wrap across the loop seam (context included), others are clamped into the latent."""
    if window_s is None or window_s <= 0:
        raise ValueError(f"window_s must be > 0 for a windowed decode, got {window_s}")
    if margin_frames < 0:
        raise ValueError(f"margin_frames must be >= 0, got {margin_frames}")
    keep = min(frames, max(1, math.ceil(window_s * LATENT_RATE_HZ)))
    start = int(t_start * LATENT_RATE_HZ)
    if not cyclic:
        start = min(max(start, 0), frames - keep)
        lo, hi = max(0, start - margin_frames), min(frames, start + keep + margin_frames)
        return WindowPlan(start, keep, start - lo, ((lo, hi),))
    start %= frames
    position, end = start - margin_frames, start + keep + margin_frames
    segments = []
    while position < end:
        offset = position % frames
        length = min(frames - offset, end - position)
        segments.append((offset, offset + length))
        position += length
    return WindowPlan(start, keep, margin_frames, tuple(segments))


def batch_rows(count: int) -> int:
    """The rows a batch of `count` windows is decoded with: the next power of two, so a few captured shapes serve
    every count."""
    if count < 1:
        raise ValueError(f"a batch needs at least one window, got {count}")
    return 1 << (count - 1).bit_length()


class WindowDecoder:
    """Windowed decodes of a VAE for one thread at a time: on a GPU the first decode of a window shape runs plain,
    the second is captured, later ones replay it; elsewhere (or with `capture=False`) every decode runs plain
    through the same static tensors. Several latents' windows of one length decode as one batch (`decode_many`).
    Returns a new tensor each call: the same audio as `Session.decode`."""

    def __init__(self, vae: nn.Module, device: torch.device, dtype: torch.dtype, capture: bool = True):
        self.vae, self.dtype = vae, dtype
        self.hop = vae.hop_samples
        self._static = StaticTensors(device)
        self._graphs = TickGraphs(device, capture=capture, capacity=WINDOW_GRAPHS)
        self.last_was_warm_up = False  # the last decode ran a new window shape plain or captured it

    @property
    def counters(self):
        return self._graphs.counters

    @property
    def captures(self) -> bool:
        return self._graphs.capture

    def __call__(
        self, latent: torch.Tensor, t_start: float, window_s: float, margin_frames: int, cyclic: bool = True
    ) -> torch.Tensor:
        """Stereo float audio [2, keep * hop] of the window (see `plan_window`)."""
        return self.decode_many([latent], [t_start], window_s, margin_frames, cyclic)[0]

    def decode_many(
        self,
        latents: list[torch.Tensor],
        starts_s: list[float],
        window_s: float,
        margin_frames: int,
        cyclic: bool = True,
    ) -> torch.Tensor:
        """Stereo float audio [len(latents), 2, keep * hop]: each latent's window of `window_s` from its start, in
        one decode. Every window must need as many input frames (latents no shorter than the window)."""
        if len(latents) != len(starts_s):
            raise ValueError(f"{len(latents)} latents but {len(starts_s)} window starts")
        windows = [plan_window(z.shape[1], t, window_s, margin_frames, cyclic) for z, t in zip(latents, starts_s)]
        first = windows[0]
        if any((w.input_frames, w.left, w.keep) != (first.input_frames, first.left, first.keep) for w in windows):
            raise ValueError(
                f"windows of one batch must have one length: {window_s} s is longer than some latents "
                f"({sorted({z.shape[1] for z in latents})} frames); decode those apart"
            )
        rows = batch_rows(len(latents))
        shape = (rows, first.input_frames, latents[0].shape[-1])
        static_in = self._static.get("latent", shape, self.dtype)
        static_out = self._static.get("audio", (rows, 2, first.keep * self.hop), torch.float32)
        for row, (latent, window) in enumerate(zip(latents, windows)):
            at = 0
            for lo, hi in window.segments:
                static_in[row].narrow(0, at, hi - lo).copy_(latent[0, lo:hi])
                at += hi - lo
        kept = first.kept_samples(self.hop)

        def decode() -> None:
            static_out.copy_(self.vae.decode(static_in.transpose(1, 2))[:, :, kept])

        counters = self._graphs.counters
        before = (counters.new_plans, counters.captures)
        with torch.no_grad():
            self._graphs.run((shape, kept.start), decode, capture=window_s <= MAX_CAPTURED_WINDOW_S)
        self.last_was_warm_up = (counters.new_plans, counters.captures) != before
        return static_out[: len(latents)].clone()

    def warm_up(
        self, latent: torch.Tensor, windows_s: tuple[float, ...], margin_frames: int, rows: tuple[int, ...] = (1,)
    ) -> None:
        """Run and capture these window lengths, in batches of these rows, now, so no later decode of them pays for
        it (nothing to do where decodes are not captured)."""
        if not self._graphs.capture:
            return
        for count in rows:
            for window_s in windows_s:
                for _ in range(2):
                    self.decode_many([latent] * count, [0.0] * count, window_s, margin_frames)
