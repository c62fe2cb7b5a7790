"""The ACE-Step 1.5 5 Hz LM: Qwen3ForCausalLM with tied embeddings and a pre-allocated KV cache (gpt-fast style).

Key names match the official checkpoints (`model.embed_tokens.weight`, `model.layers.{i}.*`, `model.norm.weight`;
no `lm_head.weight`: the output head is the token embedding). Vocabulary layout (spec §5.2): Qwen BPE + specials,
`<|im_end|>` = 151,645 ends a chat turn, audio code k is token AUDIO_CODE_BASE + k for k < 64,000 (`code_logits` is
the head over those rows only).

Generation state is a KV cache of plain tensors, one (keys, values) pair per layer, each
[batch, kv_heads, max_len, head_dim]. `prefill` fills positions start..start+L-1 for a whole prompt;
`decode_step` appends one token per row at that row's own position (rows may be at different positions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .layers import Attention, RMSNorm, SwiGLU, apply_rope, rope_cos_sin, stack_weights, stacked_rows
from .presets import Qwen3Config

LM_VOCAB = 217_204
AUDIO_CODE_BASE = 151_669  # <|audio_code_0|>
NUM_CODES = 64_000  # valid FSQ codes 8*8*8*5*5*5; slots 64,000..65,534 are unused

LM_PRESETS: dict[str, Qwen3Config] = {
    "tiny": Qwen3Config(
        vocab_size=LM_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=40_960,
    ),
    "lm-0.6b": Qwen3Config(
        vocab_size=LM_VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
    ),
    "lm-1.7b": Qwen3Config(
        vocab_size=LM_VOCAB,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
    ),
    "lm-4b": Qwen3Config(
        vocab_size=LM_VOCAB,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40_960,
    ),
}


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 block whose attention reads and writes a KV cache."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(
            c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = SwiGLU(c.hidden_size, c.intermediate_size)

    def forward(self, x, rope, write, cache, keys_end: int, mask, causal: bool) -> torch.Tensor:
        """x [B, S, H]; `write(cache_tensor, new)` stores new k or v into the cache; attention reads cache[:keys_end]."""
        attn = self.self_attn
        h = self.input_layernorm(x)
        cos, sin = rope
        q = apply_rope(attn.query(h), cos, sin)
        k, v = attn.key_value(h)
        k = apply_rope(k, cos, sin)
        k_cache, v_cache = cache
        write(k_cache, k)
        write(v_cache, v)
        heads = attn.heads_attention(q, k_cache[:, :, :keys_end], v_cache[:, :, :keys_end], mask, causal)
        x = x + attn.project_out(heads)
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_weights(self) -> DecodeWeights:
        """This layer's tensors for `decode_project` and `decode_attend`, with q/k/v and gate/up fused (see `fused_weights`)."""
        attn, (qkv, gate_up) = self.self_attn, self.fused_weights()
        return DecodeWeights(
            self.input_layernorm.weight,
            qkv,
            attn.q_norm.weight,
            attn.k_norm.weight,
            attn.o_proj.weight,
            self.post_attention_layernorm.weight,
            gate_up,
            self.mlp.down_proj.weight,
        )

    def fused_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([q; k; v] rows, [gate; up] rows): one tensor each, with the projection parameters re-pointed at slices
        of it, so nothing is stored twice and the checkpoint keys stay. Rebuilt if the parameters were replaced
        (`.to()`, `load_state_dict(assign=True)`). Note: safetensors refuses to save such slices as they are;
        save `{k: v.clone()}`."""
        attn, mlp = self.self_attn, self.mlp
        fused = []
        for linears in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
            rows = stacked_rows(*(linear.weight for linear in linears))
            fused.append(stack_weights(linears) if rows is None else rows)
        return fused[0], fused[1]


class DecodeWeights(NamedTuple):
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q; k; v] projection rows
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [gate; up] projection rows
    down: torch.Tensor


class HeadShape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    grouped: bool  # heads != kv_heads, as a bool: torch.compile keeps bools constant where ints turn symbolic


def decode_project(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    w: DecodeWeights,
    shape: HeadShape,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    at: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    """First half of one layer's one-token step: x [B, 1, H] -> q [B, heads, 1, D], with the q and k head norms in
    one pass and RoPE applied; the new keys and values are written in place into the caches at `at` (`cache_slots`:
    each row's position in cache rows 0..B-1; compiled, the write is part of the kernel that makes k, not a pass of
    its own)."""
    heads, kv_heads, head_dim, eps, _ = shape
    b = x.shape[0]
    qkv = F.linear(F.rms_norm(x, (x.shape[-1],), w.input_norm, eps), w.qkv).view(b, 1, -1, head_dim).transpose(1, 2)
    qk, v = qkv.split([heads + kv_heads, kv_heads], dim=1)
    norm_weights = torch.cat([w.q_norm.expand(heads, -1), w.k_norm.expand(kv_heads, -1)])
    qk = F.rms_norm(qk, (head_dim,), eps=eps) * norm_weights[:, None]
    q, k = apply_rope(qk, cos, sin).split([heads, kv_heads], dim=1)
    k_cache.index_put_(at, k[:, :, 0])  # [B, kv_heads, D] at (row, head, the row's position)
    v_cache.index_put_(at, v[:, :, 0])
    return q


def cache_slots(positions: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where a decode step writes its keys and values: (rows [B, 1], kv heads [kv_heads], positions [B, 1]), which
    index a [B, kv_heads, T, D] cache at every row's kv heads at that row's position; made once per step."""
    rows = torch.arange(positions.shape[0], device=positions.device)[:, None]
    return rows, torch.arange(kv_heads, device=positions.device), positions[:, None]


