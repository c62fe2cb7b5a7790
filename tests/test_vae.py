"""Oobleck VAE: parity with diffusers AutoencoderOobleck, full-size key/parameter census, tiny-preset shapes."""

import pytest
import torch
from flowjam.engine.models.vae import VAE_FULL, VAE_TINY, OobleckConfig, OobleckVAE

diffusers = pytest.importorskip("diffusers")
pytestmark = pytest.mark.filterwarnings("ignore:.*weight_norm.*:FutureWarning")

# diffusers ties encoder base width = encoder_hidden_size = 2 * latent; the odd stride 3 exercises ceil(s/2) padding
SMALL = OobleckConfig(
    encoder_width=8, latent_channels=4, decoder_channels=6, downsampling_ratios=(2, 3, 10), channel_multiples=(1, 2, 4)
)


def _diffusers_vae(cfg: OobleckConfig) -> torch.nn.Module:
    """diffusers AutoencoderOobleck with the same shape as cfg (requires encoder_width == 2 * latent_channels)."""
    assert cfg.encoder_width == 2 * cfg.latent_channels
    return diffusers.AutoencoderOobleck(
        encoder_hidden_size=cfg.encoder_width,
        downsampling_ratios=list(cfg.downsampling_ratios),
        channel_multiples=list(cfg.channel_multiples),
        decoder_channels=cfg.decoder_channels,
        decoder_input_channels=cfg.latent_channels,
        audio_channels=cfg.audio_channels,
        sampling_rate=cfg.sample_rate,
    )


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter (weight_g/v, biases, snake alpha/beta) with seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        scale = 1.0 if name.endswith("weight_v") else 0.5 if name.endswith(("alpha", "beta", "weight_g")) else 0.1
        p.copy_(torch.randn(p.shape, generator=gen) * scale)


def _close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@torch.no_grad()
def test_parity_with_diffusers():
    ref = _diffusers_vae(SMALL).eval()
    _randomize(ref, seed=0)
    ours = OobleckVAE(SMALL).eval()
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict(), strict=True)
    back = _diffusers_vae(SMALL)
    back.load_state_dict(ours.state_dict(), strict=True)
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in back.state_dict().items())

    audio = torch.randn(2, 2, 60 * 8 + 7, generator=torch.Generator().manual_seed(1))
    dist = ref.encode(audio).latent_dist
    mean, std = ours.encode_moments(audio)
    _close(mean, dist.mean)
    _close(std, dist.std)
    _close(ours.encode(audio), dist.mean)
    sample = ours.encode(audio, sample=True, generator=torch.Generator().manual_seed(2))
    _close(sample, dist.sample(generator=torch.Generator().manual_seed(2)))

    latents = torch.randn(2, 4, 9, generator=torch.Generator().manual_seed(3))
    _close(ours.decode(latents), ref.decode(latents).sample)  # odd stride 3: length 9*60 - 2, as in diffusers


def test_full_config_census():
    with torch.device("meta"):
        ours = OobleckVAE(VAE_FULL)
        ref = _diffusers_vae(OobleckConfig())
    sd = ours.state_dict()
    assert len(sd) == 365
    assert sum(p.numel() for p in ours.parameters()) == 168_695_426
    assert sum(p.numel() for p in ours.encoder.parameters()) == 84_281_344
    assert sum(p.numel() for p in ours.decoder.parameters()) == 84_414_082
    ref_sd = ref.state_dict()
    assert set(sd) == set(ref_sd)
    assert all(sd[k].shape == ref_sd[k].shape for k in sd)
    assert sd["encoder.conv1.weight_g"].shape == (128, 1, 1)
    assert sd["decoder.block.0.conv_t1.weight_g"].shape == (2048, 1, 1)
    assert "decoder.conv2.bias" not in sd
    assert ours.hop_samples == 1920 and ours.sample_rate == 48000


@torch.no_grad()
def test_tiny_shapes_and_sampling():
    torch.manual_seed(0)
    vae = OobleckVAE(VAE_TINY).eval()
    assert vae.hop_samples == 1920
    audio = 0.1 * torch.randn(1, 2, 1920 * 10, generator=torch.Generator().manual_seed(1))
    mean = vae.encode(audio)
    assert mean.shape == (1, 64, 10)
    assert vae.decode(mean).shape == (1, 2, 19200)

    a = vae.encode(audio, sample=True, generator=torch.Generator().manual_seed(7))
    b = vae.encode(audio, sample=True, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert not torch.allclose(a, mean)


def test_seeded_tiny_vae_plays_a_centred_texture_not_a_dc_offset():
    """The tiny preset's decoder is centred when it is built: what a newcomer hears first is zero-mean and peaks
    around half scale (untrained, it sat pinned near -1.0 / +0.5 full scale)."""
    from flowjam.engine.checkpoints.loading import build_random

    vae = build_random("tiny").vae
    latents = torch.randn(1, 64, 100, generator=torch.Generator().manual_seed(7))
    audio = vae.decode(latents)[0]
    assert audio.mean(dim=1).abs().max() < 0.01, f"DC offset per channel: {audio.mean(dim=1).tolist()}"
    assert 0.2 < audio.abs().max() < 0.8, f"peak {audio.abs().max():.3f}"
    assert audio.std(dim=1).min() > 0.02, "the texture must be audible"


def test_kept_weight_norm_and_snake_constants_follow_weight_changes():
    """Inference keeps each conv's weight-normed weight and each Snake's constants instead of recomputing them every
    decode: the result is bit for bit the recomputed one, and a weight written in place reaches the next decode
    (and its old value returns the old audio exactly)."""
    vae = OobleckVAE(SMALL).eval()
    _randomize(vae, 3)
    z = torch.randn(1, SMALL.latent_channels, 12, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        kept = vae.decode(z)
        again = vae.decode(z)
    recomputed = vae.decode(z).detach()  # autograd on: nothing kept, everything recomputed
    assert torch.equal(kept, recomputed) and torch.equal(again, recomputed)
    conv, snake = vae.decoder.block[1].conv_t1, vae.decoder.block[1].res_unit1.snake1
    with torch.no_grad():
        for param in (conv.weight_g, snake.alpha):
            original = param.clone()
            param.mul_(1.5)
            changed = vae.decode(z)
            param.copy_(original)
            restored = vae.decode(z)
            assert not torch.equal(changed, kept) and torch.equal(restored, kept)
