"""Triton GEMMs with the DiT layer's elementwise work in their epilogues (Hopper: TMA loads, wgmma, a persistent
grid of one program per multiprocessor walking the output tiles).

`swiglu`: silu(x @ Wg^T) * (x @ Wu^T) from gate and up weights stored as one [2, N, K] tensor (`ops.pair_mlp`): one
TMA box brings a tile's gate and up rows together, one 2 x BLOCK_N-wide product makes both, and the SiLU-mul is
applied to the fp32 accumulator, so the [M, 2N] activations never reach memory. (A GEMM with the AdaLN gate and
the residual in its epilogue, for o_proj and down_proj, lost to cuBLAS's GEMM + the norm pass on the H100 and the
H200 at every shape and cost first-use warm-up time: measured and removed, docs/benchmarks.md.)

Row edges (M not a multiple of the tile) are handled by the TMA engine (loads past the end read zeros, stores past
it are dropped); N and K must be multiples of 64 (`engine.kernels.supports`). This module imports Triton, so it is
imported only where `engine.kernels.fused_kernels_available` said yes."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from . import row_band
from .tuning import autotuned


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _swiglu_blocks(nargs: dict) -> None:
    """Autotune pre-hook: give the TMA descriptors the block shapes of the config being run."""
    block_m, block_n, block_k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [block_m, block_k]
    nargs["w_desc"].block_shape = [2, block_n, block_k]
    nargs["out_desc"].block_shape = [block_m, block_n]


def _config(block_m: int, block_n: int, stages: int, warps: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": 64, "GROUP_M": 8},
        num_stages=stages,
        num_warps=warps,
        pre_hook=_swiglu_blocks,
    )


# Measured on an H200 at the turbo-2b shapes (docs/benchmarks.md, "Fused kernels"): the paired 128 x (2 x 128) tile
# on 8 warps leads from 1,500 rows up.
SWIGLU_CONFIGS = [_config(*shape) for shape in ((128, 128, 3, 8), (128, 128, 4, 8), (128, 64, 4, 4))]


@triton.jit
def _tile_at(tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """(row block, column block) of the tile'th output tile: GROUP_M row blocks sweep the columns together, so
    their weight tiles are read from L2."""
    per_group = GROUP_M * tiles_n
    first_m = (tile // per_group) * GROUP_M
    group_rows = min(tiles_m - first_m, GROUP_M)
    return first_m + (tile % per_group) % group_rows, (tile % per_group) // group_rows


@autotuned(SWIGLU_CONFIGS, ["m_band", "N", "K"])
@triton.jit
def _swiglu_gemm(
    a_desc,
    w_desc,
    out_desc,
    M,
    N,
    K,
    m_band,
    PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, PROGRAMS, flatten=True):
        pid_m, pid_n = _tile_at(tile, tiles_m, tiles_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = a_desc.load([off_m, k])
            w = w_desc.load([0, off_n, k]).reshape(2 * BLOCK_N, BLOCK_K)  # gate rows, then up rows
            acc = tl.dot(a, w.T, acc)
        gate, up = acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
        out_desc.store([off_m, off_n], (gate * tl.sigmoid(gate) * up).to(out_desc.dtype))


def _descriptor(t: torch.Tensor) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, [1] * t.dim())  # block shape set per config by the pre-hook


def _persistent_grid(m: int, n: int, programs: int):
    return lambda meta: (min(programs, triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])),)


def swiglu(x: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """silu(x @ pair[0]^T) * (x @ pair[1]^T) for x [M, K] and gate|up weights pair [2, N, K] (bf16 or fp16)."""
    m, k = x.shape
    n = pair.shape[1]
    x = x.contiguous()
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    programs = _multiprocessors(x.get_device())
    grid = _persistent_grid(m, n, programs)
    _swiglu_gemm[grid](_descriptor(x), _descriptor(pair), _descriptor(out), m, n, k, row_band(m), PROGRAMS=programs)
    return out


@triton.jit
def _silu_mul(gate_ptr, up_ptr, out_ptr, count, n, stride, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < count
    at = (offsets // n) * stride + offsets % n  # gate and up rows `stride` apart: two tensors, or one's two halves
    gate = tl.load(gate_ptr + at, mask=inside).to(tl.float32)
    up = tl.load(up_ptr + at, mask=inside).to(tl.float32)
    tl.store(out_ptr + offsets, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [M, N] in one pass (what Inductor makes of it): the unfused path's second half. gate and up
    may be the two column halves of one GEMM's output (rows of one stride, unit column stride)."""
    m, n = gate.shape
    if gate.stride(1) != 1 or up.stride() != gate.stride():
        gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty((m, n), device=gate.device, dtype=gate.dtype)
    _silu_mul[(triton.cdiv(m * n, 4096),)](gate, up, out, m * n, n, gate.stride(0), BLOCK=4096)
    return out


def paired_gemm_silu_mul(a: torch.Tensor, pair: torch.Tensor) -> torch.Tensor:
    """The SwiGLU without its epilogue kernel: cuBLAS's one GEMM of the paired weights [2, N, K] -> [M, gate | up],
    then `silu_mul` over its two halves."""
    n = pair.shape[1]
    joined = a @ pair.view(-1, pair.shape[-1]).t()
    return silu_mul(joined[:, :n], joined[:, n:])
