"""The official ACE-Step 1.5 checkpoint key -> shape table, written out from the spec (§1.6), independent of our modules."""


def official_keys(c) -> dict[str, tuple[int, ...]]:
    """The checkpoint's key -> shape table, written out from the spec (§1.6), independent of our modules."""
    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim  # noqa: E741 (the spec names it I)
    q, kv = c.num_attention_heads * hd, c.num_key_value_heads * hd
    E = c.encoder_hidden_size or H
    EI = c.encoder_intermediate_size or I
    eq = (c.encoder_num_attention_heads or c.num_attention_heads) * hd
    ekv = (c.encoder_num_key_value_heads or c.num_key_value_heads) * hd
    keys: dict[str, tuple[int, ...]] = {}
    for name in ("time_embed", "time_embed_r"):
        p = f"decoder.{name}."
        keys |= {
            p + "linear_1.weight": (H, 256),
            p + "linear_1.bias": (H,),
            p + "linear_2.weight": (H, H),
            p + "linear_2.bias": (H,),
            p + "time_proj.weight": (6 * H, H),
            p + "time_proj.bias": (6 * H,),
        }
    keys |= {
        "decoder.proj_in.1.weight": (H, 192, 2),
        "decoder.proj_in.1.bias": (H,),
        "decoder.condition_embedder.weight": (H, E),
        "decoder.condition_embedder.bias": (H,),
        "decoder.norm_out.weight": (H,),
        "decoder.proj_out.1.weight": (H, 64, 2),
        "decoder.proj_out.1.bias": (64,),
        "decoder.scale_shift_table": (1, 2, H),
    }
    for i in range(c.num_hidden_layers):
        p = f"decoder.layers.{i}."
        for attn in ("self_attn", "cross_attn"):
            keys |= {
                p + f"{attn}_norm.weight": (H,),
                p + f"{attn}.q_proj.weight": (q, H),
                p + f"{attn}.k_proj.weight": (kv, H),
                p + f"{attn}.v_proj.weight": (kv, H),
                p + f"{attn}.o_proj.weight": (H, q),
                p + f"{attn}.q_norm.weight": (hd,),
                p + f"{attn}.k_norm.weight": (hd,),
            }
        keys |= {
            p + "mlp_norm.weight": (H,),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
            p + "scale_shift_table": (1, 6, H),
        }

    def encoder_layers(prefix, count):
        out = {}
        for i in range(count):
            p = f"{prefix}.layers.{i}."
            out |= {
                p + "input_layernorm.weight": (E,),
                p + "post_attention_layernorm.weight": (E,),
                p + "self_attn.q_proj.weight": (eq, E),
                p + "self_attn.k_proj.weight": (ekv, E),
                p + "self_attn.v_proj.weight": (ekv, E),
                p + "self_attn.o_proj.weight": (E, eq),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (EI, E),
                p + "mlp.up_proj.weight": (EI, E),
                p + "mlp.down_proj.weight": (E, EI),
            }
        return out

    keys["encoder.text_projector.weight"] = (E, c.text_hidden_dim)
    keys |= {
        "encoder.lyric_encoder.embed_tokens.weight": (E, c.text_hidden_dim),
        "encoder.lyric_encoder.embed_tokens.bias": (E,),
        "encoder.lyric_encoder.norm.weight": (E,),
    }
    keys |= encoder_layers("encoder.lyric_encoder", c.num_lyric_encoder_hidden_layers)
    keys |= {
        "encoder.timbre_encoder.embed_tokens.weight": (E, 64),
        "encoder.timbre_encoder.embed_tokens.bias": (E,),
        "encoder.timbre_encoder.norm.weight": (E,),
        "encoder.timbre_encoder.special_token": (1, 1, E),
    }
    keys |= encoder_layers("encoder.timbre_encoder", c.num_timbre_encoder_hidden_layers)
    keys |= {
        "tokenizer.audio_acoustic_proj.weight": (E, 64),
        "tokenizer.audio_acoustic_proj.bias": (E,),
        "tokenizer.attention_pooler.embed_tokens.weight": (E, E),
        "tokenizer.attention_pooler.embed_tokens.bias": (E,),
        "tokenizer.attention_pooler.norm.weight": (E,),
        "tokenizer.attention_pooler.special_token": (1, 1, E),
        "tokenizer.quantizer.project_in.weight": (6, E),
        "tokenizer.quantizer.project_in.bias": (6,),
        "tokenizer.quantizer.project_out.weight": (E, 6),
        "tokenizer.quantizer.project_out.bias": (E,),
    }
    keys |= encoder_layers("tokenizer.attention_pooler", c.num_attention_pooler_hidden_layers)
    keys |= {
        "detokenizer.embed_tokens.weight": (E, E),
        "detokenizer.embed_tokens.bias": (E,),
        "detokenizer.special_tokens": (1, 5, E),
        "detokenizer.norm.weight": (E,),
        "detokenizer.proj_out.weight": (64, E),
        "detokenizer.proj_out.bias": (64,),
    }
    keys |= encoder_layers("detokenizer", c.num_attention_pooler_hidden_layers)
    keys["null_condition_emb"] = (1, 1, E)
    return keys
