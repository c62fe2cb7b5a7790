"""ACE-Step 1.5 DiT decoder (`decoder.*` keys): AdaLN-modulated transformer over patch-2 latent tokens.

Inputs are batch-first: noisy latents x_t [B, T, 64], t [B], context latents [B, T, 128] (source || chunk
mask) and a condition (encoder states [B, L, Hc], or the cross-attention K/V already built from them).
Output: velocity [B, T, 64] (flow matching: x_t = t*noise + (1-t)*x0, v = noise - x0).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .fp8 import Fp8Rows
from .layers import Attention, RMSNorm, SwiGLU, band_mask, rope_cos_sin
from .presets import AceStepConfig

TIMESTEP_FREQ_DIM = 256
TIMESTEP_SCALE = 1000.0


def timestep_sinusoid(t: torch.Tensor, dim: int = TIMESTEP_FREQ_DIM) -> torch.Tensor:
    """[cos | sin] features of t*1000 with periods up to 10000, in fp32: [B] -> [B, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * TIMESTEP_SCALE)[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class TimestepEmbedding(nn.Module):
    """t -> (temb [B, H], six modulation vectors [B, 6, H])."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(TIMESTEP_FREQ_DIM, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)
        self.time_proj = nn.Linear(hidden, hidden * 6)

    def forward(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        features = timestep_sinusoid(t).to(self.linear_1.weight.dtype)
        temb = self.linear_2(F.silu(self.linear_1(features)))
        return temb, self.time_proj(F.silu(temb)).unflatten(1, (6, -1))


class PatchConv(nn.Sequential):
    """Conv with the patch size as kernel and stride, wrapped so its weights sit at index 1 like the official
    `Sequential(transpose, conv, transpose)`; works on [B, T, C] tensors."""

    def __init__(self, conv: nn.Module):
        super().__init__(nn.Identity(), conv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self[1](x.transpose(1, 2)).transpose(1, 2)


@dataclass
class CrossKV:
    """Cross-attention keys/values of one condition for every layer, built once and reused every step."""

    keys: list[torch.Tensor]  # per layer [B, kv_heads, L, head_dim]
    values: list[torch.Tensor]


@dataclass(frozen=True)
class CrossGroup:
    """A contiguous run of batch rows [start, start + count) that cross-attend to one condition. `kv` has batch 1
    (shared by every row of the group) or `count`."""

    kv: CrossKV
    start: int
    count: int


CrossSlice = tuple[torch.Tensor, torch.Tensor, int, int]  # one group at one layer: keys, values, start, count
Pending = tuple[torch.Tensor, torch.Tensor]
"""A layer's MLP output and its gate, not yet added to x: the next layer adds them in its first norm's pass."""


def _group_attention(attn: Attention, q: torch.Tensor, cross: tuple[CrossSlice, ...]) -> torch.Tensor:
    """Cross-attention heads [R, heads, S, D] with each group's rows attending to its own condition.

    Groups are contiguous and in row order. Where every condition has the same length, one attention call covers
    the batch: with as many rows in each group and one K/V per condition, each group's rows are one long query
    sequence over its condition's K/V (`_folded_attention`: the K/V are stacked once per group, not once per row);
    otherwise their K/V are stacked row by row (a sixth of the bytes that joining the per-group outputs would move,
    at 60 s). Where lengths differ each group attends on its slice and the results are joined. Rows of different
    conditions never share a padded K/V tensor, so a row's result does not depend on the other rows in the batch
    (stream == one-shot generation, bit for bit)."""
    rows = [_rows_of(k, v, count) for k, v, _, count in cross]
    if len(rows) == 1:
        heads = attn.heads_attention(q, *rows[0], None)
    elif _foldable(q, cross):
        heads = _folded_attention(attn, q, cross)
    elif len({k.shape[2] for k, _ in rows}) == 1:
        keys, values = zip(*rows)
        heads = attn.heads_attention(q, torch.cat(keys), torch.cat(values), None)
    else:
        starts = [(start, count) for *_, start, count in cross]
        heads = torch.cat([attn.heads_attention(q.narrow(0, s, n), k, v, None) for (k, v), (s, n) in zip(rows, starts)])
    return _token_major(heads)


def _foldable(q: torch.Tensor, cross: tuple[CrossSlice, ...]) -> bool:
    """Whether the groups can attend as `_folded_attention` does: equal row counts, one K/V each (batch 1) of one
    length, and queries stored token-major (so folding rows into the sequence moves no data)."""
    return (
        len({count for *_, count in cross}) == 1
        and all(k.shape[0] == 1 for k, *_ in cross)
        and len({k.shape[2] for k, *_ in cross}) == 1
        and q.transpose(1, 2).is_contiguous()
    )


def _folded_attention(attn: Attention, q: torch.Tensor, cross: tuple[CrossSlice, ...]) -> torch.Tensor:
    """One attention call for G groups of c rows: queries [R, heads, S, D] viewed as [G, heads, c * S, D] (each
    group's rows one sequence; cross-attention has no mask, so every query still sees only its condition's keys)
    over the G conditions' K/V stacked as [G, kv_heads, L, D]."""
    rows, heads, tokens, dim = q.shape
    groups = len(cross)
    folded = q.transpose(1, 2).view(groups, rows // groups * tokens, heads, dim).transpose(1, 2)
    keys, values = torch.cat([k for k, *_ in cross]), torch.cat([v for _, v, *_ in cross])
    out = attn.heads_attention(folded, keys, values, None)
    return out.transpose(1, 2).reshape(rows, tokens, heads, dim).transpose(1, 2)


def _token_major(heads: torch.Tensor) -> torch.Tensor:
    """Heads [R, heads, S, D] laid out token-major in memory (what the output projection reads, and what SDPA
    returns): one stride for every group layout, so a compiled layer half never recompiles for a new one (a
    joined result is copied once; an SDPA result is returned as is)."""
    return heads.transpose(1, 2).contiguous().transpose(1, 2)


def _rows_of(k: torch.Tensor, v: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A group's K/V with one row per batch row (a batch-1 condition is expanded, not copied)."""
    if k.shape[0] == 1 and count > 1:
        return k.expand(count, -1, -1, -1), v.expand(count, -1, -1, -1)
    return k, v


class DiTLayer(nn.Module):
    def __init__(self, config: AceStepConfig, index: int):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.sliding = config.layer_is_sliding(index)
        self.self_attn_norm = RMSNorm(h, eps)
        self.self_attn = Attention(h, heads, kv, hd, eps)
        self.cross_attn_norm = RMSNorm(h, eps)
        self.cross_attn = Attention(h, heads, kv, hd, eps)
        self.mlp_norm = RMSNorm(h, eps)
        self.mlp = SwiGLU(h, config.intermediate_size)
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, h) / h**0.5)

    def forward(
        self,
        x: torch.Tensor,
        modulation: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        self_mask: torch.Tensor | None,
        cross: tuple[CrossSlice, ...],
    ) -> torch.Tensor:
        """One layer over every row (`modulation` the decoder's, [B, 6, H]); `cross` is this layer's K/V per
        condition group."""
        x, pending = run_layer(LayerStages(), self, x, None, self.modulation(modulation), rope, self_mask, cross)
        return gated_add(x, *pending)

    def modulation(self, modulation: torch.Tensor) -> torch.Tensor:
        """This layer's six AdaLN vectors [B, 6, H] from the decoder's timestep modulation (what `attend_self` and
        `finish` take; `DiTDecoder.layer_modulations` makes every layer's at once)."""
        return self.scale_shift_table + modulation

    def attend_self(
        self,
        x: torch.Tensor,
        pending: Pending | None,
        modulation: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        self_mask: torch.Tensor | None,
        ops: LayerOps | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer up to its cross-attention: the previous layer's `pending` MLP output added, then modulated
        self-attention -> (x, cross-attention queries). `modulation`: this layer's (`DiTLayer.modulation`)."""
        ops = EAGER_OPS if ops is None else ops
        shift, scale, gate = modulation[:, :3].chunk(3, dim=1)
        attn, cross = self.self_attn, self.cross_attn
        into = (attn.q_proj, attn.k_proj, attn.v_proj)
        if pending is None:
            h = ops.modulated_norm(self.self_attn_norm, x, scale, shift, into)
        else:
            x, h = ops.add_norm(x, *pending, self.self_attn_norm, scale, shift, into)
        heads = attn.flat_heads(ops.self_attention(attn, h, rope, self_mask))
        x, h = ops.residual_norm(x, attn.o_proj, heads, gate, self.cross_attn_norm, None, None, (cross.q_proj,))
        return x, cross.query(h)

    def finish(
        self, x: torch.Tensor, cross_heads: torch.Tensor, modulation: torch.Tensor, ops: LayerOps | None = None
    ) -> tuple[torch.Tensor, Pending]:
        """The layer after its cross-attention heads: output projection, then the modulated MLP -> (x, the MLP's
        output and gate, still to add: `Pending`)."""
        ops = EAGER_OPS if ops is None else ops
        mlp_shift, mlp_scale, mlp_gate = modulation[:, 3:].chunk(3, dim=1)
        heads, mlp = self.cross_attn.flat_heads(cross_heads), self.mlp
        into = (mlp.gate_proj, mlp.up_proj)
        x, h = ops.residual_norm(x, self.cross_attn.o_proj, heads, None, self.mlp_norm, mlp_scale, mlp_shift, into)
        return x, (ops.project(mlp.down_proj, ops.swiglu(mlp, h)), mlp_gate)


def gated_add(x: torch.Tensor, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """x + out * gate, in x's dtype (gate [B, 1, N], one per batch row; None: x + out)."""
    return x + out if gate is None else (x + out * gate).type_as(x)


def modulated(
    h: torch.Tensor, like: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None
) -> torch.Tensor:
    """AdaLN's h * (1 + scale) + shift in `like`'s dtype (scale and shift [B, 1, N]; None: h as it is)."""
    return h if scale is None else (h * (1 + scale) + shift).type_as(like)


class LayerOps:
    """A DiT layer's GEMMs with the elementwise work around them (residuals, SwiGLU, norms with AdaLN modulation):
    plain PyTorch here; `engine.kernels.fused_ops.FusedOps` implements the same methods with fused Triton kernels.
    A norm's `into` names the projections that read its result: the fused ops hand FP8 ones their input quantised
    (`Fp8Rows`), as they do the SwiGLU's activations to an FP8 down projection."""

    @staticmethod
    def project(linear: nn.Module, inputs: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """linear(inputs), a projection whose output a residual adds."""
        return linear(inputs)

    @staticmethod
    def self_attention(
        attn: Attention, h: torch.Tensor | Fp8Rows, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        """The self-attention's heads [B, heads, S, head_dim] before its output projection (q and k normed, then
        rotated)."""
        return attn.self_heads(h, rope, mask)

    @staticmethod
    def swiglu(mlp: SwiGLU, h: torch.Tensor | Fp8Rows) -> torch.Tensor | Fp8Rows:
        """The MLP's activations before its down projection: silu(gate(h)) * up(h)."""
        return mlp.activations(h)

    @staticmethod
    def modulated_norm(
        norm: RMSNorm,
        x: torch.Tensor,
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
        into: tuple[nn.Module, ...] = (),
    ) -> torch.Tensor | Fp8Rows:
        """norm(x) * (1 + scale) + shift (scale and shift [B, 1, N]; None: the norm alone)."""
        return modulated(norm(x), x, scale, shift)

    def add_norm(
        self,
        x: torch.Tensor,
        delta: torch.Tensor,
        gate: torch.Tensor | None,
        norm: RMSNorm,
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
        into: tuple[nn.Module, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """(x', the next block's input): x' = x + delta * gate (gate [B, 1, N], one per batch row; None: no gate),
        then `modulated_norm` of x'."""
        x = gated_add(x, delta, gate)
        return x, self.modulated_norm(norm, x, scale, shift, into)

    def residual_norm(
        self,
        x: torch.Tensor,
        linear: nn.Module,
        inputs: torch.Tensor,
        gate: torch.Tensor | None,
        norm: RMSNorm,
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
        into: tuple[nn.Module, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
        """`add_norm` of linear(inputs)."""
        return self.add_norm(x, self.project(linear, inputs), gate, norm, scale, shift, into)


EAGER_OPS = LayerOps()


@dataclass(frozen=True)
class LayerStages:
    """How a layer's two halves run around its cross-attention (plain methods, or compiled ones). The
    cross-attention between them always runs as is: its condition groups (how many, how long) vary from tick to
    tick, so compiled code never sees them and never recompiles for a new prompt or group layout."""

    attend_self: Callable[..., tuple[torch.Tensor, torch.Tensor]] = DiTLayer.attend_self
    finish: Callable[..., tuple[torch.Tensor, Pending]] = DiTLayer.finish


def run_layer(
    stages: LayerStages,
    layer: DiTLayer,
    x: torch.Tensor,
    pending: Pending | None,
    modulation: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    self_mask: torch.Tensor | None,
    cross: tuple[CrossSlice, ...],
) -> tuple[torch.Tensor, Pending]:
    """One layer (the previous one's MLP output `pending`, this layer's `modulation`): its first half, the grouped
    cross-attention, its second half -> (x, its own MLP output still to add)."""
    x, queries = stages.attend_self(layer, x, pending, modulation, rope, self_mask)
    return stages.finish(layer, x, _group_attention(layer.cross_attn, queries, cross), modulation)


class DiTDecoder(nn.Module):
    def __init__(self, config: AceStepConfig):
        super().__init__()
        self.config = config
        h, p = config.hidden_size, config.patch_size
        self.proj_in = PatchConv(nn.Conv1d(config.in_channels, h, kernel_size=p, stride=p))
        self.time_embed = TimestepEmbedding(h)
        self.time_embed_r = TimestepEmbedding(h)
        self.condition_embedder = nn.Linear(config.condition_width, h)
        self.layers = nn.ModuleList(DiTLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm_out = RMSNorm(h, config.rms_norm_eps)
        self.proj_out = PatchConv(nn.ConvTranspose1d(h, config.audio_acoustic_hidden_dim, kernel_size=p, stride=p))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, h) / h**0.5)
        self._folded_r: tuple[torch.Tensor, torch.Tensor] | None = None
        self.cross_kv_version = 0  # bumped when what build_cross_kv computes changes (LoRAs on cross K/V)
        self.structure_version = 0  # bumped when layers are swapped (LoRAs attached or detached): tick graphs renew
        self.register_load_state_dict_post_hook(lambda module, _keys: module.clear_folded_constants())

    def clear_folded_constants(self) -> None:
        """Forget the cached `time_embed_r(0)`; call after changing weights in place."""
        self._folded_r = None

    def _time_embedding_r0(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`time_embed_r(t - r)` with r = t (always, at inference) is a constant: compute it once."""
        cached = self._folded_r
        if cached is None or cached[0].device != like.device or cached[0].dtype != like.dtype:
            with torch.no_grad():
                temb, tproj = self.time_embed_r(torch.zeros(1, device=like.device))
            cached = (temb.to(like.dtype), tproj.to(like.dtype))
            self._folded_r = cached
        return cached

    def timestep_modulation(
        self, t: torch.Tensor, t_r: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(temb [B, H], per-layer modulation [B, 6, H]) for timesteps t (and optional mean-flow r)."""
        temb, tproj = self.time_embed(t)
        if t_r is None:
            temb_r, tproj_r = self._time_embedding_r0(temb)
        else:
            temb_r, tproj_r = self.time_embed_r(t - t_r)
        return temb + temb_r, tproj + tproj_r

    def layer_modulations(self, modulation: torch.Tensor) -> torch.Tensor:
        """Every layer's `DiTLayer.modulation` at once, [layers, B, 6, H]: one kernel a forward, not one in each
        layer half."""
        tables = torch.cat([layer.scale_shift_table for layer in self.layers])
        return tables.unsqueeze(1) + modulation.unsqueeze(0)

    def build_cross_kv(self, encoder_hidden_states: torch.Tensor) -> CrossKV:
        """Embed a condition [B, L, Hc] and project it to every layer's cross-attention K/V (every token attends,
        as in the reference)."""
        embedded = self.condition_embedder(encoder_hidden_states)
        keys, values = zip(*(layer.cross_attn.key_value(embedded) for layer in self.layers))
        return CrossKV(list(keys), list(values))

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        context_latents: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        cross_kv: CrossKV | None = None,
        timestep_r: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Velocity [B, T, 64]. Give either `encoder_hidden_states` or a prebuilt `cross_kv` (batch 1 or B)."""
        if (encoder_hidden_states is None) == (cross_kv is None):
            raise ValueError("pass exactly one of encoder_hidden_states or cross_kv")
        if cross_kv is None:
            cross_kv = self.build_cross_kv(encoder_hidden_states)
        temb, modulation = self.timestep_modulation(timestep, timestep_r)
        group = CrossGroup(cross_kv, 0, hidden_states.shape[0])
        return self.forward_rows(hidden_states, temb, modulation, context_latents, [group])

    def forward_rows(
        self,
        hidden_states: torch.Tensor,
        temb: torch.Tensor,
        modulation: torch.Tensor,
        context_latents: torch.Tensor,
        groups: list[CrossGroup],
        stages: LayerStages | None = None,
    ) -> torch.Tensor:
        """The batched forward a stream tick runs: rows with their own timestep embeddings (temb [R, H],
        modulation [R, 6, H]) and conditions (`groups` cover every row once, in order) -> velocity [R, T, 64].
        `stages` runs each layer's halves (compiled ones, say); by default the layer's own methods."""
        frames = hidden_states.shape[1]
        x = torch.cat([context_latents, hidden_states], dim=-1)
        pad = (-frames) % self.config.patch_size
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        x = self.proj_in(x)
        tokens = x.shape[1]
        rope = rope_cos_sin(
            torch.arange(tokens, device=x.device), self.config.head_dim, self.config.rope_theta, x.dtype
        )
        sliding = band_mask(tokens, self.config.sliding_window, x.device)
        stages = LayerStages() if stages is None else stages
        pending = None
        for index, (layer, layer_modulation) in enumerate(zip(self.layers, self.layer_modulations(modulation))):
            cross = tuple((g.kv.keys[index], g.kv.values[index], g.start, g.count) for g in groups)
            mask = sliding if layer.sliding else None
            x, pending = run_layer(stages, layer, x, pending, layer_modulation, rope, mask, cross)
        x = gated_add(x, *pending)
        shift, scale = (self.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        x = (self.norm_out(x) * (1 + scale) + shift).type_as(x)
        return self.proj_out(x)[:, :frames]
