"""Triton: an FP8 projection's input quantised by rows in one pass, where no norm pass precedes it: the MLP's
silu(gate) * up before the down projection (`GATED`), the attention heads before an output projection.

One program holds a row in registers: it computes the activation (silu rounded to the dtype, then the product
rounded, as the eager layer stores them), its largest magnitude, and writes the e4m3 values and the row's scale,
what `models.fp8.quantize_rows` makes of the stored activation. Inductor makes a reduction kernel of the same
that reads the row twice (once for the magnitude, once to scale it). Imported only where the kernels run."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..models.fp8 import FP8
from .norm_modulate import FP8_MAX, ROW_CONFIGS
from .tuning import autotuned


@autotuned(ROW_CONFIGS, ["n", "GATED"])
@triton.jit
def _quantize_rows(
    x_ptr, up_ptr, values_ptr, scale_ptr, n, GATED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n
    offsets = row * n + cols
    x = tl.load(x_ptr + offsets, mask=inside, other=0.0)
    if GATED:  # silu(gate) rounded, then its product with up rounded: the eager layer's two stored tensors
        gate = x.to(tl.float32)
        silu = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
        up = tl.load(up_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
        x = (silu * up).to(x_ptr.dtype.element_ty)
    x = x.to(tl.float32)
    row_scale = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-12) / FP8_MAX
    tl.store(scale_ptr + row, row_scale)
    values = tl.div_rn(x, tl.broadcast_to(row_scale, x.shape))  # IEEE division, as torch divides
    tl.store(values_ptr + offsets, values.to(values_ptr.dtype.element_ty), mask=inside)


def quantize_rows(x: torch.Tensor, up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, N] -> (e4m3 values [M, N], fp32 row scales [M, 1]) of x, or of silu(x) * up where `up` is given."""
    m, n = x.shape
    values = torch.empty((m, n), device=x.device, dtype=FP8)
    scale = torch.empty((m, 1), device=x.device, dtype=torch.float32)
    x = x.contiguous()
    gated = up is not None
    _quantize_rows[(m,)](
        x, up.contiguous() if gated else x, values, scale, n, GATED=gated, BLOCK=triton.next_power_of_2(n)
    )  # fmt: skip
    return values, scale
