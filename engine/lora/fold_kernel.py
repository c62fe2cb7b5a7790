"""The fold of a layer's low-rank LoRAs as one GPU kernel (Triton, where installed): each weight tile is
rest + (up x column strengths) @ down, read once from the resting weight and written once. A copy then an in-place
addmm moves the weight through memory twice as often (H200, turbo-2b: docs/benchmarks.md)."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the fold runs as torch ops (folded.py)
    triton = None

BLOCK_M, BLOCK_N, BLOCK_R, WARPS, STAGES = 64, 128, 32, 4, 2  # the fastest of 18 tried (H200, turbo-2b)
FUSED_DTYPES = (torch.bfloat16, torch.float16)  # fp32 folds by torch ops (tensor-core dot products would be TF32)


def fused_fold_available(weight: torch.Tensor) -> bool:
    return triton is not None and weight.is_cuda and weight.dtype in FUSED_DTYPES


def fold_low_rank(
    rest: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    column_scale: torch.Tensor,
    column_slot: torch.Tensor,
    strengths: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """out [M, N] = rest + (up [M, R] * column_scale * strengths[column_slot]) @ down [R, N], rounded once."""
    rows, columns = out.shape
    rank = down.shape[0]
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(columns, BLOCK_N))
    _fold_tile[grid](
        rest,
        up.contiguous(),
        down.contiguous(),
        column_scale,
        column_slot,
        strengths,
        out,
        rows,
        columns,
        rank,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_R=BLOCK_R,
        num_warps=WARPS,
        num_stages=STAGES,
    )


if triton is not None:

    @triton.jit
    def _fold_tile(
        rest_ptr,
        up_ptr,
        down_ptr,
        scale_ptr,
        slot_ptr,
        strength_ptr,
        out_ptr,
        rows,
        columns,
        rank,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
    ):
        row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        column = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for start in range(0, rank, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)
            in_rank = r < rank
            strength = tl.load(strength_ptr + tl.load(slot_ptr + r, mask=in_rank, other=0), mask=in_rank, other=0.0)
            scale = tl.load(scale_ptr + r, mask=in_rank, other=0.0) * strength
            up = tl.load(
                up_ptr + row[:, None] * rank + r[None, :], mask=(row[:, None] < rows) & in_rank[None, :], other=0.0
            )
            down = tl.load(
                down_ptr + r[:, None] * columns + column[None, :],
                mask=in_rank[:, None] & (column[None, :] < columns),
                other=0.0,
            )
            total += tl.dot((up.to(tl.float32) * scale[None, :]).to(down.dtype), down)
        inside = (row[:, None] < rows) & (column[None, :] < columns)
        offsets = row[:, None] * columns + column[None, :]
        weight = tl.load(rest_ptr + offsets, mask=inside, other=0.0).to(tl.float32) + total
        tl.store(out_ptr + offsets, weight.to(out_ptr.dtype.element_ty), mask=inside)
