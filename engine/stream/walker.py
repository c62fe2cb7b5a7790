"""The window walker: a stream's requests placed on a timeline at the playhead (`windows.py`), so a tick costs the
window, not the loop, and a loop can be any length or endless. The live runner (live/runner.py) and `bench tick
--window-seconds` walk with it.

Each request covers W frames whose generated part starts where the writer is expected to write when it is delivered
(playhead + lead + its steps' ticks); the frames before are kept, held by the latent mask. Frames the timeline has
no latent for yet start from noise; the rest is denoised from the timeline (the feedback loop a whole-loop stream
runs on the whole loop). Delivered windows are merged after the frozen frontier, and the writer decodes the
timeline. Loop-length inputs (the source's hints, LM structure, x0 target, per-frame shared curves) are read at
each window's place, cyclically: an endless stream repeats its structure every loop of it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..sampling.curves import frame_view
from ..sampling.schedule import timestep_schedule
from .requests import FINITE_CHECKS, Finished
from .windows import Timeline, WindowPlace, cyclic_crop, place_window


class WindowWalker:
    def __init__(self, ring: int, window: int, channels: int, device: torch.device, dtype: torch.dtype, endless: bool):
        """`ring`: the loop's frames (or an endless stream's ring); `window`: W frames."""
        self.window = window
        self.timeline = Timeline(ring, channels, device, dtype, endless)
        self._inputs: tuple[tuple, dict[str, Any]] | None = None  # the last window's tensors, by what made them
        self._frame_curves: dict[str, torch.Tensor] = {}  # per-frame shared curves over the loop
        self._curves_at: WindowPlace | None = None  # the place they were last read at
        self._curves: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None  # the last window curves, by value

    def place(self, write_sample: int, hop: int) -> WindowPlace:
        """The window whose generated part starts at the latent frame holding audio sample `write_sample`."""
        return place_window(-(-write_sample // hop), self.window)

    def inputs(
        self,
        place: WindowPlace,
        context: torch.Tensor,
        target: torch.Tensor | None,
        denoise: float,
        steps: int,
        shift: float,
    ) -> dict[str, Any]:
        """A window's request fields: context, x0 target, and (once the timeline holds any of its frames) the
        source, latent mask and starting noise. Made again only when something they depend on changed; the crops
        are `derived` from the song's tensors, so a stream checks those for NaN once, not each new window."""
        timeline = self.timeline
        target_key = None if target is None else (id(target), target._version)  # versions: changed in place
        key = (place, timeline.version, id(context), context._version, target_key, denoise, steps, shift)
        if self._inputs is not None and self._inputs[0] == key:
            return self._inputs[1]
        inputs: dict[str, Any] = {
            "context_latents": _crop(context, place),
            "x0_target": None if target is None else _crop(target, place),
            "window": place,
        }
        held = timeline.holds(place)
        if held.any():
            inputs["source_latents"] = timeline.window(place)
            FINITE_CHECKS.derived(inputs["source_latents"])  # the engine's latents and a source checked at `fill`
            start_t = timestep_schedule(steps, shift, denoise)[0]
            inputs["latent_mask"], inputs["initial_noise"] = self._window_curves(place, held, start_t)
        self._inputs = (key, inputs)
        return inputs

    def _window_curves(
        self, place: WindowPlace, held: torch.Tensor, start_t: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(latent mask, starting noise level) over a window: the kept frames the timeline holds are masked out;
        frames never generated start from noise, the others at the schedule's start (always given, held frames or
        not, so every window request has the same curves: one tick plan, not one per mix of windows). The same
        tensors come back while their values repeat (a steady walk: every window alike), so the pipeline copies
        them to the device once, not every tick."""
        key = (place.frames, place.keep, start_t, held.numpy().tobytes())
        if self._curves is None or self._curves[0] != key:
            kept = (torch.arange(place.frames) < place.keep) & held
            noise = torch.where(held, torch.tensor(start_t), torch.tensor(1.0))
            self._curves = (key, ((~kept).float(), noise))
        return self._curves[1]

    def land(self, finished: list[Finished], frozen_frame: int) -> None:
        """Merge delivered windows into the timeline after `frozen_frame` (whose audio is written and never changes
        again)."""
        self.timeline.freeze(frozen_frame)
        for delivered in finished:
            self.timeline.merge(delivered.latent, delivered.request.window)

    def fill(self, latents: torch.Tensor) -> None:
        """A loop's source: the timeline starts from its latents (ValueError if they hold NaN or inf)."""
        FINITE_CHECKS("source_latents", latents)
        self.timeline.fill(latents)

    def set_frame_curve(self, name: str, curve: torch.Tensor) -> None:
        """A per-frame shared curve over the loop, read at each window's place (`crop_frame_curves`)."""
        self._frame_curves[name] = frame_view(curve).to(self.timeline.latents.device)
        self._curves_at = None

    def drop_frame_curve(self, name: str) -> None:
        self._frame_curves.pop(name, None)

    def crop_frame_curves(self, place: WindowPlace, set_shared: Callable[[str, torch.Tensor], None]) -> None:
        """Per-frame shared curves at the newest window's place (the windows in flight lie within a few ticks'
        advance of it)."""
        if not self._frame_curves or self._curves_at == place:
            return
        for name, curve in self._frame_curves.items():
            set_shared(name, cyclic_crop(curve, place.start, place.frames))
        self._curves_at = place


def _crop(song: torch.Tensor, place: WindowPlace) -> torch.Tensor:
    """A song-long tensor's frames at a window's place, finite wherever the song's are."""
    crop = cyclic_crop(song, place.start, place.frames)
    FINITE_CHECKS.derived(crop, song)
    return crop
