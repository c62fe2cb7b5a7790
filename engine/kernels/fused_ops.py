"""A DiT layer through the fused kernels (`FusedOps`, what compile-graph runs on GPUs that run them); docs/benchmarks.md,
"Fused kernels", has the measurements."""

from __future__ import annotations

import torch
from torch import nn

from ..models.dit import LayerOps
from ..models.fp8 import Fp8Linear, Fp8Rows
from ..models.layers import Attention, RMSNorm, SwiGLU
from .ops import plain_linears
from .qkv_ops import split_heads


def _qkv_taken(attn: Attention) -> bool:
    """Whether this self-attention runs its q/k/v through the one-GEMM op (plain linears; the op itself checks that
    the weights are stacked, as compiled code never reads addresses, and picks its kernel per row band)."""
    return plain_linears(attn.q_proj, attn.k_proj, attn.v_proj)


class FusedOps(LayerOps):
    """A DiT layer through the fused ops: the SwiGLU and the self-attention's q/k/v with their norms and RoPE always
    (each op measures its two paths per row band; FP8 q/k/v as one scaled GEMM and the norm + RoPE pass), every
    norm and modulation in one pass with the gated residual before it, and every FP8 projection's input quantised
    by the pass that makes it. LoRA-wrapped linears run as LayerOps' (the norm pass after them still runs)."""

    @staticmethod
    def project(linear: nn.Module, inputs: torch.Tensor | Fp8Rows) -> torch.Tensor:
        return linear(_input_for(linear, inputs))

    @staticmethod
    def self_attention(
        attn: Attention, h: torch.Tensor | Fp8Rows, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(h, Fp8Rows):  # the norm pass quantised h: q, k and v are bare FP8 linears
            q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
            weights = (q.weight, k.weight, v.weight, q.weight_scale, k.weight_scale, v.weight_scale)
            norms = (attn.q_norm.weight, attn.k_norm.weight)
            joined = torch.ops.flowjam.fp8_qkv_norm_rope(h.values, h.scale, *weights, *norms, *rope, attn.q_norm.eps)
            return attn.heads_attention(*split_heads(attn, joined.view(*h.shape[:-1], -1)), mask)
        if not _qkv_taken(attn):
            return LayerOps.self_attention(attn, h, rope, mask)
        weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_norm.weight, attn.k_norm.weight)
        joined = torch.ops.flowjam.qkv_norm_rope(h, *weights, *rope, attn.q_norm.eps)
        return attn.heads_attention(*split_heads(attn, joined), mask)

    @staticmethod
    def swiglu(mlp: SwiGLU, h: torch.Tensor | Fp8Rows) -> torch.Tensor | Fp8Rows:
        """The fused SwiGLU GEMM for plain linears; before an FP8 down projection, silu(gate) * up quantised by rows
        in the pass that multiplies them."""
        if _reads_fp8_rows((mlp.down_proj,)):
            gate = mlp.gate_proj(h)
            values, row_scale = torch.ops.flowjam.quantize_input(gate, mlp.up_proj(h))
            return Fp8Rows(values, row_scale, tuple(gate.shape))
        if not plain_linears(mlp.gate_proj, mlp.up_proj):
            return LayerOps.swiglu(mlp, h)
        return torch.ops.flowjam.swiglu(h, mlp.gate_proj.weight, mlp.up_proj.weight)

    @staticmethod
    def modulated_norm(
        norm: RMSNorm,
        x: torch.Tensor,
        scale: torch.Tensor | None,
        shift: torch.Tensor | None,
        into: tuple[nn.Module, ...] = (),
    ) -> torch.Tensor | Fp8Rows:
        if _reads_fp8_rows(into):
            values, row_scale = torch.ops.flowjam.norm_quantize(x, norm.weight, scale, shift, norm.eps)
            return Fp8Rows(values, row_scale, tuple(x.shape))
        return torch.ops.flowjam.norm_modulate(x, norm.weight, scale, shift, norm.eps)

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
        """The gate, residual, norm and modulation in one pass (quantising where every projection `into` is FP8)."""
        if _reads_fp8_rows(into):
            x, values, row_scale = torch.ops.flowjam.add_norm_quantize(
                x, delta, gate, norm.weight, scale, shift, norm.eps
            )
            return x, Fp8Rows(values, row_scale, tuple(x.shape))
        return torch.ops.flowjam.add_norm_modulate(x, delta, gate, norm.weight, scale, shift, norm.eps)


def _input_for(linear: nn.Module, inputs: torch.Tensor | Fp8Rows) -> torch.Tensor | Fp8Rows:
    """`inputs` quantised in one pass where `linear` is a bare Fp8Linear (which would quantise them in two)."""
    if isinstance(inputs, Fp8Rows) or not _reads_fp8_rows((linear,)):
        return inputs
    values, row_scale = torch.ops.flowjam.quantize_input(inputs, None)
    return Fp8Rows(values, row_scale, tuple(inputs.shape))


def _reads_fp8_rows(into: tuple[nn.Module, ...]) -> bool:
    """Whether every projection `into` is a bare Fp8Linear (a LoRA-wrapped one reads the unquantised input too)."""
    return bool(into) and all(type(linear) is Fp8Linear for linear in into)


FUSED_OPS = FusedOps()
