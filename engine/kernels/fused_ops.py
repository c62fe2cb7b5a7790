"""A DiT layer through the fused kernels (`FusedOps`, what compile-graph runs on GPUs that run them) and the choice
it follows: per projection shape, whether the gated-residual GEMM beats cuBLAS on this GPU (timed once, before
the layers are traced, so compiled code never re-decides); docs/benchmarks.md, "Fused
kernels", has the measurements."""

from __future__ import annotations

import torch
from torch import nn

from ..models.dit import DiTDecoder, LayerOps
from ..models.fp8 import Fp8Linear, Fp8Rows
from ..models.layers import Attention, RMSNorm, SwiGLU
from . import supports
from .ops import forced, gated_residual, plain_linears, time_ms
from .qkv_ops import split_heads

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


def _qkv_taken(attn: Attention) -> bool:
    """Whether this self-attention runs its q/k/v through the one-GEMM op (plain linears; the op itself checks that
    the weights are stacked, as compiled code never reads addresses, and picks its kernel per row band)."""
    return plain_linears(attn.q_proj, attn.k_proj, attn.v_proj)


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
    """A DiT layer through the fused ops: the SwiGLU and the self-attention's q/k/v with their norms and RoPE always
    (each op measures its two paths per row band; FP8 q/k/v as one scaled GEMM and the norm + RoPE pass), a gated
    residual where `choose_residuals` found the kernel faster, every norm and modulation in one pass with the
    residual before it, and every FP8 projection's input quantised by the pass that makes it. LoRA-wrapped
    linears run as LayerOps' (the norm pass after them still runs)."""

    @staticmethod
    def residual(
        x: torch.Tensor, linear: nn.Module, inputs: torch.Tensor | Fp8Rows, gate: torch.Tensor | None
    ) -> torch.Tensor:
        if not _residual_kernel_taken(linear):
            return LayerOps.residual(x, linear, _input_for(linear, inputs), gate)
        return torch.ops.flowjam.gated_residual(x, inputs, linear.weight, gate)

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
        delta = linear(_input_for(linear, inputs))
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
