"""Where the loop's audio lies on its latent. A loop of whole bars is rarely a whole number of latent frames (1,920
samples at 48 kHz): the loop plays `samples` samples over a latent of ceil(samples / hop) frames, whose last frame
runs `skip` samples past the loop's end. Those samples are never played. At the loop's seam a text loop's audio
crossfades from just before the loop's end into just before the latent's end, which runs on into the latent's frame
0 (the latent is generated and decoded as a cycle), so the seam is as smooth as a loop of whole frames. A cover's
latent repeats the loop's start past the loop's end (`latent_audio`), so there the seam is a plain cut back to frame 0
(seam "loop"). For a loop of whole frames, or endless play's ring, `skip` is 0 and every mapping is the identity."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoopMap:
    samples: int  # the loop (or the endless ring) in played samples
    hop: int  # samples per latent frame
    seam: str = "latent"  # "latent": the latent is a cycle of its own; "loop": past the loop's end it repeats its start

    def __post_init__(self):
        if self.seam not in ("latent", "loop"):
            raise ValueError(f"seam must be 'latent' or 'loop', got {self.seam!r}")
        if self.samples < self.hop:
            raise ValueError(f"a loop of {self.samples} samples is shorter than one latent frame ({self.hop})")

    @property
    def frames(self) -> int:
        """Latent frames of the loop."""
        return -(-self.samples // self.hop)

    @property
    def skip(self) -> int:
        """Samples of the latent past the loop's end, never played."""
        return self.frames * self.hop - self.samples

    def latent_sample(self, sample: int) -> int:
        """The latent timeline's sample (lap after lap of `frames` frames) that plays at the played `sample`."""
        laps, at = divmod(int(sample), self.samples)
        return laps * self.frames * self.hop + at

    def splice(self, audio: torch.Tensor, start: int, fade: int) -> torch.Tensor:
        """Audio decoded cyclically from the latent sample that plays at `start` -> the audio for the played samples
        from `start` on: past the loop's end it goes on `skip` samples later in the decode (the latent's frame 0
        again), crossfaded over `fade` samples before the seam. Shorter by `skip` when it crosses the seam."""
        seam = self.samples - int(start) % self.samples
        if self.skip == 0 or seam >= audio.shape[-1]:
            return audio
        later = seam + self.skip
        fade = 0 if self.seam == "loop" else min(fade, seam)
        head = audio[..., :seam].clone()
        if fade:
            rise = torch.sin(0.5 * torch.pi * (torch.arange(fade, dtype=torch.float32) + 0.5) / fade) ** 2
            rise = rise.to(audio.device, audio.dtype)
            head[..., seam - fade :] = head[..., seam - fade :] * (1 - rise) + audio[..., later - fade : later] * rise
        return torch.cat([head, audio[..., later:]], dim=-1)

    def latent_audio(self, loop: torch.Tensor) -> torch.Tensor:
        """A cover's loop audio ([..., samples]) -> the audio of its latent ([..., frames * hop]): the loop's start
        repeated past its end."""
        return torch.cat([loop, loop[..., : self.skip]], dim=-1)

    def loop_audio(self, whole: torch.Tensor, fade: int) -> torch.Tensor:
        """A decode of the whole latent ([..., frames * hop]) -> the loop's `samples`, its seam crossfaded."""
        return self.splice(whole, 0, fade)[..., : self.samples]
