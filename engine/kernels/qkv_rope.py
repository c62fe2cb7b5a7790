"""Triton: a self-attention's q, k and v projections as one GEMM, with the per-head RMSNorm of q and k and their
rotary embedding in its epilogue (Hopper: TMA loads, wgmma, a persistent grid walking the output tiles); and the
same norm and rotation as a pass of its own over the q and k columns of cuBLAS's GEMM of the same weights, the
op's other path (qkv_ops.py times the two per row band).

The weights are the rows [q; k; v] of one tensor (`ops.stack_qkv`) and a tile is one head wide, so its
epilogue holds the head's whole vector for each of its rows: it normalises it (statistics in fp32), applies the
norm's weight, rotates it (rotate-half RoPE, the angle of the row's token) and stores it once. The output is
[M, (heads + 2 kv_heads) x head_dim], token-major: q, k and v are column slices of it, in the layout the eager
projections have. Inductor runs the same as a GEMM per projection, then a norm + RoPE kernel reading q and k again.
This module imports Triton, so it is imported only where `engine.kernels.fused_kernels_available` said yes."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import row_band
from .gemm_epilogue import _multiprocessors, _tile_at
from .tuning import autotuned


def _blocks(nargs: dict) -> None:
    """Autotune pre-hook: give the TMA descriptors the block shapes of the config being run."""
    block_m, block_k, head = nargs["BLOCK_M"], nargs["BLOCK_K"], nargs["HEAD"]
    nargs["a_desc"].block_shape = [block_m, block_k]
    nargs["w_desc"].block_shape = [head, block_k]
    nargs["out_desc"].block_shape = [block_m, head]


@triton.jit
def _norm_rope(
    head, off_m, off_n, q_columns, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, tokens, eps,
    BLOCK_M: tl.constexpr, HEAD: tl.constexpr,
):  # fmt: skip
    """[BLOCK_M, HEAD] fp32 values of one q or k head (column off_n) of rows off_m.. -> normed, weighted, rotated."""
    HALF: tl.constexpr = HEAD // 2
    rstd = tl.rsqrt(tl.sum(head * head, axis=1) / HEAD + eps)
    dims = tl.arange(0, HEAD)
    norm_weight = tl.where(
        off_n < q_columns,
        tl.load(q_weight_ptr + dims).to(tl.float32),
        tl.load(k_weight_ptr + dims).to(tl.float32),
    )
    normed = head * rstd[:, None] * norm_weight[None, :]
    token = (off_m + tl.arange(0, BLOCK_M)) % tokens
    halves = tl.arange(0, HALF)
    angle_at = token[:, None] * HEAD + halves[None, :]  # the tables repeat their first half in the second
    cos = tl.load(cos_ptr + angle_at).to(tl.float32)
    sin = tl.load(sin_ptr + angle_at).to(tl.float32)
    first, second = normed.reshape(BLOCK_M, 2, HALF).permute(0, 2, 1).split()
    rotated = tl.join(first * cos - second * sin, second * cos + first * sin)  # [BLOCK_M, HALF, 2]
    return rotated.permute(0, 2, 1).reshape(BLOCK_M, HEAD)


QKV_CONFIGS = [
    triton.Config({"BLOCK_M": block_m, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=stages, num_warps=8, pre_hook=_blocks)
    for block_m, stages in ((128, 3), (128, 4), (64, 4))
]


@autotuned(QKV_CONFIGS, ["m_band", "N", "K", "HEAD"])
@triton.jit
def _qkv_norm_rope_gemm(
    a_desc, w_desc, out_desc, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr,
    M, N, K, m_band, tokens, q_columns, k_end, eps,
    PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    HEAD: tl.constexpr,
):  # fmt: skip
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = N // HEAD
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * HEAD
        acc = tl.zeros((BLOCK_M, HEAD), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
        if off_n < k_end:  # a q or k head: RMSNorm over the head, its weight, then the rotation
            rounded = acc.to(out_desc.dtype).to(tl.float32)  # the projection's output rounded, as eager stores it
            acc = _norm_rope(rounded, off_m, off_n, q_columns, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, tokens, eps,
                             BLOCK_M, HEAD)  # fmt: skip
        out_desc.store([off_m, off_n], acc.to(out_desc.dtype))


PASS_ROWS = 32  # rows per program of the separate pass (memory-bound: one head of 32 rows is 8 KB in bf16 at 128)


@triton.jit
def _norm_rope_columns(
    out_ptr, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, M, N, tokens, q_columns, eps,
    BLOCK_M: tl.constexpr, HEAD: tl.constexpr,
):  # fmt: skip
    """In place over [M, N]: program (i, j) norms and rotates head j of the q and k columns in rows i*BLOCK_M.."""
    off_m = tl.program_id(0) * BLOCK_M
    off_n = tl.program_id(1) * HEAD
    rows = off_m + tl.arange(0, BLOCK_M)
    at = rows[:, None] * N + off_n + tl.arange(0, HEAD)[None, :]
    inside = (rows < M)[:, None]
    head = tl.load(out_ptr + at, mask=inside, other=0.0).to(tl.float32)
    head = _norm_rope(head, off_m, off_n, q_columns, q_weight_ptr, k_weight_ptr, cos_ptr, sin_ptr, tokens, eps,
                      BLOCK_M, HEAD)  # fmt: skip
    tl.store(out_ptr + at, head.to(out_ptr.dtype.element_ty), mask=inside)


def _descriptor(t: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, [1] * t.dim())  # block shape set per config by the pre-hook


def qkv_norm_rope(
    a: torch.Tensor,
    weight: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_columns: int,
    k_columns: int,
    eps: float,
) -> torch.Tensor:
    """[M, N] = a [M, K] @ weight [N, K]^T with rows [q; k; v] (q `q_columns` wide, k `k_columns`), q and k heads
    RMS-normed (weights q_norm, k_norm [head_dim]) and rotated by the tables cos, sin [tokens, head_dim], row r being
    token r % tokens."""
    m, k = a.shape
    n = weight.shape[0]
    a = a.contiguous()
    out = torch.empty((m, n), device=a.device, dtype=a.dtype)
    programs = _multiprocessors(a.get_device())
    tokens, head = cos.shape

    def grid(meta: dict) -> tuple[int]:
        return (min(programs, triton.cdiv(m, meta["BLOCK_M"]) * (n // head)),)

    _qkv_norm_rope_gemm[grid](
        _descriptor(a), _descriptor(weight), _descriptor(out), q_norm, k_norm, cos.contiguous(), sin.contiguous(),
        m, n, k, row_band(m), tokens, q_columns, q_columns + k_columns, eps,
        PROGRAMS=programs, HEAD=head,
    )  # fmt: skip
    return out


def norm_rope_columns(
    out: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_columns: int,
    k_columns: int,
    eps: float,
) -> torch.Tensor:
    """`qkv_norm_rope`'s epilogue as a pass over a finished [M, N] = [q | k | v] (cuBLAS's GEMM of the same stacked
    weights): the q and k heads normed and rotated in place; returns `out`."""
    m, n = out.shape
    tokens, head = cos.shape
    q_and_k_heads = (q_columns + k_columns) // head
    _norm_rope_columns[(triton.cdiv(m, PASS_ROWS), q_and_k_heads)](
        out, q_norm, k_norm, cos.contiguous(), sin.contiguous(), m, n, tokens, q_columns, eps,
        BLOCK_M=PASS_ROWS, HEAD=head, num_warps=4,
    )  # fmt: skip
    return out
