"""Fused GPU kernels for the DiT layer (Triton, Hopper): the gate|up GEMM with the SwiGLU in its epilogue
(gemm_epilogue.py); the q/k/v projections as one GEMM with the heads' RMSNorm and RoPE in its epilogue,
or those as a pass after cuBLAS's GEMM (qkv_rope.py); the residual add, RMSNorm and AdaLN modulation in one pass,
writing FP8 projections' inputs quantised (norm_modulate.py), and the other FP8 inputs quantised in one pass
(quantize.py); their tile shapes tuned once per GPU (tuning.py).
`fused_kernels_available` says where they run; elsewhere the layer runs as plain PyTorch (or Inductor's
code), the same math. The `compile-graph` backend uses them (engine/stream/backends.py)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Iterator

import torch

ALIGNMENT = 64  # the kernels' N and K must be multiples of this (every DiT preset's hidden and intermediate sizes are)
MIN_CAPABILITY = (9, 0)  # the kernels load through the TMA engine (Hopper and newer)
DISABLE_ENV = "FLOWJAM_FUSED_KERNELS"  # "0" turns them off (today's compiled path everywhere)


@functools.cache
def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def fused_kernels_available(device: torch.device | str) -> bool:
    """Whether the fused kernels run on `device`: a CUDA GPU of compute capability 9.0+, Triton installed, and not
    turned off by FLOWJAM_FUSED_KERNELS=0."""
    device = torch.device(device)
    return device.type == "cuda" and _cuda_runs_them(device.index, os.environ.get(DISABLE_ENV, "1") != "0")


def supports(m: int, n: int, k: int) -> bool:
    """Whether these GEMM sizes fit the kernels (N and K multiples of ALIGNMENT, at least one row)."""
    return m > 0 and n % ALIGNMENT == 0 and k % ALIGNMENT == 0


def supports_head(head_dim: int) -> bool:
    """Whether the q/k/v kernel's tile can be a head of this size wide (a power of two from 16 to 256)."""
    return 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


def row_band(m: int) -> int:
    """Rows rounded up to a power of two: kernel choices and tile shapes are made once per band, not per row count."""
    return 1 << max(m - 1, 0).bit_length()


@functools.cache
def _cuda_runs_them(index: int | None, enabled: bool) -> bool:
    return enabled and _triton_importable() and torch.cuda.get_device_capability(index) >= MIN_CAPABILITY


@contextlib.contextmanager
def fused_kernels_turned(on: bool) -> Iterator[None]:
    """FLOWJAM_FUSED_KERNELS set for the duration (pipelines made inside take that path for good): what `bench tick
    --fused-kernels on off` compares."""
    before = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[DISABLE_ENV]
        else:
            os.environ[DISABLE_ENV] = before
