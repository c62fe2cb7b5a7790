"""Windowed VAE decodes: which latent frames a window needs (`plan_window`, pure), and `WindowDecoder`, which
decodes windows as CUDA-graph replays, one graph per window shape, so a short window costs its work rather than
the launch overhead of the VAE's hundreds of kernels."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..params import LATENT_RATE_HZ
from ..stream.tick_graph import StaticTensors, TickGraphs

WINDOW_GRAPHS = 16  # window shapes kept captured (least recently used dropped first)
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


class WindowDecoder:
    """Windowed decodes of a VAE for one thread at a time: on a GPU the first decode of a window shape runs plain,
    the second is captured, later ones replay it; elsewhere (or with `capture=False`) every decode runs plain
    through the same static tensors. Returns a new tensor each call: the same audio as `Session.decode`."""

    def __init__(self, vae: nn.Module, device: torch.device, dtype: torch.dtype, capture: bool = True):
        self.vae, self.dtype = vae, dtype
        self.hop = vae.hop_samples
        self._static = StaticTensors(device)
        self._graphs = TickGraphs(device, capture=capture, capacity=WINDOW_GRAPHS)
        self.last_was_warm_up = False  # the last decode ran a new window shape plain or captured it

    @property
    def counters(self):
        return self._graphs.counters

    def __call__(
        self, latent: torch.Tensor, t_start: float, window_s: float, margin_frames: int, cyclic: bool = True
    ) -> torch.Tensor:
        """Stereo float audio [2, keep * hop] of the window (see `plan_window`)."""
        window = plan_window(latent.shape[1], t_start, window_s, margin_frames, cyclic)
        shape = (1, window.input_frames, latent.shape[-1])
        static_in = self._static.get("latent", shape, self.dtype)
        static_out = self._static.get("audio", (2, window.keep * self.hop), torch.float32)
        at = 0
        for lo, hi in window.segments:
            static_in.narrow(1, at, hi - lo).copy_(latent[:, lo:hi])
            at += hi - lo
        kept = window.kept_samples(self.hop)

        def decode() -> None:
            audio = self.vae.decode(static_in.transpose(1, 2))[0]
            static_out.copy_(audio[:, kept])

        counters = self._graphs.counters
        before = (counters.new_plans, counters.captures)
        with torch.no_grad():
            self._graphs.run((shape, kept.start), decode, capture=window_s <= MAX_CAPTURED_WINDOW_S)
        self.last_was_warm_up = (counters.new_plans, counters.captures) != before
        return static_out.clone()

    def warm_up(self, latent: torch.Tensor, windows_s: tuple[float, ...], margin_frames: int) -> None:
        """Run and capture these window lengths now, so no later decode of them pays for it (nothing to do where
        decodes are not captured)."""
        if not self._graphs.capture:
            return
        for window_s in windows_s:
            for _ in range(2):
                self(latent, 0.0, window_s, margin_frames)
