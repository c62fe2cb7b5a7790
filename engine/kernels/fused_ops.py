"""A DiT layer through the fused kernels (`FusedOps`, what compile-graph runs on GPUs that run them) and the choices
it follows: per projection shape, whether the gated-residual GEMM and the q/k/v GEMM beat cuBLAS on this GPU
(timed once, before the layers are traced, so compiled code never re-decides); docs/benchmarks.md, "Fused
kernels", has the measurements."""

from __future__ import annotations

import torch
from torch import nn

from ..models.dit import DiTDecoder, LayerOps
from ..models.fp8 import Fp8Linear, Fp8Rows
from ..models.layers import Attention, RMSNorm, SwiGLU, rope_cos_sin, stacked_rows
from . import supports
from .ops import forced, gated_residual, plain_linears, time_ms
from .qkv_ops import qkv_norm_rope, split_heads

TIMING_ROWS = 4096  # rows the GEMM kernels are timed at against cuBLAS (8 batch rows of 512 tokens)
RESIDUAL_FUSED: dict[tuple, bool] = {}
"""By (N, K, dtype, device): whether the gated-residual kernel beat cuBLAS's GEMM alone (`choose_residuals`)."""


def choose_residuals(decoder: DiTDecoder) -> dict[tuple, bool]:
    """Time the gated-residual kernel against cuBLAS's bare GEMM at each of the decoder's projection shapes (o_proj,
    down_proj), once per shape and device: where the kernel is not faster, `FusedOps` runs cuBLAS's GEMM and leaves
    the gate and residual to the pass after it (o_proj's to the norm pass, down_proj's to Inductor's next kernel).
    Decided before the layers are traced, so compiled code never re-decides. Returns the decisions for this
    decoder's shapes."""
    layer = decoder.layers[0]
    weights = [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight]
    for weight in weights:
        key = _weight_key(weight)
        if key not in RESIDUAL_FUSED:
            RESIDUAL_FUSED[key] = _residual_kernel_wins(weight)
    return {_weight_key(weight): RESIDUAL_FUSED[_weight_key(weight)] for weight in weights}


