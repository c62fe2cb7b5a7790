"""Triton: a DiT layer's residual add, RMSNorm and AdaLN modulation in one pass over each row.

`add_norm_modulate`: x' = x + delta * gate[batch] (the projection just made, gated), then
h = rmsnorm(x') * weight * (1 + scale[batch]) + shift[batch], writing x' and h; `norm_modulate`: h alone from x.
Inductor makes two kernels of this (the row statistics, then the elementwise pass that reads everything again);
here one program holds a whole row in registers, so every tensor is read once and written once. Statistics and
products are fp32; x' is rounded to its dtype before it is normalised, as the eager layer normalises the stored x'.
The gate, scale and shift vectors are one per batch row ([B, N], any row stride; B = 1 broadcasts). For FP8
projections the pass writes h quantised instead (`quantize=True`): e4m3 values and the row's scale (its largest
magnitude over 448), exactly what `models.fp8.quantize_rows` makes of the rounded h, so no pass reads h again."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .tuning import autotuned

FP8_MAX = tl.constexpr(448.0)  # e4m3's largest magnitude (models/fp8.py)
ROW_CONFIGS = [triton.Config({}, num_warps=warps) for warps in (4, 8, 16)]


@autotuned(ROW_CONFIGS, ["n"])
@triton.jit
def _add_norm_modulate(
    x_ptr, delta_ptr, gate_ptr, weight_ptr, scale_ptr, shift_ptr, x_out_ptr, h_ptr, row_scale_ptr,
    n, tokens, gate_stride, scale_stride, shift_stride, eps,
    ADD: tl.constexpr, GATE: tl.constexpr, MODULATE: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    batch = row // tokens
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    offsets = row.to(tl.int64) * n + cols
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    if ADD:
        delta = tl.load(delta_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        if GATE:
            delta *= tl.load(gate_ptr + batch * gate_stride + cols, mask=inside, other=0.0).to(tl.float32)
        stored = (x + delta).to(x_out_ptr.dtype.element_ty)
        tl.store(x_out_ptr + offsets, stored, mask=inside)
        x = stored.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n + eps)
    h = x * rstd * tl.load(weight_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    if MODULATE:
        scale = tl.load(scale_ptr + batch * scale_stride + cols, mask=inside, other=0.0).to(tl.float32)
        shift = tl.load(shift_ptr + batch * shift_stride + cols, mask=inside, other=0.0).to(tl.float32)
        h = h * (1.0 + scale) + shift
    if QUANTIZE:  # h rounded to the activations' dtype first, as the unfused path quantises the stored h
        h = h.to(x_out_ptr.dtype.element_ty).to(tl.float32)
        row_scale = tl.maximum(tl.max(tl.abs(h), axis=0), 1e-12) / FP8_MAX
        tl.store(row_scale_ptr + row, row_scale)
        h = h / row_scale
    tl.store(h_ptr + offsets, h.to(h_ptr.dtype.element_ty), mask=inside)


def _batch_stride(vector: torch.Tensor | None, batch: int, n: int) -> int:
    """The row stride of a [B or 1, N] vector (0 where one row serves every batch row)."""
    if vector is None:
        return 0
    if vector.dim() != 2 or vector.shape[0] not in (1, batch) or vector.shape[1] != n or vector.stride(1) != 1:
        raise ValueError(
            f"a per-batch-row vector must be [{batch} or 1, {n}] with unit column stride, not "
            f"{list(vector.shape)} with strides {vector.stride()}"
        )
    return 0 if vector.shape[0] == 1 else vector.stride(0)


def add_norm_modulate(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x', h) for x [B, S, N] and delta [B, S, N] (None: x' is x, not written), gate/scale/shift [B or 1, N] with
    unit column stride (None: no gate / no modulation), weight [N]."""
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return _launch(x, delta, gate, weight, scale, shift, eps, h, None), h


def add_norm_quantize(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`add_norm_modulate` with h written quantised: (x', e4m3 values [B * S, N], row scales [B * S, 1] fp32)."""
    rows, n = x.shape[0] * x.shape[1], x.shape[2]
    values = torch.empty(rows, n, dtype=torch.float8_e4m3fn, device=x.device)
    row_scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    return _launch(x, delta, gate, weight, scale, shift, eps, values, row_scale), values, row_scale


def _launch(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    shift: torch.Tensor | None,
    eps: float,
    h: torch.Tensor,
    row_scale: torch.Tensor | None,
) -> torch.Tensor:
    """Run the pass into `h` (and `row_scale`, quantising); -> x'."""
    batch, tokens, n = x.shape
    if (scale is None) != (shift is None):
        raise ValueError("AdaLN modulation needs both scale and shift (or neither)")
    x = x.contiguous()
    x_out = x if delta is None else torch.empty_like(x)
    mod = scale if scale is not None else weight
    _add_norm_modulate[(batch * tokens,)](
        x, x if delta is None else delta.contiguous(), x if gate is None else gate, weight, mod,
        mod if shift is None else shift, x_out, h, weight if row_scale is None else row_scale,
        n, tokens, _batch_stride(gate, batch, n), _batch_stride(scale, batch, n), _batch_stride(shift, batch, n), eps,
        ADD=delta is not None, GATE=gate is not None, MODULATE=scale is not None, QUANTIZE=row_scale is not None,
        BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return x_out
