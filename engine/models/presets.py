"""Network configurations as data: the official ACE-Step 1.5 shapes and the tiny seeded preset."""

from __future__ import annotations

from dataclasses import dataclass, field

from .vae import VAE_FULL, VAE_TINY, OobleckConfig


@dataclass(frozen=True)
class AceStepConfig:
    """Field names follow the official `config.json` (model_type "acestep")."""

    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    encoder_hidden_size: int | None = None
    encoder_intermediate_size: int | None = None
    encoder_num_attention_heads: int | None = None
    encoder_num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    sliding_window: int = 128
    in_channels: int = 192
    audio_acoustic_hidden_dim: int = 64
    patch_size: int = 2
    text_hidden_dim: int = 1024
    timbre_hidden_dim: int = 64
    timbre_fix_frame: int = 750
    num_lyric_encoder_hidden_layers: int = 8
    num_timbre_encoder_hidden_layers: int = 4
    num_attention_pooler_hidden_layers: int = 2
    pool_window_size: int = 5
    fsq_dim: int = 2048
    fsq_input_levels: tuple[int, ...] = (8, 8, 8, 5, 5, 5)
    timbre_cls_token: bool = False
    """XL prepends the timbre encoder's special token as a CLS; 2B reads the first frame's output."""

    def layer_is_sliding(self, index: int) -> bool:
        """Even layers use the ±sliding_window band, odd layers attend fully (official `layer_types`)."""
        return index % 2 == 0

    @property
    def condition_width(self) -> int:
        """Width of the condition encoder, tokenizer and encoder_hidden_states (2048 for 2B and XL)."""
        return self.encoder_hidden_size or self.hidden_size

    def encoder_view(self) -> EncoderShape:
        """Shape of the transformer blocks in the condition encoder, tokenizer and detokenizer."""
        return EncoderShape(
            hidden=self.condition_width,
            intermediate=self.encoder_intermediate_size or self.intermediate_size,
            heads=self.encoder_num_attention_heads or self.num_attention_heads,
            kv_heads=self.encoder_num_key_value_heads or self.num_key_value_heads,
            head_dim=self.head_dim,
            eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            sliding_window=self.sliding_window,
        )


@dataclass(frozen=True)
class EncoderShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    rope_theta: float
    sliding_window: int


@dataclass(frozen=True)
class Qwen3Config:
    """Qwen3 decoder-only body; used for the caption encoder (Qwen3-Embedding-0.6B) and the 5 Hz LM."""

    vocab_size: int = 151_669
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32_768


TURBO_2B = AceStepConfig()
XL = AceStepConfig(
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    encoder_hidden_size=2048,
    encoder_intermediate_size=6144,
    encoder_num_attention_heads=16,
    encoder_num_key_value_heads=8,
    timbre_cls_token=True,
)
TINY = AceStepConfig(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    sliding_window=8,
    text_hidden_dim=32,
    num_lyric_encoder_hidden_layers=2,
    num_timbre_encoder_hidden_layers=2,
    num_attention_pooler_hidden_layers=2,
    fsq_dim=64,
)

QWEN3_EMBEDDING_06B = Qwen3Config()
QWEN3_TINY = Qwen3Config(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8
)


@dataclass(frozen=True)
class Preset:
    """Everything needed to build one family of networks."""

    name: str
    dit: AceStepConfig
    text: Qwen3Config
    vae: OobleckConfig
    description: str = ""
    aliases: tuple[str, ...] = field(default_factory=tuple)


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny", TINY, QWEN3_TINY, VAE_TINY, "seeded random weights, small widths, same key names (noise-like audio)"
    ),
    "turbo-2b": Preset(
        "turbo-2b", TURBO_2B, QWEN3_EMBEDDING_06B, VAE_FULL, "ACE-Step 1.5 turbo (2B DiT)", ("turbo", "2b")
    ),
    "xl": Preset("xl", XL, QWEN3_EMBEDDING_06B, VAE_FULL, "ACE-Step 1.5 XL turbo (5B DiT)", ("xl-turbo",)),
}


def get_preset(name: str) -> Preset:
    """Look a preset up by name or alias; unknown names raise with the list of valid ones."""
    key = name.strip().lower()
    for preset in PRESETS.values():
        if key == preset.name or key in preset.aliases:
            return preset
    raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
