"""The self-attention's q/k/v projections with q and k head-normed and rotated, as one custom op
(`torch.ops.flowjam.qkv_norm_rope`): one GEMM with the norms and RoPE in its epilogue where the kernel runs
(qkv_rope.py), the eager layer's math elsewhere. The kernel reads the three weights as the rows of one tensor
(`stack_qkv_weights` makes them so, at no extra memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.dit import DiTDecoder
from ..models.layers import Attention, apply_rope, stack_weights
from . import fused_kernels_available, supports


def stacked(*weights: torch.Tensor) -> torch.Tensor | None:
    """The [sum of N, K] tensor whose consecutive rows are these weights (`stack_qkv` made them so), else None."""
    first = weights[0]
    if any(not w.is_contiguous() or w.shape[1] != first.shape[1] for w in weights):
        return None
    storage = first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for weight in weights:
        if weight.untyped_storage().data_ptr() != storage or weight.storage_offset() != offset:
            return None  # separate tensors, however close the allocator put them
        offset += weight.numel()
    rows = sum(w.shape[0] for w in weights)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def stack_qkv(attn: Attention) -> bool:
    """Store the attention's q, k and v weights as consecutive rows of one tensor, what the fused q/k/v kernel reads
    (the parameters become views of it). Whether it moved them."""
    linears = (attn.q_proj, attn.k_proj, attn.v_proj)
    if any(type(linear) is not nn.Linear or linear.bias is not None for linear in linears):
        return False
    if stacked(*(linear.weight for linear in linears)) is not None:
        return False
    stack_weights(linears)
    return True


def stack_qkv_weights(decoder: DiTDecoder) -> int:
    """`stack_qkv` every DiT layer's self-attention; bumps the decoder's structure version when any moved, so tick
    graphs captured before (which read the old addresses) are never replayed. Returns how many it stacked."""
    moved = sum(stack_qkv(layer.self_attn) for layer in decoder.layers)
    if moved:
        decoder.structure_version += 1
    return moved


def _eager_qkv(
    h: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The eager layer's q, k and v (q and k normed per head, then rotated), joined token-major [B, S, N]."""
    batch, tokens, _ = h.shape
    head_dim = q_norm.shape[0]
    q = F.rms_norm(F.linear(h, w_q).view(batch, tokens, -1, head_dim), (head_dim,), q_norm, eps)
    k = F.rms_norm(F.linear(h, w_k).view(batch, tokens, -1, head_dim), (head_dim,), k_norm, eps)
    angles = (cos[:, None], sin[:, None])  # [S, 1, D]: over the heads of each token
    return torch.cat([apply_rope(q, *angles).flatten(2), apply_rope(k, *angles).flatten(2), F.linear(h, w_v)], dim=-1)


@torch.library.custom_op("flowjam::qkv_norm_rope", mutates_args=())
def qkv_norm_rope(
    h: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """[q | k | v] for h [B, S, K] and weights [Nq or Nk, K]: q and k RMS-normed per head (weights [head_dim]) and
    rotated by the tables cos, sin [S, head_dim] -> [B, S, Nq + 2 Nk], token-major. One kernel where it runs and the
    weights are stacked."""
    rows = stacked(w_q, w_k, w_v)
    batch, tokens, k = h.shape
    if rows is None or not fused_kernels_available(h.device) or not supports(batch * tokens, rows.shape[0], k):
        return _eager_qkv(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, eps)
    from . import qkv_rope

    if not qkv_rope.supports_head(q_norm.shape[0]):
        return _eager_qkv(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, eps)
    out = qkv_rope.qkv_norm_rope(h.reshape(-1, k), rows, q_norm, k_norm, cos, sin, w_q.shape[0], w_k.shape[0], eps)
    return out.view(batch, tokens, -1)


@qkv_norm_rope.register_fake
def _(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, eps: float) -> torch.Tensor:
    return h.new_empty(*h.shape[:-1], w_q.shape[0] + w_k.shape[0] + w_v.shape[0])


def split_heads(attn: Attention, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, heads or kv_heads, S, head_dim] as views of the op's token-major [B, S, N] output."""
    batch, tokens, _ = joined.shape
    d = attn.head_dim
    parts = joined.split([attn.heads * d, attn.kv_heads * d, attn.kv_heads * d], dim=-1)
    q, k, v = (part.view(batch, tokens, -1, d).transpose(1, 2) for part in parts)
    return q, k, v
