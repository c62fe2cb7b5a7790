"""Our Qwen3 text encoder equals transformers' Qwen3Model with identical random weights."""

import torch
from flowjam.engine.models.presets import QWEN3_EMBEDDING_06B, QWEN3_TINY
from flowjam.engine.models.text_encoder import Qwen3TextEncoder
from qwen_reference import hf_qwen3_config, random_state
from transformers import Qwen3Model


def reference_model(config) -> Qwen3Model:
    return Qwen3Model(hf_qwen3_config(config)).eval()


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
