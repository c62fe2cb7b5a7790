"""FP8 (e4m3) linear layers for the DiT: weights quantized once with one scale per output channel, activations
quantized per token at run time, multiplied by `torch._scaled_mm` (FP8 tensor cores on Ada/Hopper GPUs; a CPU
implementation exists too, which is what CI tests). A layer's input may come quantised already (`Fp8Rows`, what
the fused norm pass writes when every layer it feeds is FP8)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .layers import stacked_rows

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores
LAYER_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "cross_attn.q_proj",
    "cross_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)  # cross_attn.k/v run once per condition, not per tick: they stay in the model's dtype


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 values, fp32 scales [M, 1]) with each row's largest magnitude mapped to 448."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).to(FP8), scale


class Fp8Rows(NamedTuple):
    """An activation [..., K] quantised by rows: what `quantize_rows` makes of it, with the shape it had."""

    values: torch.Tensor  # [M, K] e4m3
    scale: torch.Tensor  # [M, 1] fp32
    shape: tuple[int, ...]


class Fp8Linear(nn.Module):
    """A bias-free linear layer with e4m3 weights (per-output-channel scales) and per-token activation scales."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("Fp8Linear takes bias-free linear layers")
        weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight", weight)  # [N, K]
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]
        self.out_dtype = linear.weight.dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        values, scale = (x.values, x.scale) if isinstance(x, Fp8Rows) else quantize_rows(x.reshape(-1, x.shape[-1]))
        out = torch._scaled_mm(
            values, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, out_dtype=self.out_dtype
        )
        return out.reshape(*x.shape[:-1], self.out_features)


def stack_fp8(linears: tuple[Fp8Linear, ...]) -> None:
    """Store these FP8 linears' weights as consecutive rows of one e4m3 tensor and their scales as consecutive
    columns of one [1, sum of N] tensor, each layer's buffers becoming views of them: one `torch._scaled_mm` can
    then run them all (the layers' own outputs are unchanged)."""
    weight = torch.cat([linear.weight for linear in linears])
    scale = torch.cat([linear.weight_scale for linear in linears], dim=1)
    start = 0
    for linear in linears:
        linear.weight = weight[start : start + linear.out_features]
        linear.weight_scale = scale[:, start : start + linear.out_features]
        start += linear.out_features


def stacked_fp8(
    weights: tuple[torch.Tensor, ...], scales: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(e4m3 rows [sum of N, K], scales [1, sum of N]) of FP8 linears' weights and scales where `stack_fp8` stacked
    them, else None."""
    rows = stacked_rows(*weights)
    columns = stacked_rows(*(scale.t() for scale in scales))  # each [1, N_i] scale read as [N_i, 1] rows
    return None if rows is None or columns is None else (rows, columns.t())


def check_fp8_device(device: torch.device) -> None:
    """Refuse FP8 where it would not run on tensor cores, naming the fix."""
    if device.type != "cuda":
        raise ValueError("precision 'fp8' needs an NVIDIA GPU with FP8 tensor cores (Ada or Hopper); use 'bf16'")
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"precision 'fp8' needs compute capability 8.9+ (Ada, Hopper); {torch.cuda.get_device_name(device)} "
            f"is {capability[0]}.{capability[1]}: use 'bf16'"
        )


def to_fp8(decoder: nn.Module) -> int:
    """Replace the per-tick linear layers of every DiT layer by Fp8Linear, in place; returns how many."""
    replaced = 0
    for layer in decoder.layers:
        for path in LAYER_LINEARS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            linear = getattr(parent, name)
            if isinstance(linear, nn.Linear):
                setattr(parent, name, Fp8Linear(linear))
                replaced += 1
    decoder.clear_folded_constants()
    return replaced
