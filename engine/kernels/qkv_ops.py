"""The self-attention's q/k/v projections with q and k head-normed and rotated, as one custom op
(`torch.ops.flowjam.qkv_norm_rope`): where the kernels run, one GEMM with the norms and RoPE in its epilogue or
cuBLAS's GEMM and a norm + RoPE pass after it, whichever measured faster at the row band (qkv_rope.py); the eager
layer's math elsewhere. Both read the three weights as the rows of one tensor (`ops.stack_qkv_weights` makes them
so, at no extra memory)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..models.fp8 import stacked_fp8
from ..models.layers import Attention, apply_rope, stacked_rows
from . import fused_kernels_available, row_band, supports, supports_head
from .ops import takes_fused


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
    projected = (F.linear(h, w_q), F.linear(h, w_k), F.linear(h, w_v))
    return _normed_rotated(*projected, q_norm, k_norm, cos, sin, eps)


def _normed_rotated(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Projected q, k, v [B, S, N_i] -> [q | k | v] with q and k RMS-normed per head and rotated, as the eager layer."""
    batch, tokens, _ = q.shape
    head_dim = q_norm.shape[0]
    q = F.rms_norm(q.view(batch, tokens, -1, head_dim), (head_dim,), q_norm, eps)
    k = F.rms_norm(k.view(batch, tokens, -1, head_dim), (head_dim,), k_norm, eps)
    angles = (cos[:, None], sin[:, None])  # [S, 1, D]: over the heads of each token
    return torch.cat([apply_rope(q, *angles).flatten(2), apply_rope(k, *angles).flatten(2), v], dim=-1)


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
    rotated by the tables cos, sin [S, head_dim] -> [B, S, Nq + 2 Nk], token-major. One GEMM of the stacked weights
    (with the norms and rotation in its epilogue, or in a pass after it) where the kernels run."""
    rows = stacked_rows(w_q, w_k, w_v)
    batch, tokens, k = h.shape
    if (
        rows is None
        or not fused_kernels_available(h.device)
        or not supports(batch * tokens, rows.shape[0], k)
        or not supports_head(q_norm.shape[0])
    ):
        return _eager_qkv(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, eps)
    from . import qkv_rope

    a, (m, n) = h.reshape(-1, k), (batch * tokens, rows.shape[0])
    tables = (q_norm, k_norm, cos, sin, w_q.shape[0], w_k.shape[0], eps)

    def fused() -> torch.Tensor:
        return qkv_rope.qkv_norm_rope(a, rows, *tables)

    def unfused() -> torch.Tensor:
        return qkv_rope.norm_rope_columns(a @ rows.t(), *tables)

    key = ("qkv", row_band(m), n, k, h.dtype, h.device)
    return (fused() if takes_fused(key, m, n, k, fused, unfused) else unfused()).view(batch, tokens, n)


@qkv_norm_rope.register_fake
def _(h, w_q, w_k, w_v, q_norm, k_norm, cos, sin, eps: float) -> torch.Tensor:
    return h.new_empty(*h.shape[:-1], w_q.shape[0] + w_k.shape[0] + w_v.shape[0])


@torch.library.custom_op("flowjam::fp8_qkv_norm_rope", mutates_args=())
def fp8_qkv_norm_rope(
    values: torch.Tensor,
    row_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    s_q: torch.Tensor,
    s_k: torch.Tensor,
    s_v: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """`qkv_norm_rope` for FP8 projections: h as e4m3 rows [B * S, K] with their scales [B * S, 1], e4m3 weights
    [N_i, K] with theirs [1, N_i] -> [B * S, Nq + 2 Nk] in the rope tables' dtype. One `torch._scaled_mm` of the
    stacked weights (`models.fp8.stack_fp8`) and the norm + RoPE pass where the kernels run."""
    tokens = cos.shape[0]
    linears = ((w_q, s_q), (w_k, s_k), (w_v, s_v))
    stacked = stacked_fp8((w_q, w_k, w_v), (s_q, s_k, s_v))
    if stacked is None or not fused_kernels_available(values.device) or not supports_head(q_norm.shape[0]):
        projected = [
            torch._scaled_mm(values, w.t(), scale_a=row_scale, scale_b=s, out_dtype=cos.dtype).view(
                -1, tokens, w.shape[0]
            )
            for w, s in linears
        ]
        return _normed_rotated(*projected, q_norm, k_norm, cos, sin, eps).view(values.shape[0], -1)
    from . import qkv_rope

    rows, scales = stacked
    out = torch._scaled_mm(values, rows.t(), scale_a=row_scale, scale_b=scales, out_dtype=cos.dtype)
    return qkv_rope.norm_rope_columns(out, q_norm, k_norm, cos, sin, w_q.shape[0], w_k.shape[0], eps)


@fp8_qkv_norm_rope.register_fake
def _(values, row_scale, w_q, w_k, w_v, s_q, s_k, s_v, q_norm, k_norm, cos, sin, eps: float) -> torch.Tensor:
    n = w_q.shape[0] + w_k.shape[0] + w_v.shape[0]
    return values.new_empty(values.shape[0], n, dtype=cos.dtype)


def split_heads(attn: Attention, joined: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [B, heads or kv_heads, S, head_dim] as views of the op's token-major [B, S, N] output."""
    batch, tokens, _ = joined.shape
    d = attn.head_dim
    parts = joined.split([attn.heads * d, attn.kv_heads * d, attn.kv_heads * d], dim=-1)
    q, k, v = (part.view(batch, tokens, -1, d).transpose(1, 2) for part in parts)
    return q, k, v
