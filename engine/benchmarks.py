"""Benchmarks that print numbers (`python -m flowjam bench ...`) and parameter census of the presets."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from .models.acestep import AceStepModel
from .models.dit import DiTDecoder
from .models.presets import LATENT_RATE_HZ, get_preset
from .models.text_encoder import Qwen3TextEncoder
from .models.vae import OobleckVAE

CONDITION_TOKENS = 256


def parameter_census(preset_name: str) -> dict[str, int]:
    """Parameter counts per network of a preset, counted on the meta device (no memory)."""
    preset = get_preset(preset_name)
    with torch.device("meta"):
        acestep, text, vae = AceStepModel(preset.dit), Qwen3TextEncoder(preset.text), OobleckVAE(preset.vae)

    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    return {
        "dit decoder": count(acestep.decoder),
        "condition encoder": count(acestep.encoder),
        "audio tokenizer": count(acestep.tokenizer),
        "audio detokenizer": count(acestep.detokenizer),
        "null_condition_emb": acestep.null_condition_emb.numel(),
        "acestep checkpoint total": count(acestep),
        "qwen3 text encoder": count(text),
        "oobleck vae": count(vae),
    }


@dataclass(frozen=True)
class ForwardTiming:
    seconds: float
    frames: int
    batch: int
    median_ms: float
    min_ms: float
    max_ms: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_dit_forward(
    preset_name: str, seconds: float, batch: int = 1, device: str = "cpu", dtype: torch.dtype = torch.float32, repeats: int = 5, seed: int = 0
) -> ForwardTiming:
    """Wall time of one batched DiT forward (random weights at the preset's shape, cached cross-attention K/V)."""
    config = get_preset(preset_name).dit
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dit = DiTDecoder(config).to(dev, dtype).eval()
        frames = round(seconds * LATENT_RATE_HZ)
        x = torch.randn(batch, frames, config.audio_acoustic_hidden_dim, device=dev, dtype=dtype)
        context = torch.randn(batch, frames, config.in_channels - config.audio_acoustic_hidden_dim, device=dev, dtype=dtype)
        cond = torch.randn(batch, CONDITION_TOKENS, config.condition_width, device=dev, dtype=dtype)
    t = torch.linspace(1.0, 0.3, batch, device=dev, dtype=dtype)
    times_ms = []
    with torch.no_grad():
        cross_kv = dit.build_cross_kv(cond)
        dit(x, t, context, cross_kv=cross_kv)  # warm-up
        for _ in range(repeats):
            _sync(dev)
            start = time.perf_counter()
            dit(x, t, context, cross_kv=cross_kv)
            _sync(dev)
            times_ms.append((time.perf_counter() - start) * 1000.0)
    return ForwardTiming(seconds, frames, batch, statistics.median(times_ms), min(times_ms), max(times_ms))
