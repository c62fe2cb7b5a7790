"""A bench's requests walking with a playhead one latent frame per tick, windows placed and masked as a live stream
places them (engine/stream/walker.py): what `bench tick --window-seconds` times."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..models.dit import DiTDecoder
from ..stream import SlotRequest
from ..stream.walker import WindowWalker
from ..stream.windows import window_frames


@dataclass
class Walk:
    walker: WindowWalker
    context: torch.Tensor  # [1, song (or ring) frames, C]: read at each window's place
    denoise: float = 0.7

    @staticmethod
    def of(decoder: DiTDecoder, context: torch.Tensor, window_s: float, endless: bool) -> Walk | None:
        """The walk over a song as long as `context` (the ring when `endless`); None: whole-song requests."""
        frames = window_frames(window_s, None if endless else context.shape[1])
        if frames is None:
            return None
        channels = decoder.config.audio_acoustic_hidden_dim
        walker = WindowWalker(context.shape[1], frames, channels, context.device, context.dtype, endless)
        return Walk(walker, context)

    def request(self, request: SlotRequest, tick: int) -> SlotRequest:
        """`request` moved onto the window at the playhead of `tick`."""
        place = self.walker.place(tick, 1)  # the playhead in latent frames
        inputs = self.walker.inputs(place, self.context, None, self.denoise, request.steps, request.shift)
        denoise = self.denoise if "source_latents" in inputs else 1.0
        return replace(request, denoise=denoise, **inputs)

    def land(self, finished: list, tick: int) -> None:
        self.walker.land(finished, tick)
