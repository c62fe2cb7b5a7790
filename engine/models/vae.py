"""Oobleck VAE of ACE-Step 1.5 (diffusers `AutoencoderOobleck` semantics and state-dict keys), plain PyTorch."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class OobleckConfig:
    """Oobleck VAE shape; diffusers ties encoder_width == 2 * latent_channels, we do not."""

    audio_channels: int = 2
    encoder_width: int = 128  # base width of the encoder
    latent_channels: int = 64  # encoder outputs 2*latent (mean || scale)
    decoder_channels: int = 128
    downsampling_ratios: tuple[int, ...] = (2, 4, 4, 6, 10)
    channel_multiples: tuple[int, ...] = (1, 2, 4, 8, 16)
    sample_rate: int = 48000


VAE_FULL = OobleckConfig()
VAE_TINY = OobleckConfig(encoder_width=4, decoder_channels=4)


def _norm_except_dim0(v: torch.Tensor) -> torch.Tensor:
    """L2 norm of v over every dim but 0, kept broadcastable to v."""
    return v.norm(dim=tuple(range(1, v.dim())), keepdim=True)


def _split_weight(conv: nn.Module) -> None:
    """Replace conv.weight by parameters weight_g = ||weight|| (per dim-0 slice) and weight_v = weight."""
    v = conv.weight.detach()
    del conv.weight
    conv.weight_g = nn.Parameter(_norm_except_dim0(v))
    conv.weight_v = nn.Parameter(v)


def _joined_weight(conv: nn.Module) -> torch.Tensor:
    """Weight-normed weight g * v / ||v||."""
    return _constant(
        conv, lambda: conv.weight_g * conv.weight_v / _norm_except_dim0(conv.weight_v), conv.weight_g, conv.weight_v
    )


def _constant(module: nn.Module, compute: Callable[[], Any], *params: torch.Tensor) -> Any:
    """`compute()` (a tensor or a tuple of tensors, functions of `params` alone), kept on the module until one of
    them is moved, cast or written in place, so a decode runs no weight-norm or exp kernels; computed afresh
    wherever autograd records. A recomputed value of the same device, dtype and shape is written into the kept
    tensors: a captured CUDA graph that reads them stays valid. (Inference tensors keep no version: weights made
    under torch.inference_mode are taken to stay as they are.)"""
    if torch.is_grad_enabled():
        return compute()
    key = tuple((p.data_ptr(), 0 if p.is_inference() else p._version, p.dtype) for p in params)
    cached = module.__dict__.get("_folded")
    if cached is not None and cached[0] == key:
        return cached[1]
    value = compute()
    if cached is not None and _same_layout(cached[1], value):
        for kept, new in zip(_tensors(cached[1]), _tensors(value)):
            kept.copy_(new)
        value = cached[1]
    module.__dict__["_folded"] = (key, value)
    return value


def _tensors(value: Any) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _same_layout(a: Any, b: Any) -> bool:
    a, b = _tensors(a), _tensors(b)
    return len(a) == len(b) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device for x, y in zip(a, b)
    )


class WNConv1d(nn.Conv1d):
    """Conv1d with weight norm over dim 0, stored as weight_g [out,1,1] and weight_v."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _split_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, _joined_weight(self), self.bias)


