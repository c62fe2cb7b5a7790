"""transformers' Qwen3 as the independent reference for our Qwen3 encoder and LM: config and seeded weights."""

import torch
from transformers import Qwen3Config as HFQwen3Config


def hf_qwen3_config(config, **extra) -> HFQwen3Config:
    """transformers' config for one of our `Qwen3Config`s (SDPA attention); `extra` e.g. tie_word_embeddings."""
    return HFQwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim, rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps, max_position_embeddings=config.max_position_embeddings,
        attn_implementation="sdpa", **extra,
    )


def random_state(model, seed: int = 0) -> dict:
    """Seeded weights for every key (norm weights around 1, so every q/k/input norm matters)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * 0.3 + (1.0 if "norm" in k else 0.0) for k, v in model.state_dict().items()}
