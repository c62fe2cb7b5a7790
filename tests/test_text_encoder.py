"""Our Qwen3 text encoder equals transformers' Qwen3Model with identical random weights."""

import torch
from transformers import Qwen3Config as HFQwen3Config
from transformers import Qwen3Model

from flowjam.engine.models.presets import QWEN3_EMBEDDING_06B, QWEN3_TINY
from flowjam.engine.models.text_encoder import Qwen3TextEncoder


def reference_model(config) -> Qwen3Model:
    hf_config = HFQwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        attn_implementation="sdpa",
    )
    return Qwen3Model(hf_config).eval()


def random_state(model, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 + (1.0 if "norm" in k else 0.0) for k, v in model.state_dict().items()}


def test_caption_hidden_states_match_transformers_qwen3():
    reference = reference_model(QWEN3_TINY)
    state = random_state(reference)
    reference.load_state_dict(state, strict=True)
    ours = Qwen3TextEncoder(QWEN3_TINY).eval()
    ours.load_state_dict(state, strict=True)  # same key names both ways
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, QWEN3_TINY.vocab_size, (3, 29), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 20:] = 0
    mask[2, 5:] = 0
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).last_hidden_state
        got = ours(ids, mask)
    for row, length in enumerate((29, 20, 5)):
        torch.testing.assert_close(got[row, :length], expected[row, :length], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.embed(ids), reference.embed_tokens(ids), atol=0, rtol=0)


def test_full_size_text_encoder_has_the_official_shape():
    with torch.device("meta"):
        model = Qwen3TextEncoder(QWEN3_EMBEDDING_06B)
    assert sum(p.numel() for p in model.parameters()) == 595_776_512
    assert len(model.state_dict()) == 310