class WNConvTranspose1d(nn.ConvTranspose1d):
    """ConvTranspose1d with weight norm over dim 0, stored as weight_g [in,1,1] and weight_v."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _split_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv_transpose1d(
            x,
            _joined_weight(self),
            self.bias,
            self.stride,
            self.padding,
            self.output_padding,
            self.groups,
            self.dilation,
        )


class Snake1d(nn.Module):
    """Snake with log-scale parameters: x + sin(exp(alpha) x)^2 / (exp(beta) + 1e-9)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(1, channels, 1))
        self.beta = nn.Parameter(torch.zeros(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frequency, height = _constant(self, lambda: (self.alpha.exp(), self.beta.exp() + 1e-9), self.alpha, self.beta)
        return torch.addcdiv(x, torch.sin(frequency * x).square(), height)


class ResidualUnit(nn.Module):
    """Snake -> dilated k7 conv -> Snake -> k1 conv, plus skip (length-preserving)."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.snake1 = Snake1d(channels)
        self.conv1 = WNConv1d(channels, channels, kernel_size=7, dilation=dilation, padding=3 * dilation)
        self.snake2 = Snake1d(channels)
        self.conv2 = WNConv1d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class EncoderBlock(nn.Module):
    """Three residual units at c_in, then Snake and a strided conv c_in -> c_out (downsample by stride)."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.res_unit1 = ResidualUnit(c_in, 1)
        self.res_unit2 = ResidualUnit(c_in, 3)
        self.res_unit3 = ResidualUnit(c_in, 9)
        self.snake1 = Snake1d(c_in)
        self.conv1 = WNConv1d(c_in, c_out, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.res_unit3(self.res_unit2(self.res_unit1(x)))
        return self.conv1(self.snake1(x))


class DecoderBlock(nn.Module):
    """Snake and a transposed conv c_in -> c_out (upsample by stride), then three residual units at c_out."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.snake1 = Snake1d(c_in)
        self.conv_t1 = WNConvTranspose1d(
            c_in, c_out, kernel_size=2 * stride, stride=stride, padding=math.ceil(stride / 2)
        )
        self.res_unit1 = ResidualUnit(c_out, 1)
        self.res_unit2 = ResidualUnit(c_out, 3)
        self.res_unit3 = ResidualUnit(c_out, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class Encoder(nn.Module):
    """Audio [B,audio,N] -> moments [B,2*latent,N/hop]."""

    def __init__(self, cfg: OobleckConfig) -> None:
        super().__init__()
        widths = [cfg.encoder_width * m for m in (1, *cfg.channel_multiples)]
        self.conv1 = WNConv1d(cfg.audio_channels, widths[0], kernel_size=7, padding=3)
        self.block = nn.ModuleList(
            EncoderBlock(widths[i], widths[i + 1], s) for i, s in enumerate(cfg.downsampling_ratios)
        )
        self.snake1 = Snake1d(widths[-1])
        self.conv2 = WNConv1d(widths[-1], 2 * cfg.latent_channels, kernel_size=3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


class Decoder(nn.Module):
    """Latents [B,latent,T] -> audio [B,audio,T*hop]."""

    def __init__(self, cfg: OobleckConfig) -> None:
        super().__init__()
        widths = [cfg.decoder_channels * m for m in reversed((1, *cfg.channel_multiples))]
        strides = cfg.downsampling_ratios[::-1]
        self.conv1 = WNConv1d(cfg.latent_channels, widths[0], kernel_size=7, padding=3)
        self.block = nn.ModuleList(DecoderBlock(widths[i], widths[i + 1], s) for i, s in enumerate(strides))
        self.snake1 = Snake1d(widths[-1])
        self.conv2 = WNConv1d(widths[-1], cfg.audio_channels, kernel_size=7, padding=3, bias=False)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        z = self.conv1(z)
        for block in self.block:
            z = block(z)
        return self.conv2(self.snake1(z))


class OobleckVAE(nn.Module):
    """Oobleck autoencoder: stereo audio <-> latents at sample_rate / hop_samples frames per second."""

    def __init__(self, config: OobleckConfig = VAE_FULL) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    @property
    def hop_samples(self) -> int:
        """Audio samples per latent frame."""
        return math.prod(self.config.downsampling_ratios)

    @property
    def sample_rate(self) -> int:
        """Audio sample rate in Hz."""
        return self.config.sample_rate

    def encode_moments(self, audio: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Posterior (mean, std) of audio [B,audio,N], each [B,latent,N/hop]."""
        mean, scale = self.encoder(audio).chunk(2, dim=1)
        return mean, F.softplus(scale) + 1e-4

    def encode(
        self, audio: torch.Tensor, sample: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Latents of audio [B,audio,N]: the posterior mean, or a sample from it seeded by generator."""
        mean, std = self.encode_moments(audio)
        if not sample:
            return mean
        device = generator.device if generator is not None else mean.device
        noise = torch.randn(mean.shape, generator=generator, device=device, dtype=mean.dtype)
        return mean + std * noise.to(mean.device)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Audio [B,audio,T*hop] from latents [B,latent,T]."""
        return self.decoder(latents)

    @torch.no_grad()
    def center_seeded_output(self, peak: float = 0.35, seed: int = 0) -> None:
        """For seeded random weights only. Untrained, the decoder's biases add a pattern that hardly depends on the
        latents (two decodes of independent latents correlate at 0.99) and its last Snake has a positive mean per
        channel that the last conv turns into a DC offset pinning the output near full scale. Zero the decoder's
        biases (the output then follows the latents), shift each (output, input) kernel of the last conv by a
        constant, the least change that makes its DC gain orthogonal to those means (measured on seeded N(0, 1)
        latents), and scale it so their decode peaks at `peak`."""
        decoder, conv = self.decoder, self.decoder.conv2
        for module in decoder.modules():
            if isinstance(getattr(module, "bias", None), torch.Tensor):
                module.bias.zero_()
        probe = torch.randn(1, self.config.latent_channels, 32, generator=torch.Generator().manual_seed(seed))
        z = decoder.conv1(probe.to(conv.weight_v.device, conv.weight_v.dtype))
        for block in decoder.block:
            z = block(z)
        means = decoder.snake1(z).mean(dim=(0, 2))  # [in]
        taps = conv.weight_v.shape[-1]
        dc_gain = conv.weight_v.sum(dim=-1)  # [out, in]
        shift = -(dc_gain @ means)[:, None] * means[None, :] / (taps * means.square().sum())
        conv.weight_v += shift[..., None]
        audio = self.decode(probe.to(conv.weight_v.device, conv.weight_v.dtype))
        conv.weight_g *= peak / audio.abs().amax().clamp_min(1e-12)
