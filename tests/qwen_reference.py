"""transformers' Qwen3 as the independent reference for our Qwen3 encoder and LM: config, seeded weights, and a
plain greedy decode loop over our LM's cache (what `generate(do_sample=False)` does)."""

import torch
from flowjam.engine.models.lm import Qwen3LM
from transformers import Qwen3Config as HFQwen3Config

EOS_ID = 151_645  # <|im_end|> (spec §5.2)


def hf_qwen3_config(config, **extra) -> HFQwen3Config:
    """transformers' config for one of our `Qwen3Config`s (SDPA attention); `extra` e.g. tie_word_embeddings."""
    return HFQwen3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        attn_implementation="sdpa",
        **extra,
    )


def random_state(model, seed: int = 0) -> dict:
    """Seeded weights for every key (norm weights around 1, so every q/k/input norm matters)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(v.shape, generator=g) * 0.3 + (1.0 if "norm" in k else 0.0)
        for k, v in model.state_dict().items()
    }


@torch.no_grad()
def greedy(lm: Qwen3LM, prompt_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """Full-vocabulary greedy decoding with the KV cache: prompt [B, L] (equal lengths) -> new tokens [B, max_new].

    No early stop: every row produces exactly max_new_tokens."""
    b, length = prompt_ids.shape
    lm.setup_cache(b, length + max_new_tokens)
    token = lm.prefill(prompt_ids).argmax(dim=-1)
    out = [token]
    for step in range(1, max_new_tokens):
        position = torch.full((b,), length + step - 1, device=prompt_ids.device)
        token = lm.decode_step(token, position).argmax(dim=-1)
        out.append(token)
    return torch.stack(out, dim=1)
