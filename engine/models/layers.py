"""Building blocks shared by the ACE-Step 1.5 networks: RMSNorm, RoPE, q/k-normed GQA attention, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def stack_weights(linears: tuple[nn.Linear, ...]) -> torch.Tensor:
    """Concatenate the weights of `linears` (rows after rows) and make each weight a slice of the result: one GEMM
    can then read them all, and nothing is stored twice."""
    stacked = torch.cat([linear.weight.detach() for linear in linears])
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight = nn.Parameter(stacked[start : start + rows], requires_grad=linear.weight.requires_grad)
        start += rows
    return stacked


def stacked_rows(*weights: torch.Tensor) -> torch.Tensor | None:
    """The [sum of N, K] tensor whose consecutive rows are these weights (`stack_weights` made them so), else None:
    what a kernel reading them as one tensor checks before it does. Detached, as `stack_weights` returns it, so a
    compiled step sees the same tensor on every call (a requires_grad flip recompiles it, fatal inside a capture)."""
    first = weights[0]
    if any(not w.is_contiguous() or w.shape[1] != first.shape[1] for w in weights):
        return None
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for weight in weights:
        if weight.untyped_storage().data_ptr() != storage or weight.storage_offset() != offset:
            return None  # separate tensors, however close the allocator put them
        offset += weight.numel()
    return first.detach().as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm with a learnable weight, via PyTorch's fused kernel (statistics in fp32 for half types).

    Qwen3 rounds the normalised value to the input dtype before the weight; the fused kernel applies the weight
    first. Identical in fp32; in bf16 they differ by at most one rounding (and the fused one is ~25% faster per tick).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(positions), head_dim] for rotate-half RoPE, computed in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, S, D] by the tables [S, D] (NEOX / rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def band_mask(length: int, window: int | None, device: torch.device | str) -> torch.Tensor | None:
    """Boolean [length, length] mask keeping |i - j| <= window; None when attention is unrestricted."""
    if window is None or window >= length - 1:
        return None
    idx = torch.arange(length, device=device)
    return (idx[:, None] - idx[None, :]).abs() <= window


def combine_masks(band: torch.Tensor | None, key_padding: torch.Tensor | None) -> torch.Tensor | None:
    """Merge a [L, L] band mask and a [B, L] key-valid mask into an SDPA boolean mask."""
    if key_padding is None:
        return band
    keys = key_padding.bool()[:, None, None, :]
    return keys if band is None else keys & band


class Attention(nn.Module):
    """Multi-head attention with GQA and per-head RMSNorm on q and k (Qwen3 / ACE-Step style, no biases)."""

    def __init__(
        self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float = 1e-6, kv_input: int | None = None
    ):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        kv_input = hidden if kv_input is None else kv_input
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_input, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_input, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[B, S, hidden] -> normed queries [B, heads, S, head_dim]."""
        b, s, _ = x.shape
        return self.q_norm(self.q_proj(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)

    def key_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, L, kv_input] -> (normed keys, values), each [B, kv_heads, L, head_dim]."""
        b, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.kv_heads, self.head_dim).transpose(1, 2)
        return k, v

    def heads_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool = False
    ) -> torch.Tensor:
        """SDPA over prepared heads: -> [B, heads, S, head_dim] (before the output projection)."""
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=self.kv_heads != self.heads
        )

    def flat_heads(self, heads: torch.Tensor) -> torch.Tensor:
        """[B, heads, S, head_dim] -> [B, S, heads * head_dim], what the output projection reads."""
        b, _, s, _ = heads.shape
        return heads.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)

    def project_out(self, heads: torch.Tensor) -> torch.Tensor:
        """[B, heads, S, head_dim] -> o_proj -> [B, S, hidden]."""
        return self.o_proj(self.flat_heads(heads))

    def self_heads(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Self-attention heads [B, heads, S, head_dim] with RoPE on q and k (after their norms), before o_proj."""
        q = self.query(x)
        k, v = self.key_value(x)
        cos, sin = rope
        return self.heads_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, mask, causal)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """Self-attention with RoPE on q and k (after their norms), projected out."""
        return self.project_out(self.self_heads(x, rope, mask, causal))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def activations(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate(x)) * up(x): what the down projection reads."""
        return F.silu(self.gate_proj(x)) * self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activations(x))


class TransformerBlock(nn.Module):
    """Pre-norm Qwen3 block: x + attn(norm(x)), then x + mlp(norm(x)). Used by encoders and the Qwen3 text model."""

    def __init__(self, hidden: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float = 1e-6):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = Attention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, causal)
        return x + self.mlp(self.post_attention_layernorm(x))
