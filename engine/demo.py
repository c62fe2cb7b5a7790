"""`python -m flowjam demo`: a scripted performance streamed offline on the tiny preset, written to a WAV.

A 10-second song latent is regenerated continuously (depth 4, 8 steps): the first request starts from noise,
every later one re-generates the last finished latent. A virtual playhead advances HOP_SECONDS per tick; each tick
the newest latent is decoded in a window at the playhead and appended with an equal-power crossfade. The script
sweeps the denoise of new requests, a shared per-frame velocity curve (felt by every slot on the next tick)
and a prompt blend from one caption to another.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .audio.files import write_wav
from .audio.stitch import append_with_overlap
from .params import DEFAULT_STEPS, seconds_to_frames
from .sampling import curves
from .session import Session, peak_normalize

SONG_SECONDS = 10.0
HOP_SECONDS = 0.4
OVERLAP_SECONDS = 0.04


@dataclass(frozen=True)
class TickLine:
    tick: int
    tick_ms: float
    playhead_s: float
    active_slots: int
    rows: int
    denoise: float
    blend: float
    velocity_scale: str
    delivered: int


def knob_script(progress: float) -> tuple[float, float, bool]:
    """(denoise, prompt blend, shared velocity curve on?) at `progress` in [0, 1] of the performance."""
    denoise = 0.55 + 0.3 * math.sin(math.pi * progress) ** 2
    blend = min(1.0, max(0.0, (progress - 0.2) / 0.6))
    return denoise, blend, 0.3 <= progress < 0.7


def run_demo(
    session: Session,
    seconds: float,
    out_path,
    prompt_a: str = "ambient pads, slow evolving synth",
    prompt_b: str = "driving techno, punchy drums",
    depth: int = 4,
    steps: int = DEFAULT_STEPS,
    seed: int = 42,
    on_tick: Callable[[TickLine], None] | None = None,
):
    """Stream `seconds` of audio with the scripted knob sweep; returns (wav path, tick lines)."""
    seconds_to_frames(seconds)
    frames = seconds_to_frames(SONG_SECONDS)
    cond_a, cond_b = session.encode_text(prompt_a), session.encode_text(prompt_b)
    stream = session.stream(depth=depth)
    wave = curves.wave(frames, "sine", cycles=2.0, low=0.7, high=1.3)
    rate, hop = session.sample_rate, round(HOP_SECONDS * session.sample_rate)
    overlap = round(OVERLAP_SECONDS * session.sample_rate)
    total = round(seconds * rate)
    audio = torch.zeros(2, 0)
    latest: torch.Tensor | None = None
    lines: list[TickLine] = []
    tick = 0
    while audio.shape[-1] < total + overlap:
        progress = audio.shape[-1] / total
        denoise, blend, wobble = knob_script(progress)
        condition = session.blend_conditionings(cond_a, cond_b, blend)
        if latest is None:
            request = session.make_request(condition, SONG_SECONDS, seed=seed, steps=steps)
        else:
            request = session.make_request(
                condition, SONG_SECONDS, seed=seed, steps=steps, denoise=denoise, source_latents=latest
            )
        stream.submit(request)
        stream.set_shared_curve("velocity_scale", wave if wobble else None)
        finished = stream.tick()
        if finished:
            latest = finished[-1].latent
        stats = stream.stats()
        tick += 1
        playhead_s = (max(0, audio.shape[-1] - overlap) / rate) % SONG_SECONDS
        if latest is not None:
            window = session.decode(latest, t_start=playhead_s, window_s=HOP_SECONDS + OVERLAP_SECONDS, cyclic=True)
            audio = append_with_overlap(audio, window[:, : hop + overlap], overlap)
        line = TickLine(
            tick,
            stats["last_tick_ms"],
            playhead_s,
            stats["active_slots"],
            stats["rows"],
            denoise,
            blend,
            "wave" if wobble else "-",
            len(finished),
        )
        lines.append(line)
        if on_tick is not None:
            on_tick(line)
    return write_wav(out_path, peak_normalize(audio[:, :total]), rate), lines
