"""Our DiT, condition encoder and FSQ tokenizer reproduce the official ACE-Step 1.5 model code (tiny config, fp32)."""

from pathlib import Path

import pytest
import torch
from flowjam.engine.models.acestep import AceStepModel
from flowjam.engine.models.presets import TINY
from safetensors.torch import load_file

REFERENCE = Path(__file__).parent / "data" / "acestep15_tiny_reference.safetensors"


@pytest.fixture(scope="module")
def reference():
    return load_file(REFERENCE)


@pytest.fixture(scope="module")
def tiny_acestep(reference):
    weights = {k.removeprefix("weights/"): v for k, v in reference.items() if k.startswith("weights/")}
    net = AceStepModel(TINY).eval()
    net.load_state_dict(weights, strict=True)
    return net


@pytest.mark.parametrize("case", ["dit_odd", "dit_even"])
def test_dit_velocity_matches_official_code(tiny_acestep, reference, case):
    with torch.no_grad():
        velocity = tiny_acestep.decoder(
            reference[f"{case}/hidden_states"],
            reference[f"{case}/timestep"],
            reference[f"{case}/context_latents"],
            encoder_hidden_states=reference[f"{case}/encoder_hidden_states"],
        )
    expected = reference[f"{case}/velocity"]
    assert velocity.shape == expected.shape
    torch.testing.assert_close(velocity, expected, atol=2e-5, rtol=1e-5)


def test_condition_encoder_packs_like_official_code(tiny_acestep, reference):
    with torch.no_grad():
        states, mask = tiny_acestep.encoder(
            reference["cond/text_hidden_states"],
            reference["cond/text_attention_mask"],
            reference["cond/lyric_hidden_states"],
            reference["cond/lyric_attention_mask"],
            reference["cond/refer_audio_packed"],
            reference["cond/refer_audio_order_mask"],
        )
    assert torch.equal(mask, reference["cond/encoder_attention_mask"])
    torch.testing.assert_close(states, reference["cond/encoder_hidden_states"], atol=1e-5, rtol=1e-5)


def test_fsq_tokenizer_codes_and_detokenizer_match(tiny_acestep, reference):
    with torch.no_grad():
        quantized, codes = tiny_acestep.tokenize(reference["fsq/latents"], reference["fsq/silence_latent"])
        hints = tiny_acestep.detokenize(reference["fsq/quantized"])
        from_codes = tiny_acestep.tokenizer.quantizer.decode_indices(reference["fsq/indices"])
    assert torch.equal(codes, reference["fsq/indices"]), "FSQ code indices differ from the official quantizer"
    torch.testing.assert_close(quantized, reference["fsq/quantized"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(from_codes, reference["fsq/quantized"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hints, reference["fsq/detokenized"], atol=1e-5, rtol=1e-5)


def test_codes_outside_the_codebook_are_rejected(tiny_acestep):
    with pytest.raises(ValueError, match="0..63999"):
        tiny_acestep.tokenizer.quantizer.decode_indices(torch.tensor([[64_000]]))