def decode_attend(
    x: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    mask: torch.Tensor,
    w: DecodeWeights,
    shape: HeadShape,
) -> torch.Tensor:
    """Second half: attention over cache rows 0..B-1 (keys 0..keys_end-1, `mask` [B, 1, 1, keys_end] additive, as
    `decode_inputs` makes it), output projection and MLP."""
    heads, _, head_dim, eps, grouped = shape
    b, keys_end = x.shape[0], mask.shape[-1]
    attended = F.scaled_dot_product_attention(
        q, k_cache[:b, :, :keys_end], v_cache[:b, :, :keys_end], attn_mask=mask, enable_gqa=grouped
    )
    x = x + F.linear(attended.transpose(1, 2).reshape(b, 1, heads * head_dim), w.o)
    gate, up = F.linear(F.rms_norm(x, (x.shape[-1],), w.post_norm, eps), w.gate_up).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, w.down)


def decode_attend_project(
    x: torch.Tensor,
    q: torch.Tensor,
    mask: torch.Tensor,
    layer: tuple[DecodeWeights, torch.Tensor, torch.Tensor],
    following: tuple[DecodeWeights, torch.Tensor, torch.Tensor],
    shape: HeadShape,
    cos: torch.Tensor,
    sin: torch.Tensor,
    at: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's second half and the following layer's first half, `layer` and `following` each (weights, key
    cache, value cache): compiled as one, the residual add ending a layer and the norm starting the next are one
    kernel. -> (x, the following layer's q)."""
    weights, k_cache, v_cache = layer
    x = decode_attend(x, q, k_cache, v_cache, mask, weights, shape)
    weights, k_cache, v_cache = following
    return x, decode_project(x, cos, sin, weights, shape, k_cache, v_cache, at)


def decode_attend_last(
    x: torch.Tensor,
    q: torch.Tensor,
    mask: torch.Tensor,
    layer: tuple[DecodeWeights, torch.Tensor, torch.Tensor],
    shape: HeadShape,
    final_norm: torch.Tensor,
) -> torch.Tensor:
    """The last layer's second half and the final norm: -> hidden [B, H]."""
    weights, k_cache, v_cache = layer
    x = decode_attend(x, q, k_cache, v_cache, mask, weights, shape)
    return F.rms_norm(x, (x.shape[-1],), final_norm, shape.eps)[:, 0]


class DecodeInputs(NamedTuple):
    x: torch.Tensor  # [B, 1, H] the fed tokens' embeddings
    cos: torch.Tensor  # [B, 1, 1, D] RoPE tables at each row's position
    sin: torch.Tensor
    mask: torch.Tensor  # [B, 1, 1, keys_end] additive: 0 where a row sees the key, -inf beyond its position
    at: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # `cache_slots`


def decode_inputs(
    tokens: torch.Tensor, positions: torch.Tensor, embedding: torch.Tensor, keys: torch.Tensor, config: Qwen3Config
) -> DecodeInputs:
    """What every layer of a one-token step reads, made once per step from the fed tokens, their positions and
    the key positions read (`keys` = 0..keys_end-1)."""
    x = F.embedding(tokens, embedding)[:, None]
    cos, sin = rope_cos_sin(positions, config.head_dim, config.rope_theta, x.dtype)
    seen = keys[None, :] <= positions[:, None]
    mask = torch.zeros(seen.shape, dtype=x.dtype, device=x.device).masked_fill(~seen, float("-inf"))
    at = cache_slots(positions, config.num_key_value_heads)
    return DecodeInputs(x, cos[:, None, None], sin[:, None, None], mask[:, None, None], at)


class LayerStep(NamedTuple):
    """How a decode step runs: its inputs, the first layer's first half, each later layer's first half together
    with the layer before's second half, and the last layer's second half; eager, or compiled by torch.compile.
    Each first half writes its layer's new keys and values into the caches in place."""

    inputs: Callable = decode_inputs
    project: Callable = decode_project
    attend_project: Callable = decode_attend_project
    attend_last: Callable = decode_attend_last


EAGER_STEP = LayerStep()


def compiled_layer_step() -> LayerStep:
    """torch.compile'd parts: norms, RoPE and elementwise ops fuse into a few kernels, the middle part shared by
    every layer."""
    return LayerStep(*(torch.compile(part, fullgraph=True) for part in EAGER_STEP))


class Body(nn.Module):
    """The `model.` part of Qwen3ForCausalLM: embeddings, layers, final norm."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3LM(nn.Module):
    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.model = Body(config)
        self.kv_cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._key_positions = torch.arange(0)

    # ---- cache -------------------------------------------------------------------------------------------------

    def setup_cache(self, batch: int, max_len: int) -> None:
        """Allocate zeroed K and V tensors [batch, kv_heads, max_len, head_dim] per layer (parameter dtype/device)."""
        c = self.config
        weight = self.model.embed_tokens.weight
        shape = (batch, c.num_key_value_heads, max_len, c.head_dim)
        self.kv_cache = [
            (
                torch.zeros(shape, dtype=weight.dtype, device=weight.device),
                torch.zeros(shape, dtype=weight.dtype, device=weight.device),
            )
            for _ in range(c.num_hidden_layers)
        ]

    def key_positions(self, keys_end: int) -> torch.Tensor:
        """0..keys_end-1 on the weights' device: a view of one tensor made once, not a tensor made every step; marked
        dynamic in length, so a compiled step takes every keys_end without compiling again (torch.compile carries
        the mark to the mask made from it, and so to every part that reads the mask)."""
        device = self.model.embed_tokens.weight.device
        if self._key_positions.shape[0] < keys_end or self._key_positions.device != device:
            self._key_positions = torch.arange(max(keys_end, self.cache_len), device=device)
        keys = self._key_positions[:keys_end]
        torch._dynamo.maybe_mark_dynamic(keys, 0)
        return keys

    @property
    def cache_len(self) -> int:
        return self.kv_cache[0][0].shape[2] if self.kv_cache else 0

    # ---- heads -------------------------------------------------------------------------------------------------

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits through the tied embedding: [..., H] -> [..., V]."""
        return F.linear(hidden, self.model.embed_tokens.weight)

    def code_head(self) -> torch.Tensor:
        """The tied embedding's rows of the 64,000 valid codes [64,000, H]: a view (they are contiguous)."""
        return self.model.embed_tokens.weight[AUDIO_CODE_BASE : AUDIO_CODE_BASE + NUM_CODES]

    def code_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of the 64,000 valid code tokens only: [..., H] -> [..., 64,000] (index k = code k).

        The code rows of the tied embedding are contiguous, so this head is a view: nothing is copied per call."""
        return F.linear(hidden, self.code_head())

    # ---- passes ------------------------------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Cache-free causal pass over [B, L] -> logits [B, L, V] (reference path; uses a temporary cache)."""
        saved = self.kv_cache
        self.setup_cache(input_ids.shape[0], input_ids.shape[1])
        try:
            return self.logits(self.prefill_hidden(input_ids, 0))
        finally:
            self.kv_cache = saved

    def prefill_hidden(self, input_ids: torch.Tensor, start: int = 0, row: int = 0) -> torch.Tensor:
        """Run a prompt [B, L] at positions start..start+L-1 into cache rows row..row+B-1; -> final-norm hidden [B, L, H]."""
        c = self.config
        b, length = input_ids.shape
        end = start + length
        if end > self.cache_len or row + b > self.kv_cache[0][0].shape[0]:
            raise ValueError(
                f"prompt rows {row}..{row + b - 1}, positions {start}:{end} do not fit the cache; call setup_cache first"
            )
        x = self.model.embed_tokens(input_ids)
        positions = torch.arange(start, end, device=input_ids.device)
        rope = rope_cos_sin(positions, c.head_dim, c.rope_theta, x.dtype)
        mask = None
        if start > 0:  # queries at start+i see keys 0..start+i
            mask = torch.arange(end, device=x.device)[None, :] <= positions[:, None]

        def write(cache: torch.Tensor, new: torch.Tensor) -> None:
            cache[:, :, start:end] = new

        for layer, (k_cache, v_cache) in zip(self.model.layers, self.kv_cache):
            x = layer(x, rope, write, (k_cache[row : row + b], v_cache[row : row + b]), end, mask, causal=start == 0)
        return self.model.norm(x)

    def prefill(self, input_ids: torch.Tensor, start: int = 0, row: int = 0) -> torch.Tensor:
        """Prefill cache rows row..row+B-1 with a prompt [B, L]; -> full-vocabulary logits of the last position [B, V]."""
        return self.logits(self.prefill_hidden(input_ids, start, row)[:, -1])

    def decode_hidden(
        self, tokens: torch.Tensor, positions: torch.Tensor, keys_end: int | None = None, step: LayerStep = EAGER_STEP
    ) -> torch.Tensor:
        """One token per row: tokens [B] (cache rows 0..B-1) at positions [B] (written into the cache there) -> hidden [B, H].

        Each row attends causally to its cache entries 0..position (its own earlier tokens). `keys_end` (default:
        the whole cache) bounds the keys read; every position must be below it. Same math as `forward`, with
        fused q/k/v and gate/up GEMMs."""
        c = self.config
        positions = torch.as_tensor(positions, device=tokens.device).expand(tokens.shape[0])
        keys_end = self.cache_len if keys_end is None else keys_end
        heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
        shape = HeadShape(heads, kv_heads, c.head_dim, c.rms_norm_eps, heads != kv_heads)
        keys = self.key_positions(keys_end)
        x, cos, sin, mask, at = step.inputs(tokens, positions, self.model.embed_tokens.weight, keys, c)
        layers = [(layer.decode_weights(), *cache) for layer, cache in zip(self.model.layers, self.kv_cache)]
        weights, k_cache, v_cache = layers[0]
        q = step.project(x, cos, sin, weights, shape, k_cache, v_cache, at)
        for layer, following in zip(layers, layers[1:]):
            x, q = step.attend_project(x, q, mask, layer, following, shape, cos, sin, at)
        return step.attend_last(x, q, mask, layers[-1], shape, self.model.norm.weight)

    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, keys_end: int | None = None) -> torch.Tensor:
        """One token per row at the given positions -> full-vocabulary logits [B, V]."""
        return self.logits(self.decode_hidden(tokens, positions, keys_end))