def _residual_kernel_wins(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    if weight.dtype not in (torch.bfloat16, torch.float16) or not supports(TIMING_ROWS, n, k):
        return False
    batch, like = 8, dict(device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        inputs = torch.randn(batch, TIMING_ROWS // batch, k, **like)
        x = torch.randn(batch, TIMING_ROWS // batch, n, **like)
        gate = torch.randn(batch, 1, n, **like)
        fused_ms = time_ms(lambda: gated_residual(x, inputs, weight, gate))
        bare_ms = time_ms(lambda: inputs @ weight.t())
    return fused_ms < bare_ms


QKV_FUSED: dict[tuple, bool] = {}
"""By (N, K, dtype, device) of the stacked q/k/v weights: whether the q/k/v kernel beat cuBLAS (`choose_qkv`)."""


def choose_qkv(decoder: DiTDecoder) -> dict[tuple, bool]:
    """Time the q/k/v kernel (one GEMM with the q/k norms and RoPE in its epilogue) against cuBLAS's GEMM of the
    same stacked weights plus one copy of the q and k columns, the least any separate norm + RoPE pass costs; once
    per shape and device, before the layers are traced (`stack_qkv_weights` first). Where the kernel is not
    faster, `FusedOps` runs the projections as LayerOps does. Returns the decision for this decoder's shape."""
    attn = decoder.layers[0].self_attn
    rows = stacked_rows(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    if rows is None:
        return {}
    key = _qkv_key(attn)
    if key not in QKV_FUSED:
        QKV_FUSED[key] = _qkv_kernel_wins(attn, rows, decoder.config.rope_theta)
    return {key: QKV_FUSED[key]}


def _qkv_kernel_wins(attn: Attention, rows: torch.Tensor, theta: float) -> bool:
    n, k = rows.shape
    if rows.dtype not in (torch.bfloat16, torch.float16) or not supports(TIMING_ROWS, n, k):
        return False
    batch, like = 8, dict(device=rows.device, dtype=rows.dtype)
    tokens = TIMING_ROWS // batch
    with torch.no_grad():
        h = torch.randn(batch, tokens, k, **like)
        cos, sin = rope_cos_sin(torch.arange(tokens, device=rows.device), attn.head_dim, theta, rows.dtype)
        weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_norm.weight, attn.k_norm.weight)
        fused_ms = time_ms(lambda: qkv_norm_rope(h, *weights, cos, sin, attn.q_norm.eps))
        q_and_k = h.new_empty(2, batch * tokens, n - attn.v_proj.weight.shape[0])
        bare_ms = time_ms(lambda: h @ rows.t()) + time_ms(lambda: q_and_k[1].copy_(q_and_k[0]))
    return fused_ms < bare_ms


def _qkv_kernel_taken(attn: Attention) -> bool:
    """Whether this self-attention runs its q/k/v through the kernel op (forced, or chosen by `choose_qkv`); the op
    itself checks that the weights are stacked (compiled code never reads addresses)."""
    return plain_linears(attn.q_proj, attn.k_proj, attn.v_proj) and _chosen(QKV_FUSED, _qkv_key(attn))


def _qkv_key(attn: Attention) -> tuple:
    weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    first = weights[0]
    return (sum(w.shape[0] for w in weights), first.shape[1], first.dtype, first.device)


def _weight_key(weight: torch.Tensor) -> tuple:
    return (*weight.shape, weight.dtype, weight.device)


def _residual_kernel_taken(linear: nn.Module) -> bool:
    """Whether this projection runs as the gated-residual GEMM (forced, or chosen by `choose_residuals`)."""
    return plain_linears(linear) and _chosen(RESIDUAL_FUSED, _weight_key(linear.weight))


def _chosen(decisions: dict[tuple, bool], key: tuple) -> bool:
    """The path `forced_path` forces, else what was measured for `key` (unmeasured: not fused)."""
    choice = forced()
    return bool(decisions.get(key)) if choice is None else choice


class FusedOps(LayerOps):
    """A DiT layer through the fused ops: the SwiGLU always (each shape's faster path measured inside the op), a gated
    residual where `choose_residuals` found the kernel faster, the self-attention's q/k/v with their norms and RoPE
    in one GEMM where `choose_qkv` did, every norm and modulation in one pass with the residual before it. GEMMs the
    ops do not take (FP8, LoRA-wrapped linears) run as LayerOps' (the norm pass after them still runs, quantising
    for FP8)."""

    @staticmethod
    def residual(x: torch.Tensor, linear: nn.Module, inputs: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        if not _residual_kernel_taken(linear):
            return LayerOps.residual(x, linear, inputs, gate)
        return torch.ops.flowjam.gated_residual(x, inputs, linear.weight, gate)

    @staticmethod
    def self_attention(
        attn: Attention, h: torch.Tensor | Fp8Rows, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
    ) -> torch.Tensor:
        if not _qkv_kernel_taken(attn):
            return LayerOps.self_attention(attn, h, rope, mask)
        weights = (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.q_norm.weight, attn.k_norm.weight)
        joined = torch.ops.flowjam.qkv_norm_rope(h, *weights, *rope, attn.q_norm.eps)
        return attn.heads_attention(*split_heads(attn, joined), mask)

    @staticmethod
    def swiglu(mlp: SwiGLU, h: torch.Tensor) -> torch.Tensor:
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
        """The projection alone (cuBLAS, or FP8 / LoRA-wrapped as it comes), then the gate, residual, norm and
        modulation in one pass (quantising where every projection `into` is FP8); with the gated-residual GEMM
        where that was chosen."""
        if _residual_kernel_taken(linear):
            x = torch.ops.flowjam.gated_residual(x, inputs, linear.weight, gate)
            return x, self.modulated_norm(norm, x, scale, shift, into)
        if _reads_fp8_rows(into):
            x, values, row_scale = torch.ops.flowjam.add_norm_quantize(
                x, linear(inputs), gate, norm.weight, scale, shift, norm.eps
            )
            return x, Fp8Rows(values, row_scale, tuple(x.shape))
        return torch.ops.flowjam.add_norm_modulate(x, linear(inputs), gate, norm.weight, scale, shift, norm.eps)


def _reads_fp8_rows(into: tuple[nn.Module, ...]) -> bool:
    """Whether every projection `into` is a bare Fp8Linear (a LoRA-wrapped one reads the unquantised input too)."""
    return bool(into) and all(type(linear) is Fp8Linear for linear in into)


FUSED_OPS = FusedOps()
