"""A windowed stream (`Session.stream(window_s=W)`): requests made for the whole song run on a window of W frames at
a write point, and delivered windows are merged into the song's timeline (`windows.py`, `walker.py`), so a tick
costs the window, not the song. The live runner walks the same way (live/runner.py)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..sampling.curves import frame_view
from .pipeline import StreamPipeline
from .requests import CURVE_FIELDS, Finished, SlotRequest
from .walker import WindowWalker
from .windows import Timeline, cyclic_crop, place_window, ring_frames, window_frames

FRAME_CURVES = CURVE_FIELDS - {"latent_mask", "initial_noise"}  # the window sets these two itself
"""Request fields that may be per-frame curves: a song-long one is read at each window's place."""
WINDOW_INPUTS = (
    "source_latents",
    "latent_mask",
    "initial_noise",
)  # the walker's, or none before the timeline holds any


class WindowedStream:
    """A pipeline whose requests are placed on a timeline: `submit(request, at_frame)` then `tick(frozen_frame)`."""

    def __init__(self, pipeline: StreamPipeline, walker: WindowWalker):
        self.pipeline, self._walker = pipeline, walker
        self._filled_from: torch.Tensor | None = None

    @staticmethod
    def over(
        pipeline: StreamPipeline,
        window_s: float,
        song_frames: int | None,
        device: torch.device,
        dtype: torch.dtype,
        option: str = "--window-seconds",
    ) -> WindowedStream | None:
        """Windows of `window_s` on `pipeline` over a song of `song_frames` (None: endless, its timeline a ring of
        `ring_frames`); None where requests run whole (W = 0, or W at least the song). `option`: the caller's name
        for W in errors."""
        window = window_frames(window_s, song_frames, option)
        if window is None:
            return None
        channels = pipeline.decoder.config.audio_acoustic_hidden_dim
        walker = WindowWalker(ring_frames(window, song_frames), window, channels, device, dtype, song_frames is None)
        return WindowedStream(pipeline, walker)

    @property
    def timeline(self) -> Timeline:
        """The song's newest latent at every frame (`timeline.snapshot()` for the song so far)."""
        return self._walker.timeline

    @property
    def window_frames(self) -> int:
        return self._walker.window

    def submit(
        self, request: SlotRequest, supersedes: bool = False, at_frame: int = 0, denoise: float | None = None
    ) -> None:
        """Run `request`, made for the whole song (its context, x0 target and per-frame curves song-long), on the
        window whose generated part starts at latent frame `at_frame` (the frames before it in the window are kept
        from the timeline, held by the window's own latent mask). A song-long `source_latents` (a cover) is what
        the timeline starts from, the first time that tensor is submitted. `denoise`: how far the generated frames
        the timeline already holds are re-noised (the live `denoise` knob; a text-only request is made with 1);
        None: the request's."""
        timeline = self._walker.timeline
        if request.frames != timeline.ring:
            raise ValueError(
                f"a windowed stream takes requests for its whole song ({timeline.ring} frames), got {request.frames}; "
                "make the request with the song's seconds"
            )
        if request.source_latents is not None and request.source_latents is not self._filled_from:
            self._walker.fill(request.source_latents)
            self._filled_from = request.source_latents
        place = place_window(at_frame, self._walker.window)
        denoise = request.denoise if denoise is None else denoise
        inputs = self._walker.inputs(
            place, request.context_latents, request.x0_target, denoise, request.steps, request.shift
        )
        for name in WINDOW_INPUTS:
            inputs.setdefault(name, None)
        curves = {
            name: cyclic_crop(frame_view(value), place.start, place.frames)[0, :, 0]
            for name in FRAME_CURVES
            if isinstance(value := getattr(request, name), torch.Tensor) and value.numel() == timeline.ring
        }
        denoise = denoise if inputs["source_latents"] is not None else 1.0
        self.pipeline.submit(replace(request, denoise=denoise, **inputs, **curves), supersedes)

    def tick(self, frozen_frame: int = 0) -> list[Finished]:
        """One tick; its delivered windows are merged into the timeline after `frozen_frame` (frames before it are
        final: already heard, say) and returned."""
        finished = self.pipeline.tick()
        self._walker.land(finished, frozen_frame)
        return finished
