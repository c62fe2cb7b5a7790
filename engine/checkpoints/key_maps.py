"""Pure key/shape translations between checkpoint layouts and our (= the official ACE-Step 1.5) key names,
and network configs inferred from a state dict's shapes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace

import torch

from ..models.presets import TURBO_2B, AceStepConfig, Qwen3Config
from ..models.vae import OobleckConfig

COMFY_DIT_PREFIX = "model.diffusion_model."
COMFY_AIO_VAE_PREFIX = "vae."
COMFY_AIO_TEXT_PREFIX = "text_encoders.qwen3_06b.transformer."
COMFY_TEXT_PREFIX = "model."
DIT_MARKER = "encoder.lyric_encoder.layers.0.input_layernorm.weight"
VAE_MARKER = "decoder.conv1.weight_v"

_RESIDUAL_PARTS = ("snake1", "conv1", "snake2", "conv2")


def strip_prefix(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """The entries under `prefix`, with the prefix removed."""
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def text_encoder_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3-Embedding weights with ComfyUI's `model.` prefix removed (the official file has none); lm_head dropped."""
    if any(k.startswith(COMFY_TEXT_PREFIX) for k in state):
        state = strip_prefix(state, COMFY_TEXT_PREFIX)
    return {k: v for k, v in state.items() if not k.startswith("lm_head")}


def _comfy_vae_module(side: str, path: list[int]) -> str | None:
    """stable-audio-tools module index path under encoder/decoder -> the diffusers module name."""
    top = {0: "conv1", 6: "snake1", 7: "conv2"}
    if len(path) == 1:
        return f"{side}.{top[path[0]]}" if path[0] in top else None
    block = path[0] - 1
    if not 0 <= block <= 4:
        return None
    if side == "encoder":
        units, extras = (0, 1, 2), {3: "snake1", 4: "conv1"}
    else:
        units, extras = (2, 3, 4), {0: "snake1", 1: "conv_t1"}
    if len(path) == 2 and path[1] in extras:
        return f"{side}.block.{block}.{extras[path[1]]}"
    if len(path) == 3 and path[1] in units and 0 <= path[2] < 4:
        unit = units.index(path[1]) + 1
        return f"{side}.block.{block}.res_unit{unit}.{_RESIDUAL_PARTS[path[2]]}"
    return None


def vae_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """VAE weights in diffusers names: converts ComfyUI's stable-audio layout (`decoder.layers.N...`, snake
    params [C], parametrized weight norm) and passes diffusers layouts through."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        key = key.replace("parametrizations.weight.original0", "weight_g").replace(
            "parametrizations.weight.original1", "weight_v"
        )
        match = re.fullmatch(r"(encoder|decoder)((?:\.layers\.\d+)+)\.(\w+)", key)
        if match:
            side, path, leaf = match.group(1), [int(i) for i in re.findall(r"\d+", match.group(2))], match.group(3)
            module = _comfy_vae_module(side, path)
            if module is not None:
                key = f"{module}.{leaf}"
        if key.endswith((".alpha", ".beta")) and value.dim() == 1:
            value = value.view(1, -1, 1)
        out[key] = value
    return out


def _count_layers(state: Mapping[str, torch.Tensor], prefix: str) -> int:
    indices = {int(m.group(1)) for k in state if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(indices) + 1 if indices else 0


def infer_acestep_config(state: Mapping[str, torch.Tensor]) -> AceStepConfig:
    """Read widths, head counts and layer counts off the DiT checkpoint's shapes (like ComfyUI's detection).

    What no tensor holds (sliding window, RoPE theta, norm eps) keeps the official turbo/XL values (window 128);
    the loader replaces them from a config.json or the file's metadata, and refuses unofficial shapes without one."""
    head_dim = state["decoder.layers.0.self_attn.q_norm.weight"].shape[0]
    hidden = state["decoder.layers.0.self_attn_norm.weight"].shape[0]
    enc = "encoder.lyric_encoder.layers.0."
    encoder_hidden = state[enc + "input_layernorm.weight"].shape[0]
    separate_encoder = encoder_hidden != hidden
    return replace(
        TURBO_2B,
        hidden_size=hidden,
        intermediate_size=state["decoder.layers.0.mlp.gate_proj.weight"].shape[0],
        num_hidden_layers=_count_layers(state, "decoder.layers."),
        num_attention_heads=state["decoder.layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        num_key_value_heads=state["decoder.layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        head_dim=head_dim,
        encoder_hidden_size=encoder_hidden if separate_encoder else None,
        encoder_intermediate_size=state[enc + "mlp.gate_proj.weight"].shape[0] if separate_encoder else None,
        encoder_num_attention_heads=state[enc + "self_attn.q_proj.weight"].shape[0] // head_dim
        if separate_encoder
        else None,
        encoder_num_key_value_heads=state[enc + "self_attn.k_proj.weight"].shape[0] // head_dim
        if separate_encoder
        else None,
        in_channels=state["decoder.proj_in.1.weight"].shape[1],
        audio_acoustic_hidden_dim=state["decoder.proj_out.1.weight"].shape[1],
        patch_size=state["decoder.proj_in.1.weight"].shape[2],
        text_hidden_dim=state["encoder.text_projector.weight"].shape[1],
        timbre_hidden_dim=state["encoder.timbre_encoder.embed_tokens.weight"].shape[1],
        num_lyric_encoder_hidden_layers=_count_layers(state, "encoder.lyric_encoder.layers."),
        num_timbre_encoder_hidden_layers=_count_layers(state, "encoder.timbre_encoder.layers."),
        num_attention_pooler_hidden_layers=_count_layers(state, "tokenizer.attention_pooler.layers."),
        pool_window_size=state["detokenizer.special_tokens"].shape[1],
        fsq_dim=state["tokenizer.quantizer.project_in.weight"].shape[1],
        timbre_cls_token=separate_encoder,
    )


def infer_qwen3_config(state: Mapping[str, torch.Tensor]) -> Qwen3Config:
    """Qwen3 text-encoder shape from its (unprefixed) state dict."""
    head_dim = state["layers.0.self_attn.q_norm.weight"].shape[0]
    vocab, hidden = state["embed_tokens.weight"].shape
    return Qwen3Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=state["layers.0.mlp.gate_proj.weight"].shape[0],
        num_hidden_layers=_count_layers(state, "layers."),
        num_attention_heads=state["layers.0.self_attn.q_proj.weight"].shape[0] // head_dim,
        num_key_value_heads=state["layers.0.self_attn.k_proj.weight"].shape[0] // head_dim,
        head_dim=head_dim,
    )


def infer_vae_config(state: Mapping[str, torch.Tensor]) -> OobleckConfig:
    """Oobleck shape from a diffusers-named VAE state dict."""
    blocks = _count_layers(state, "encoder.block.")
    width = state["encoder.conv1.weight_v"].shape[0]
    widths = [state[f"encoder.block.{i}.conv1.weight_v"].shape[0] for i in range(blocks)]
    return OobleckConfig(
        audio_channels=state["encoder.conv1.weight_v"].shape[1],
        encoder_width=width,
        latent_channels=state["decoder.conv1.weight_v"].shape[1],
        decoder_channels=state["decoder.conv2.weight_v"].shape[1],
        downsampling_ratios=tuple(state[f"encoder.block.{i}.conv1.weight_v"].shape[2] // 2 for i in range(blocks)),
        channel_multiples=tuple(w // width for w in widths),
    )
